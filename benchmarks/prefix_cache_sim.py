"""Replays multiturn_bench's chat workload through the engine's real scheduler and prefix cache, without a model.

The scheduler works on ints (block ids, slots, token counts), so what it does with a workload does not depend on
the device: which chunks run in which step, which checkpoints are taken and evicted, how many prompt tokens are
computed. This runs `Scheduler` and `StepUpdate` as the engine does, with the pools the engine would size for the
model on the GPU (`plan_cache` from the preset's config and the node's engine flags), and stands in for the model
only where a token is sampled: answers are drawn per conversation and turn, as multiturn_bench's greedy answers are
fixed per turn. Each conversation sends its next turn the step after its answer ends, `concurrency` at once.

It counts what `multiturn_bench.py` measures through the nodes' counters (prefill tokens computed, checkpoint
evictions) and time to first token in steps; it says nothing about a step's duration. Aggregated serving (one
engine that prefills and decodes, with the engine's mixed-step rule on CUDA), or 1P1D's prefill node, whose decode
node is modelled as one token a step (`PrefillBackend`). Synchronous steps: with async scheduling the engine
schedules a step before the one in flight is read, which moves a request's end by one step.
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from baton.engine.cache_pools import plan_cache  # noqa: E402
from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.engine_config import EngineConfig  # noqa: E402
from baton.engine.kv_cache_dtype import resolve_kv_dtype  # noqa: E402
from baton.engine.llm_engine import resolved_mixed_graph_tokens  # noqa: E402
from baton.engine.make_model import build_config  # noqa: E402
from baton.engine.model_family import model_class  # noqa: E402
from baton.engine.request import Request, RequestStatus  # noqa: E402
from baton.engine.sampling_params import SamplingParams  # noqa: E402
from baton.engine.scheduler import Scheduler  # noqa: E402
from baton.engine.step_update import StepUpdate  # noqa: E402
from baton.engine.weights import TORCH_DTYPES  # noqa: E402
from baton.node.engine_args import engine_config_from_args, parse_engine_flags  # noqa: E402
from benchmarks.multiturn_bench import DEFAULTS, Workload  # noqa: E402
from benchmarks.serving_bench import MODEL_PRESETS, Percentiles, summarize  # noqa: E402


@dataclass(frozen=True)
class SimResult:
    steps: int
    prompt_tokens: int        # prompt tokens of every turn sent
    prefill_tokens: int       # of them, computed (prefill rows' tokens, recomputation after preemption included)
    checkpoints_taken: int
    checkpoint_evictions: int
    block_evictions: int
    preemptions: int
    ttft_steps: Percentiles   # steps from a turn's arrival to the step that samples its first token, counted from 1
    num_blocks: int
    num_slots: int
    num_checkpoints: int
    mixed_graph_tokens: int


def model_config(preset: str) -> ModelConfig:
    base, overrides = MODEL_PRESETS.get(preset, (preset, {}))
    return ModelConfig.from_hf_dict(build_config(base, overrides=overrides))


def engine_config(flags: Sequence[str], cfg: ModelConfig, device: str) -> EngineConfig:
    """The engine's config for `flags` as a node on `device` resolves it: the CPU's defaults where the flags leave
    the pools' size out, and on CUDA the mixed-step size of a model whose layers capture graphs."""
    ecfg = engine_config_from_args(parse_engine_flags(flags, "--engine-args"))
    if device == "cuda":
        if ecfg.max_num_seqs is None or (ecfg.cache_memory_bytes is None and ecfg.num_kv_blocks is None):
            raise ValueError("--engine-args: expected --max-num-seqs and --cache-memory-mb (or --num-kv-blocks) for "
                             "a CUDA engine: the simulation cannot measure a GPU's free memory")
        q = resolved_mixed_graph_tokens(ecfg, torch.device("cuda"), graphable=True)
        return replace(ecfg, mixed_graph_tokens=q)
    return ecfg


@dataclass(frozen=True)
class StepEvent:
    request_id: str           # "conversation/turn"
    first_token: bool         # the step sampled its first output token
    answer: list[int] | None  # its output tokens, where the step finished it


