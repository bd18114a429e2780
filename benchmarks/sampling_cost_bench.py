"""What penalties, min-p and logprobs add to a decode step (issue #52 item 7): decode steps whose rows all sample
plainly against steps whose rows all carry the extras, on one engine in one run.

    plain   `PLAIN`: a temperature and a top-p, each request seeded
    extras  `EXTRAS`: the same, plus presence, frequency and repetition penalties, min-p and top-`TOP_LOGPROBS`
            logprobs (the penalties read each row's generated tokens, the repetition penalty its prompt too)

The engine is engine_bench.py's (the preset's random weights drawn on the device, CUDA graphs where the engine runs
them, async scheduling). Per batch B of `--batches`, four phases in the order plain, extras, extras, plain (a drift of
the device's clocks over them weighs on both kinds alike): B fresh requests of `--context` prompt tokens enter decode
as engine_bench.py's do (prefill-only, then re-admitted on their caches), `--steps` untimed warm-up steps, whose
outputs are checked (every extras token came back with its logprobs and `TOP_LOGPROBS` alternatives, no plain one
did; the runner processes the extras rows' logits and not the plain rows'), then `--steps` timed engine steps as a
server runs them (`engine_bench.pipelined_step_times`: on CUDA the device's steady state, idle gaps included; on the
CPU the wall time / steps). Per kind the mean over its two phases; ratio = extras / plain against `GOAL`.

`graphed`: the share of the timed steps that replayed a decode CUDA graph (the forward and lm_head; both kinds sample
after it). `host ms`: the median host time of one step() call, which async scheduling overlaps with the device's
step until it is the longer of the two.

  python benchmarks/sampling_cost_bench.py --device cuda --out /tmp/sampling_cost   # 8b-like, batch 1 / 32 / 256
  python benchmarks/sampling_cost_bench.py --smoke --out /tmp/sampling_cost         # tiny preset on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from baton.engine.llm_engine import LLMEngine, RequestOutput
from baton.engine.sampling_params import SamplingParams

# `python benchmarks/X.py` puts only benchmarks/ on the path; the shared helpers are imported as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_bench import DEFAULTS as ENGINE_DEFAULTS  # noqa: E402
from benchmarks.engine_bench import (  # noqa: E402
    BenchConfig,
    _int_list,
    build_engine,
    check_device_and_preset,
    device_and_pick,
    enter_decode,
    one_step_at_a_time,
    pipelined_step_times,
)
from benchmarks.run_info import device_name, git_commit  # noqa: E402

JSON_NAME = "sampling_cost.json"
GOAL = 1.03  # extras step / plain step (issue #52 item 7)
TOP_LOGPROBS = 5
PLAIN = SamplingParams(temperature=0.8, top_p=0.95)
EXTRAS = SamplingParams(temperature=0.8, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.5,
                        repetition_penalty=1.1, min_p=0.05, logprobs=TOP_LOGPROBS)
KINDS = {"plain": PLAIN, "extras": EXTRAS}
ORDER = ("plain", "extras", "extras", "plain")
DEFAULTS = {"cuda": {"preset": "8b-like", "batches": "1,32,256", "context": 1024, "steps": 20},
            "smoke": {"preset": "tiny", "batches": "1,4", "context": 24, "steps": 3}}


@dataclass(frozen=True)
class CostConfig:
    device: str = "cuda"
    preset: str = "8b-like"
    batches: tuple[int, ...] = (1, 32, 256)
    context: int = 1024  # prompt tokens per request before decode
    steps: int = 20      # timed decode steps per phase (and as many warm-up steps)
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_device_and_preset(self.device, self.preset)
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"--batches: expected positive integers, got {self.batches!r}")
        if not isinstance(self.context, int) or self.context < 2:
            raise ValueError(f"--context: expected at least 2 tokens, got {self.context!r}")
        if not isinstance(self.steps, int) or self.steps < 2:
            raise ValueError(f"--steps: expected an integer >= 2 (the steady state spans two steps), got {self.steps!r}")

    def bench_config(self) -> BenchConfig:
        """engine_bench's configuration of an engine sized for these decode batches alone (no prefill, continued or
        mixed rows); its prefill budget is engine_bench's default for the device."""
        kind = "cuda" if self.device == "cuda" else "smoke"
        return BenchConfig(device=self.device, preset=self.preset, batches=self.batches, context=self.context,
                           steps=self.steps, prefill_tokens=ENGINE_DEFAULTS[kind]["prefill_tokens"],
                           prefill_splits=(1,), prefill_continued=False, mixed_batch=0, mixed_graph_tokens=0,
                           seed=self.seed, progress=self.progress)


