"""`benchmarks/prefix_cache_sim.py` stands for the engine: its scheduler-only replay of a multi-turn chat workload
gives what a real engine running a model gives on that workload, step for step (synchronous steps): the same step
count, prefill tokens computed, checkpoints taken and evicted, and each turn's time to first token in steps."""

from __future__ import annotations

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from benchmarks.multiturn_bench import Workload
from benchmarks.prefix_cache_sim import SchedulerBackend, StepEvent, drive, simulate


class EngineBackend:
    """A real engine (a model on the CPU) behind the simulation's driver."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[StepEvent]:
        return [StepEvent(o.request_id, len(o.token_ids) == len(o.new_token_ids) > 0,
                          list(o.token_ids) if o.finished else None) for o in self.engine.step()]


def test_the_simulation_gives_what_an_engine_running_the_model_gives(tmp_path):
    cfg, weights = load_checkpoint(make_model(tmp_path / "tiny", "tiny", seed=3, progress=False, tokenizer=False))
    # Four checkpoint slots for five conversations, three at once: evictions happen.
    ecfg = EngineConfig(block_size=8, max_num_seqs=4, max_num_batched_tokens=48, num_kv_blocks=256,
                        prefix_checkpoint_stride=2, dtype="float32", async_scheduling=False)
    w = Workload(conversations=5, turns=3, system_tokens=70, user_tokens=9, answer_min=3, answer_max=12,
                 concurrency=3, vocab_size=cfg.vocab_size, seed=1)
    sim = simulate(cfg, ecfg, w, progress=False)
    engine = LLMEngine(cfg, weights, ecfg)
    steps, prompt_tokens, ttft = drive(EngineBackend(engine), w, progress=False)
    s = engine.stats
    assert (steps, prompt_tokens) == (sim.steps, sim.prompt_tokens)
    assert (s.prompt_tokens, s.prefix_checkpoints_taken, s.prefix_checkpoint_evictions) == \
        (sim.prefill_tokens, sim.checkpoints_taken, sim.checkpoint_evictions)
    assert sim.checkpoint_evictions > 0 and sim.prefill_tokens < sim.prompt_tokens / 2
    again = drive(SchedulerBackend(cfg, ecfg, w.seed), w, progress=False)[2]
    assert sorted(ttft) == sorted(again)


def test_main_replays_the_gpu_workload_and_prints_the_ratios(capsys):
    from benchmarks.prefix_cache_sim import main

    assert main(["--gpu", "--conversations", "3", "--turns", "2", "--no-progress", "--topology", "disagg"]) == 0
    out = capsys.readouterr().out
    assert "cache: " in out and "no cache: " in out
    assert "mixed-step prompt tokens 0" in out  # a prefill node has no mixed steps
    ratio = float(out.split("off / on: prefill tokens ")[1].split("x")[0])
    assert ratio > 1.5  # the shared system prompt is computed once