class SchedulerBackend:
    """The engine's scheduler and step update on their own; each sampled token drawn per conversation and turn."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, seed: int) -> None:
        dtype = TORCH_DTYPES[cfg.torch_dtype if ecfg.dtype == "auto" else ecfg.dtype]
        ssm_dtype = TORCH_DTYPES[ecfg.ssm_state_dtype or cfg.mamba_ssm_cache_dtype]
        # (The device's checks are the engine's: the CPU stands in for it here.)
        kv_dtype = resolve_kv_dtype(ecfg.kv_cache_dtype, dtype, torch.device("cpu"), triton=False)
        self.plan = plan_cache(cfg, model_class(cfg).state_spec(cfg), ecfg, dtype, ssm_dtype, kv_dtype)
        self.sched = Scheduler(ecfg, self.plan.num_blocks, self.plan.num_slots, self.plan.num_checkpoints,
                               b"prefix-cache-sim")
        self.update = StepUpdate(self.sched)
        self.max_model_len = ecfg.max_model_len or cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.seed = seed
        self.arrivals = 0
        self.prefill_tokens = 0

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add(Request(request_id=request_id, prompt_token_ids=tuple(prompt),
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival=self.arrivals,
                               max_model_len=self.max_model_len, prefill_only=self.sched.config.prefill_only))
        self.arrivals += 1

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished()

    def step(self) -> list[StepEvent]:
        out = self.sched.schedule()
        if not out.rows:
            raise RuntimeError(f"the scheduler planned nothing with {len(self.sched.waiting)} waiting and "
                               f"{len(self.sched.running)} running requests (a bug)")
        sampled: dict[str, int] = {}
        firsts = set()
        for row in out.rows:
            if not row.is_decode:
                self.prefill_tokens += row.num_tokens
            if row.sample:
                n = len(self.sched.requests[row.request_id].output_token_ids)
                if n == 0:
                    firsts.add(row.request_id)
                sampled[row.request_id] = random.Random(f"{self.seed}/{row.request_id}/{n}").randrange(
                    1, self.vocab_size)
        launched = self.sched.cache.step_launched()
        done = {r.request_id: r for r in self.update.update(out, sampled)}
        self.sched.cache.step_done(launched)
        for r in done.values():
            if r.status is not RequestStatus.FINISHED_LENGTH:
                raise RuntimeError(f"{r.request_id}: expected to end at max_tokens, got {r.status.value}")
        return [StepEvent(rid, rid in firsts, list(done[rid].output_token_ids) if rid in done else None)
                for rid in sampled]

    def counters(self) -> tuple[int, int, int, int, int]:
        """(prefill tokens computed, checkpoints taken, checkpoint evictions, block evictions, preemptions)"""
        pc = self.sched.prefix
        return (self.prefill_tokens, pc.checkpoints_taken if pc else 0, pc.checkpoint_evictions if pc else 0,
                pc.block_evictions if pc else 0, self.sched.num_preemptions)


class PrefillBackend(SchedulerBackend):
    """A prefill node's scheduler (1P1D): it computes each prompt's N-1 tokens (R1) and hands its caches over,
    freed at once here; the decode node is modelled as emitting token N one step after the handover and one more
    token each step after that, so that a conversation's next turn comes back `answer` steps later."""

    def __init__(self, cfg: ModelConfig, ecfg: EngineConfig, seed: int) -> None:
        super().__init__(cfg, replace(ecfg, prefill_only=True, mixed_graph_tokens=0), seed)
        self.answers: dict[str, int] = {}   # request id -> its answer's length
        self.decoding: dict[str, list[int]] = {}  # handed over: the answer's tokens so far

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        if len(prompt) < 2:
            raise ValueError(f"{request_id}: expected a prompt of at least 2 tokens for a prefill node, got "
                             f"{len(prompt)}")
        super().add(request_id, prompt, max_tokens)
        self.answers[request_id] = max_tokens

    def has_unfinished(self) -> bool:
        return self.sched.has_unfinished() or bool(self.decoding)

    def step(self) -> list[StepEvent]:
        events = []
        for rid, answer in list(self.decoding.items()):
            answer.append(random.Random(f"{self.seed}/{rid}/{len(answer)}").randrange(1, self.vocab_size))
            done = len(answer) == self.answers[rid]
            events.append(StepEvent(rid, len(answer) == 1, list(answer) if done else None))
            if done:
                del self.decoding[rid], self.answers[rid]
        out = self.sched.schedule()
        self.prefill_tokens += sum(r.num_tokens for r in out.rows)
        launched = self.sched.cache.step_launched()
        for req in self.update.update(out, {}):
            self.sched.cache.free_held(req.block_ids, req.state_slot)
            self.decoding[req.request_id] = []
        self.sched.cache.step_done(launched)
        return events


