"""Host cost of engine decode steps, without a GPU.

A decode step at a large batch is one CUDA-graph replay on the GPU plus Python work on the host that does
not overlap it: the scheduler's `schedule()`, building the graph's input lists (`ModelRunner._decode_graph`
and the flattening in `StepGraphs.run`), then `StepUpdate.update()` and the `RequestOutput`s. This benchmark
times that host work alone: an `LLMEngine` of the `tiny` preset on the CPU whose `runner.launch` (K = 0;
`runner.execute` with drafts) is replaced by a stand-in that runs the real `_decode_graph` (verify steps: the
real `SpecRunner.launch_verify` / `launch_chained` / `read_verify`, the one read and unpacking included) against a
graph object doing only the host side of `StepGraphs.run` / `run_chained` (the input lists into a tensor; no copy to
a device, no model), and returns fixed tokens. The engine's async scheduling runs as on a GPU (K = 0: step n+1
launched before step n is read; verify steps chained on the one in flight).

B requests of C prompt tokens are prefilled (by the stand-in: no model runs), then N decode steps are timed
and split into schedule / launch-or-execute host / update+outputs (the rest of `LLMEngine.step`).

  python benchmarks/host_bench.py                       # B=256, C=1024, 50 steps
  python benchmarks/host_bench.py --profile             # plus a cProfile top list
  python benchmarks/host_bench.py --spec 3              # verify steps of 1+3 tokens (MTP checkpoint)
  python benchmarks/host_bench.py --smoke               # seconds
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.engine.cuda_graphs import sampling_parts, sampling_variant
from baton.engine.engine_config import EngineConfig
from baton.engine.host_copy import host_tensor
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.pending_step import PendingStep
from baton.engine.runner import StepOutput
from baton.engine.sampling_params import SamplingParams
from baton.engine.scheduler_output import SchedulerOutput

TOKEN = 5  # every sampled and drafted token (never a stop id: requests ignore EOS)


def _sampling(temperature: list[float] | None = None, seeds: list[int] | None = None, top_k: list[int] | None = None,
              top_p: list[float] | None = None) -> tuple[list[int], ...]:
    """What `StepGraphs` stages of a verify step's sampling lists (its variant's)."""
    return sampling_parts(sampling_variant(temperature, top_k, top_p), 0, temperature, seeds, top_k, top_p)


class HostOnlyGraphs:
    """Stands in for `StepGraphs`: the same sizes and host-side list flattening as `StepGraphs.run`, then
    nothing (no pinned copy, no replay). A verify step (T > 1) returns what the whole greedy verify step's graph
    does, as a CPU tensor: every draft accepted, TOKEN everywhere."""

    def __init__(self, max_rows: int, tokens_per_row: int) -> None:
        self.T = tokens_per_row
        self.max_rows = max_rows
        self.started = None  # (no device marks)
        self.runs = 0

    def size_for(self, rows: int) -> int | None:
        return rows if rows <= self.max_rows else None

    def run(self, input_ids: list[int], slot_mapping: list[int], seq_lens: list[int], state_slots: list[int],
            block_tables: list[list[int]], fill: tuple | None = None, **extra: list | None) -> None:
        width = max(len(b) for b in block_tables)
        sampling = {k: extra.pop(k, None) for k in ("temperature", "seeds", "top_k", "top_p")}
        parts = (input_ids, slot_mapping, seq_lens, state_slots, *_sampling(**sampling),
                 *(v for v in extra.values() if v is not None))
        flat = [v for p in parts for v in p]
        for b in block_tables:
            flat += b
            flat += [0] * (width - len(b))
        host_tensor(flat, torch.int64)  # the list into the pinned buffer's tensor: host work too
        self.runs += 1
        if self.T == 1:
            return None
        # The packed results of `SpecRunner.graph_step_fn` for n = len(rows): emitted counts [n], emitted [n, T]
        # (-1 past the count), drafts [n, K].
        return self._packed(extra["num_tokens"])

    def _packed(self, counts: list[int]) -> torch.Tensor:
        n, T = len(counts), self.T
        emitted = [TOKEN if t < c else -1 for c in counts for t in range(T)]
        return torch.tensor(counts + emitted + [TOKEN] * (n * (T - 1)), dtype=torch.int64)

    def run_chained(self, prev_run: int, src: list[int], state_slots: list[int], rooms: list[int],
                    block_tables: list[list[int]], **sampling: list | None) -> torch.Tensor:
        """`StepGraphs.run_chained`'s host side (its per-row lists into one tensor); every row gets K drafts."""
        width = max(len(b) for b in block_tables)
        flat = [v for p in (state_slots, *_sampling(**sampling), rooms, src) for v in p]
        for b in block_tables:
            flat += b
            flat += [0] * (width - len(b))
        host_tensor(flat, torch.int64)
        self.runs += 1
        return self._packed([self.T] * len(src))


def fake_launch(engine: LLMEngine):
    """runner.launch without a model (K = 0): the real graph input building on decode steps, including where
    PENDING inputs come from; fixed tokens out, as a finished step."""
    runner = engine.runner

    def launch(out: SchedulerOutput, prev: PendingStep | None = None, return_logits: bool = False) -> PendingStep:
        fill = runner._pending_inputs(out, prev)
        if runner._graphable(out):
            runner._decode_graph(out, fill=fill)
        ids = [r.request_id for r in out.rows if r.sample]
        return PendingStep(ids, torch.full((len(ids),), TOKEN, dtype=torch.int64) if ids else None, runner.device)

    return launch