@dataclass(frozen=True)
class Phase:
    """One entry of B requests of one kind: its timed steps and what its warm-up steps' outputs showed."""
    kind: str
    step_ms: float         # CUDA: the device's steady state per step; CPU: wall time / steps
    wall_ms: float         # wall time / steps (the first launch's latency in it)
    host_ms: float         # median host ms of one step() call
    graph_steps: int       # timed steps that replayed a decode CUDA graph
    processed: bool        # the runner processes the rows' logits (penalties, min-p)
    tokens: int            # warm-up tokens
    logprob_tokens: int    # of them, those that came back with logprobs of TOP_LOGPROBS alternatives


@dataclass(frozen=True)
class BatchResult:
    batch: int
    steps: int
    phases: list[Phase] = field(default_factory=list)

    def _mean(self, kind: str, name: str) -> float:
        return statistics.fmean(getattr(p, name) for p in self.phases if p.kind == kind)

    @property
    def plain_ms(self) -> float:
        return self._mean("plain", "step_ms")

    @property
    def extras_ms(self) -> float:
        return self._mean("extras", "step_ms")

    @property
    def ratio(self) -> float:
        return self.extras_ms / self.plain_ms

    @property
    def plain_graphed(self) -> float:
        return self._mean("plain", "graph_steps") / self.steps

    @property
    def extras_graphed(self) -> float:
        return self._mean("extras", "graph_steps") / self.steps


def check_outputs(kind: str, outs: list[RequestOutput]) -> tuple[int, int]:
    """(tokens, tokens with logprobs) of steps' outputs; a plain token with logprobs, or an extras one without
    them (or with another count of alternatives), is a bug of the path measured."""
    tokens = sum(len(o.new_token_ids) for o in outs)
    with_lp = 0
    for o in outs:
        lps = o.logprobs or ()
        if kind == "extras" and (len(lps) != len(o.new_token_ids) or any(len(t.top) != TOP_LOGPROBS for t in lps)):
            raise RuntimeError(f"extras row {o.request_id}: expected a logprob with {TOP_LOGPROBS} alternatives per "
                               f"token, got {len(lps)} for {len(o.new_token_ids)} tokens")
        if kind == "plain" and lps:
            raise RuntimeError(f"plain row {o.request_id}: expected no logprobs, got {len(lps)}")
        with_lp += len(lps)
    return tokens, with_lp


def run_phase(engine: LLMEngine, cc: CostConfig, batch: int, kind: str, n: int) -> Phase:
    device = torch.device(cc.device)
    # The same prompts and seeds for every phase of a batch: the kinds differ in their parameters alone.
    ids = enter_decode(engine, batch, cc.context, max_tokens=2 * cc.steps + 8, seed=cc.seed + batch, device=device,
                       progress=cc.progress, sampling=KINDS[kind], tag=f"-{kind}{n}")
    processed = engine.runner.processes(ids)
    if processed != (kind == "extras"):
        raise RuntimeError(f"{kind} rows at batch {batch}: expected their logits {'' if kind == 'extras' else 'not '}"
                           f"processed, the runner says processed={processed}")
    outs: list[RequestOutput] = []
    for _ in tqdm(range(cc.steps), desc=f"warm-up {kind} B={batch}", disable=not cc.progress):
        outs += engine.step()
    tokens, with_lp = check_outputs(kind, outs)
    graphs = engine.runner.graph_steps
    times, wall, steady = pipelined_step_times(engine, batch, cc.steps, device, [])
    graph_steps = engine.runner.graph_steps - graphs
    with one_step_at_a_time(engine):
        check_outputs(kind, engine.step())  # reads the step left in flight
    for rid in ids:
        engine.abort(rid)
    return Phase(kind=kind, step_ms=wall if steady is None else steady, wall_ms=wall,
                 host_ms=statistics.median(times), graph_steps=graph_steps, processed=processed, tokens=tokens,
                 logprob_tokens=with_lp)


@dataclass(frozen=True)
class Report:
    meta: dict
    results: list[BatchResult]