def drive(backend: SchedulerBackend, w: Workload, progress: bool = True) -> tuple[int, int, list[float]]:
    """multiturn_bench's conversations through `backend` (`concurrency` at once, each turn sent the step after the
    one before it ends): (steps, prompt tokens sent, each turn's TTFT in steps, counted from 1)."""
    system = w.system_prompt()
    history: dict[int, list[int]] = {}
    arrived: dict[str, int] = {}
    ttft: list[float] = []
    prompt_tokens = next_conversation = step = 0
    bar = tqdm(total=w.conversations * w.turns, desc="turns", disable=not progress)

    def send(c: int, turn: int) -> None:
        nonlocal prompt_tokens
        history[c] = history[c] + w.user_message(c, turn)
        backend.add(f"{c}/{turn}", history[c], w.answer_tokens(c, turn))
        arrived[f"{c}/{turn}"] = step
        prompt_tokens += len(history[c])

    def start_conversations() -> None:
        nonlocal next_conversation
        while next_conversation < w.conversations and len(history) < w.concurrency:
            history[next_conversation] = list(system)
            send(next_conversation, 0)
            next_conversation += 1

    start_conversations()
    while backend.has_unfinished():
        step += 1
        for e in backend.step():
            if e.first_token:
                ttft.append(float(step - arrived[e.request_id] + 1))
            if e.answer is None:
                continue
            bar.update(1)
            c, turn = map(int, e.request_id.split("/"))
            history[c] = history[c] + e.answer
            if turn + 1 < w.turns:
                send(c, turn + 1)
            else:
                del history[c]
        start_conversations()
    bar.close()
    return step, prompt_tokens, ttft


def simulate(cfg: ModelConfig, ecfg: EngineConfig, w: Workload, progress: bool = True,
             topology: str = "agg") -> SimResult:
    """`topology`: "agg" (one engine) or "disagg" (the prefill node of 1P1D)."""
    if topology not in ("agg", "disagg"):
        raise ValueError(f"topology: expected 'agg' or 'disagg', got {topology!r}")
    backend = (SchedulerBackend if topology == "agg" else PrefillBackend)(cfg, ecfg, w.seed)
    steps, prompt_tokens, ttft = drive(backend, w, progress)
    prefill, taken, evicted, block_evictions, preemptions = backend.counters()
    plan = backend.plan
    return SimResult(steps=steps, prompt_tokens=prompt_tokens, prefill_tokens=prefill, checkpoints_taken=taken,
                     checkpoint_evictions=evicted, block_evictions=block_evictions, preemptions=preemptions,
                     ttft_steps=summarize(ttft), num_blocks=plan.num_blocks, num_slots=plan.num_slots,
                     num_checkpoints=plan.num_checkpoints,
                     mixed_graph_tokens=backend.sched.config.mixed_graph_tokens or 0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", action="store_true",
                   help="multiturn_bench's GPU workload and engine flags, as a CUDA engine resolves them")
    p.add_argument("--model-preset", help="the model whose cache sizes the pools (default: multiturn_bench's)")
    for name in ("conversations", "turns", "system-tokens", "user-tokens", "answer-min", "answer-max", "concurrency"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--engine-args", help="engine flags (default: multiturn_bench's)")
    p.add_argument("--extra-engine-args", default="", help="engine flags after those (e.g. a checkpoint stride)")
    p.add_argument("--topology", choices=("agg", "disagg"), default="agg",
                   help="agg: one engine; disagg: 1P1D's prefill node, its decode node modelled as a token a step")
    p.add_argument("--no-prefix-cache", action="store_true", help="the cache off, for the ratios")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    for k, v in DEFAULTS["gpu" if a.gpu else "cpu"].items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = model_config(a.model_preset)
    flags = [*shlex.split(a.engine_args), *shlex.split(a.extra_engine_args)]
    runs = [("cache", False), ("no cache", True)] if not a.no_prefix_cache else [("no cache", True)]
    w = Workload(a.conversations, a.turns, a.system_tokens, a.user_tokens, a.answer_min, a.answer_max,
                 a.concurrency, cfg.vocab_size, a.seed)
    results = []
    for name, off in runs:
        ecfg = engine_config([*flags, *(["--no-prefix-cache"] if off else [])], cfg, "cuda" if a.gpu else "cpu")
        r = simulate(cfg, ecfg, w, progress=not a.no_progress, topology=a.topology)
        results.append((name, r))
        print(f"{name}: {r.steps} steps, prompt tokens {r.prompt_tokens:,}, prefill tokens computed "
              f"{r.prefill_tokens:,}, TTFT steps p50 / p90 {r.ttft_steps.p50:.0f} / {r.ttft_steps.p90:.0f}, "
              f"checkpoints taken {r.checkpoints_taken} / evicted {r.checkpoint_evictions} "
              f"({r.num_checkpoints} slots), block evictions {r.block_evictions}, preemptions {r.preemptions} "
              f"[{r.num_blocks} KV blocks, {r.num_slots} state slots, mixed-step prompt tokens "
              f"{r.mixed_graph_tokens}]", flush=True)
    if len(results) == 2:
        on, off_r = results[0][1], results[1][1]
        print(f"off / on: prefill tokens {off_r.prefill_tokens / on.prefill_tokens:.2f}x, TTFT steps p50 "
              f"{off_r.ttft_steps.p50 / on.ttft_steps.p50:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