def fake_execute(engine: LLMEngine, k: int):
    """runner.execute without a model: the real graph input building on decode steps, fixed tokens out; with K
    drafts, verify steps run `SpecRunner._graph_step` against the stand-in graph."""
    runner = engine.runner

    def execute(out: SchedulerOutput, return_logits: bool = False) -> StepOutput:
        if k and runner._whole_step_graphable(out):
            return runner._graph_step(out)  # the real verify step's host side: inputs, the one read, unpacking
        if runner._graphable(out):
            runner._decode_graph(out)
        ids = [r.request_id for r in out.rows if r.sample]
        if not k:
            return StepOutput(sampled=dict.fromkeys(ids, TOKEN))
        # Every draft accepted: each verify row emits its k drafts and one sampled token, then drafts K more.
        emitted = {r.request_id: [TOKEN] * (1 + r.num_draft) for r in out.rows if r.sample}
        return StepOutput(sampled=emitted, drafts={i: [TOKEN] * k for i in ids})

    return execute


@dataclass
class Split:
    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0


def _timed(fn, split: Split, name: str):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(split, name, getattr(split, name) + time.perf_counter() - t)
    return wrapper


def build(model_dir: Path, batch: int, context: int, steps: int, k: int) -> LLMEngine:
    cfg, weights = load_checkpoint(model_dir)
    budget = max(8192, batch * (1 + k))
    # The first requests decode while the later ones still prefill: room for those steps too.
    max_tokens = (steps + 2 + batch * context // budget) * (1 + k) + 32
    max_len = context + max_tokens + 1
    blocks_per_req = -(-max_len // EngineConfig().block_size) + k + 1
    engine = LLMEngine(cfg, weights, EngineConfig(
        max_num_seqs=batch, max_num_batched_tokens=budget, num_kv_blocks=batch * blocks_per_req,
        max_model_len=max_len, dtype="float32", num_speculative_tokens=k, cuda_graphs=False,
        enable_prefix_caching=False))  # (the host work of steps, not of cache hits)
    engine.runner.graphs = HostOnlyGraphs(batch, 1 + k)
    engine.runner.execute = fake_execute(engine, k)
    engine.runner.launch = fake_launch(engine)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i + j) % 500 + 1 for j in range(context)], params, request_id=f"r{i}")
    # Prefill everything (the stand-in runs no model), then one step so that every row drafted (k > 0).
    while engine.scheduler.waiting or any(not r.in_decode for r in engine.scheduler.running):
        engine.step()
    engine.step()
    return engine


def measure(engine: LLMEngine, steps: int, profile: bool) -> tuple[float, Split, pstats.Stats | None]:
    split = Split()
    sched, runner = engine.scheduler, engine.runner
    # Pipelined steps (K = 0) launch; verify steps launch (chained on the one in flight, with async scheduling)
    # and read, or execute (one at a time).
    names = (["launch"] if engine.pipelined else ["launch_verify", "launch_chained", "read_verify"] if engine.depth
             else ["execute"])
    schedule, methods = sched.schedule, {name: getattr(runner, name) for name in names}
    sched.schedule = _timed(schedule, split, "schedule")
    for name, fn in methods.items():
        setattr(runner, name, _timed(fn, split, "execute"))
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        engine.step()
        if engine.last_step_rows != len(sched.running):
            raise RuntimeError(f"expected every request in every step, got {engine.last_step_rows} rows")
    if prof:
        prof.disable()
    total = time.perf_counter() - t
    split.update = total - split.schedule - split.execute
    sched.schedule = schedule
    for name, fn in methods.items():
        setattr(runner, name, fn)
    return total, split, pstats.Stats(prof) if prof else None


def bench(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the flags, run, print the table (and the profile); return ms per step by part and in total."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--spec", type=int, default=0, help="speculative tokens K (0: plain decode)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of --steps steps; the best is reported")
    ap.add_argument("--profile", action="store_true", help="also print a cProfile top list (one extra run)")
    ap.add_argument("--smoke", action="store_true", help="a quick run: B=16, C=64, 5 steps")
    a = ap.parse_args(argv)
    if a.smoke:
        a.batch, a.context, a.steps, a.repeats = 16, 64, 5, 1
    if min(a.batch, a.context, a.steps, a.repeats) < 1 or a.spec < 0:
        raise ValueError("host_bench: expected positive --batch/--context/--steps/--repeats and --spec >= 0")
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, "tiny", mtp_layers=1 if a.spec else 0, progress=False, tokenizer=False)
        engine = build(Path(tmp), a.batch, a.context, a.steps * (a.repeats + a.profile), a.spec)
    runs = [measure(engine, a.steps, False) for _ in range(a.repeats)]
    total, split, _ = min(runs, key=lambda r: r[0])
    ms = 1e3 / a.steps
    result = {"total": total * ms, "schedule": split.schedule * ms, "execute_host": split.execute * ms,
              "update_outputs": split.update * ms}
    print(f"host_bench: B={a.batch} C={a.context} K={a.spec}, best of {a.repeats} x {a.steps} steps (ms/step)")
    print(f"{'schedule':>10} {'execute':>10} {'update+out':>10} {'total':>10}")
    print(f"{result['schedule']:10.3f} {result['execute_host']:10.3f} {result['update_outputs']:10.3f} "
          f"{result['total']:10.3f}")
    if a.profile:
        _, _, stats = measure(engine, a.steps, True)
        stats.sort_stats("tottime").print_stats(20)
    return result


def main(argv: list[str] | None = None) -> int:
    bench(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