def run(cc: CostConfig, command: str) -> Report:
    device = torch.device(cc.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: expected a CUDA device, found none")
    torch.manual_seed(cc.seed)
    engine = build_engine(cc.bench_config())
    meta = {"device_name": device_name(device), "commit": git_commit(), "torch": torch.__version__,
            "command": command, "preset": cc.preset, "params": sum(p.numel() for p in engine.model.parameters()),
            "cost_config": asdict(cc), "cuda_graphs": engine.runner.graphs is not None, "goal": GOAL,
            "sampling": {k: asdict(p) for k, p in KINDS.items()}}
    results = []
    for b in cc.batches:
        phases = [run_phase(engine, cc, b, kind, n) for n, kind in enumerate(ORDER)]
        results.append(BatchResult(batch=b, steps=cc.steps, phases=phases))
    return Report(meta=meta, results=results)


def report_dict(r: Report) -> dict:
    rows = []
    for b in r.results:
        d = asdict(b)
        d.update(plain_ms=b.plain_ms, extras_ms=b.extras_ms, ratio=b.ratio, plain_graphed=b.plain_graphed,
                 extras_graphed=b.extras_graphed, goal_met=b.ratio <= GOAL)
        rows.append(d)
    return {"meta": r.meta, "results": rows}


def table(r: Report) -> str:
    m = r.meta
    lines = [f"## Decode step: penalties + min-p + logprobs vs plain sampling — {m['device_name']}, commit "
             f"{m['commit']}, torch {m['torch']}", "", f"`{m['command']}`", "",
             f"Preset `{m['preset']}` ({m['params'] / 1e9:.2f} B params), context {m['cost_config']['context']}, "
             f"{m['cost_config']['steps']} timed steps per phase (plain, extras, extras, plain); engine CUDA graphs "
             f"{'on' if m['cuda_graphs'] else 'off'}. plain: {_describe(PLAIN)}; extras: {_describe(EXTRAS)}.", "",
             f"| batch | plain ms | extras ms | ratio | goal ≤ {GOAL} | graphed plain / extras "
             "| host ms plain / extras |",
             "| ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for b in r.results:
        host = {k: statistics.fmean(p.host_ms for p in b.phases if p.kind == k) for k in KINDS}
        lines.append(f"| {b.batch} | {b.plain_ms:.3f} | {b.extras_ms:.3f} | {b.ratio:.3f} "
                     f"| {'met' if b.ratio <= GOAL else 'missed'} | {b.plain_graphed:.0%} / {b.extras_graphed:.0%} "
                     f"| {host['plain']:.2f} / {host['extras']:.2f} |")
    return "\n".join(lines)


def _describe(p: SamplingParams) -> str:
    parts = [f"temperature {p.temperature}", f"top-p {p.top_p}"]
    if p.penalised:
        parts.append(f"presence {p.presence_penalty}, frequency {p.frequency_penalty}, repetition "
                     f"{p.repetition_penalty}")
    if p.min_p:
        parts.append(f"min-p {p.min_p}")
    if p.logprobs is not None:
        parts.append(f"logprobs top {p.logprobs}")
    return ", ".join(parts)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, CostConfig]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--preset", help="make_model preset (default 8b-like; tiny with --smoke)")
    ap.add_argument("--batches", help="decode batch sizes, comma-separated (default 1,32,256)")
    ap.add_argument("--context", type=int, help="prompt tokens per decode request")
    ap.add_argument("--steps", type=int, help="timed decode steps per phase, after as many warm-up steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU, small numbers")
    ap.add_argument("--out", type=Path, help=f"directory for {JSON_NAME} (or a .json file path)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    device, pick = device_and_pick(args, DEFAULTS)
    cc = CostConfig(device=device, preset=pick("preset"), batches=_int_list("--batches", str(pick("batches"))),
                    context=pick("context"), steps=pick("steps"), seed=args.seed, progress=not args.no_progress)
    return args, cc


def main(argv: list[str] | None = None) -> int:
    args, cc = parse_args(argv)
    command = " ".join(["python benchmarks/sampling_cost_bench.py", *(sys.argv[1:] if argv is None else argv)])
    report = run(cc, command)
    if args.out is not None:
        path = args.out if args.out.suffix == ".json" else args.out / JSON_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report_dict(report), indent=2) + "\n")
        print(f"wrote {path}")
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
