"""Speculative decoding on a large model (issue #7 (d); Qwen3.5, issue #48 item 6 (d)): what a verify step costs
against a decode step, measured in one run, and the output tokens/s that follows at a checkpoint's acceptance lengths.

`mtp_bench.py` measures acceptance on a checkpoint it trains, but that model is 20M parameters: its steps last
~0.5 ms, so they time the host, not the GPU. A decode step of a large model is bound by reading its weights and
states, and a verify step reads the same bytes once for its 1+K tokens a row; whether drafting pays is decided here.

Model: `--preset` (a make_model preset: 8b-like by default, qwen3.5-27b-like for Qwen3.5) with one MTP layer, random
weights drawn on the device. NemotronH's MTP layer is `make_model`'s `*-` block for this shape (attention and an MLP
after `eh_proj`); Qwen3.5's is its own `mtp.*` drafter (`fc` over the pre-fc-normed embedding and hidden state, one
gated-attention decoder layer, `mtp.norm`). For each K in `--ks` (0: plain decode) one LLMEngine, and for each
batch B in `--batches`: B requests of `--context` prompt tokens enter decode (prefill-only, then re-admitted on their
caches, as `engine_bench.py` does), `--steps` warm-up steps, then `--steps` timed engine steps as a server runs them.
Steps run with async scheduling (step time: the device's steady state, idle gaps included): a verify step (K > 0:
the target over 1+K tokens a row, K drafter passes and the acceptance, one CUDA graph) is chained on the one in
flight, its inputs taken on the device from that one's results (`LLMEngine._chain`). `one at a time` is the
median step() wall time of as many verify steps each read before the next is launched (host work between them
included: what chaining saves); `gpu ms` is the device's span of the timed steps.

The weights are random, so almost no draft is accepted; a verify step's work does not depend on that (every row
carries K drafts through fixed-shape graphs). Acceptance comes from a checkpoint: `--acceptance 1.6,1.8,...` (mean
tokens emitted per verify row for K = 1, 2, ...) or `--acceptance-json` (mtp_bench.py's `--json`, measured on its
trained model). Per (K, B):

    break-even   step_K / step_0: the acceptance length at which K drafts give K = 0's tokens/s (also in the JSON)
    speedup      tau_K x step_0 / step_K, at the checkpoint's acceptance length tau_K
    floor        decode traffic (engine_bench.decode_traffic: weights, the family's recurrent states, KV) + K x a
                 draft pass's bytes (one draft step's `mtp.*` weights as `expected_weight_shapes` declares them,
                 the lm_head, the MTP attention's KV read), / the copy bandwidth measured in the run: what a verify
                 step would take at the traffic roofline, the state read once whatever K (issue #7 item 2), the
                 verify's extra query tokens free.

  python benchmarks/spec_bench.py --device cuda --acceptance-json /tmp/mtp.json --out /tmp/spec  # 8b-like (~20 GB)
  python benchmarks/spec_bench.py --device cuda --temperature 0.8 --ks 0,1,2                     # sampled rows
  python benchmarks/spec_bench.py --device cuda --temperature 0.8 --top-p 0.95 --ks 0,1,2        # filtered rows
  python benchmarks/spec_bench.py --device cuda --preset qwen3.5-27b-like --out /tmp/spec-qwen   # Qwen3.5
  python benchmarks/spec_bench.py --smoke --out /tmp/spec                                        # tiny, CPU
  python benchmarks/spec_bench.py --smoke --preset qwen3.5-tiny --out /tmp/spec-qwen             # Qwen3.5, CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from baton.engine.config import ATTENTION, ModelConfig
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import build_config
from baton.engine.model_family import model_class
from baton.engine.weights import MTP_PREFIX, TORCH_DTYPES, expected_weight_shapes

# `python benchmarks/X.py` puts only benchmarks/ on the path; the shared helpers are imported as a package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_bench import (  # noqa: E402
    _EMBEDDINGS,
    _check_decode_step,
    _int_list,
    _step,
    check_device_and_preset,
    copy_gbps,
    decode_traffic,
    device_and_pick,
    enter_decode,
    kv_bytes_per_token,
    one_step_at_a_time,
    pipelined_step_times,
    sync,
)
from benchmarks.engine_bench import random_weights as engine_random_weights  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402

JSON_NAME = "spec_bench.json"
MAX_K = 8  # EngineConfig's limit on num_speculative_tokens
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class SpecBenchConfig:
    device: str = "cuda"
    preset: str = "8b-like"
    ks: tuple[int, ...] = (0, 1, 2, 3, 4)
    batches: tuple[int, ...] = (1, 8, 32)
    context: int = 1024
    steps: int = 20
    # Mean tokens emitted per verify row for K = 1, 2, ... (index K-1); empty: none given (no speedup column).
    acceptance: tuple[float, ...] = ()
    copy_mib: int = 1024
    block_size: int = 16
    seed: int = 0
    # 0: greedy rows (verify graphs of greedy rows); > 0: every request samples at it, seeded (the verify graphs
    # of sampling rows, `RejectionSampler.verify_tempered`)
    temperature: float = 0.0
    # < 1 (with a temperature): nucleus sampling too; such rows' cut is found by the sampling kernel's search on the
    # GPU (the graphs' FILTERED variant in verify steps), so this times what that costs
    top_p: float = 1.0
    progress: bool = True

    def __post_init__(self) -> None:
        check_device_and_preset(self.device, self.preset)
        if 0 not in self.ks or any(not isinstance(k, int) or not 0 <= k <= MAX_K for k in self.ks):
            raise ValueError(f"--ks: expected integers in 0..{MAX_K} including 0 (the baseline), got {self.ks!r}")
        if not self.batches or any(not isinstance(b, int) or b < 1 for b in self.batches):
            raise ValueError(f"--batches: expected positive integers, got {self.batches!r}")
        if self.context < 2:
            raise ValueError(f"--context: expected at least 2 tokens, got {self.context}")
        if self.steps < 2:
            raise ValueError(f"--steps: expected at least 2, got {self.steps}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"--temperature: expected 0 (greedy) to 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0 or (self.top_p < 1.0 and not self.temperature):
            raise ValueError(f"--top-p: expected a value in (0, 1], below 1 only with a --temperature, got "
                             f"{self.top_p} at temperature {self.temperature}")
        for k in self.ks:
            if k and self.acceptance and len(self.acceptance) < k:
                raise ValueError(f"--acceptance: expected a value for every K up to {max(self.ks)}, "
                                 f"got {len(self.acceptance)}")
        bad = [a for a in self.acceptance if not 1.0 <= a <= MAX_K + 1]
        if bad:
            raise ValueError(f"--acceptance: expected mean tokens per verify row in 1..{MAX_K + 1}, got {bad}")


DEFAULTS = {
    "cuda": {"preset": "8b-like", "batches": "1,8,32", "context": 1024, "steps": 20, "copy_mib": 1024},
    "smoke": {"preset": "tiny", "batches": "1,3", "context": 24, "steps": 3, "copy_mib": 8},
}


def model_config(preset: str) -> tuple[ModelConfig, dict]:
    hf = build_config(preset, mtp_layers=1)
    return ModelConfig.from_hf_dict(hf), hf


def random_weights(cfg: ModelConfig, hf: dict, device: torch.device, dtype: torch.dtype, seed: int,
                   progress: bool) -> dict[str, torch.Tensor]:
    """Random weights of `cfg`, its MTP layer included, drawn on `device` as make_model draws them there."""
    return engine_random_weights(cfg, hf, device, dtype, seed, progress, include_mtp=True)


def _tensor_bytes(cfg: ModelConfig, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * (4 if model_class(cfg).runs_in_fp32(name) else dtype.itemsize)


def _mtp_layer_index(name: str) -> int | None:
    m = _MTP_LAYER.match(name)
    return None if m is None else int(m[1])


def mtp_step_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One draft step's MTP weights, as the model declares them: every `mtp.*` tensor outside `mtp.layers` (Qwen3.5's
    fc, pre-fc norms and norm) and one step's layers (NemotronH's carry its fusion and final norms), since in both
    families draft step k runs only the layers of step k % num_nextn_predict_layers."""
    shapes = {n: s for n, s in expected_weight_shapes(cfg, include_mtp=True).items() if n.startswith(MTP_PREFIX)}
    layers = {i for i in map(_mtp_layer_index, shapes) if i is not None}
    per_step = len(layers) // cfg.num_nextn_predict_layers
    return sum(_tensor_bytes(cfg, n, s, dtype) for n, s in shapes.items()
               if (i := _mtp_layer_index(n)) is None or i < per_step)


def lm_head_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The weight a draft's logits read: the family's `lm_head`, or the embedding table it is tied to."""
    shapes = expected_weight_shapes(cfg, include_mtp=False)
    name = "lm_head.weight" if "lm_head.weight" in shapes else next(n for n in _EMBEDDINGS if n in shapes)
    return _tensor_bytes(cfg, name, shapes[name], dtype)


def draft_pass_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, context_tokens: float) -> float:
    """Bytes one drafter pass must read: one draft step's MTP weights, the lm_head, and that step's attention layers'
    KV of the batch's context (`context_tokens` summed over the rows; shaped as the target's attention layers)."""
    attn = sum(t == ATTENTION for t in cfg.mtp_layer_types)  # one draft step's pattern, in both families
    kv = context_tokens * attn * kv_bytes_per_token(cfg, dtype) / max(len(cfg.attention_layer_ids), 1)
    return mtp_step_weight_bytes(cfg, dtype) + lm_head_bytes(cfg, dtype) + kv


def build_engine(cfg: ModelConfig, weights: dict[str, torch.Tensor], bc: SpecBenchConfig, k: int) -> LLMEngine:
    """An engine drafting K tokens with pools for the largest batch: each request its context, its first token and
    every warm-up and timed step's 1+K tokens (and K of lookahead), plus one prompt's prefill step."""
    bs, b = bc.block_size, max(bc.batches)
    seq = bc.context + (2 * bc.steps + 4) * (k + 1) + k + 1
    blocks = b * (-(-seq // bs) + 1)
    budget = max(b * (k + 1), bc.context, 64)
    ec = EngineConfig(block_size=bs, max_num_seqs=b, max_num_batched_tokens=budget, max_model_len=seq + bs,
                      num_kv_blocks=blocks, device=bc.device, num_speculative_tokens=k,
                      enable_prefix_caching=False)  # (timed steps, not cache hits)
    return LLMEngine(cfg, weights, ec)


@dataclass(frozen=True)
class SpecResult:
    k: int
    batch: int
    step_ms: float          # the engine's step time: async steady state (K > 0: chained verify steps; median step()
                            # wall time with async scheduling off)
    gpu_ms: float           # the device's span of a step (mean), host gaps inside a step included
    tokens_per_step: float  # emitted per step in this run (random weights: ~batch, almost no draft accepted)
    floor_ms: float         # the verify step's traffic floor (module docstring)
    context_tokens: float   # the rows' computed tokens summed, mean over the timed steps (the floor's KV read)
    graphed: float = 0.0    # the share of the timed steps replayed as a CUDA graph
    # K > 0 with async scheduling: the median step() wall time of as many steps run one at a time after them (each
    # read before the next is launched, host work between them included): what chaining verify steps saves
    one_at_a_time_ms: float = 0.0

    @property
    def floor_ratio(self) -> float:
        return self.step_ms / self.floor_ms


def bench_batch(engine: LLMEngine, bc: SpecBenchConfig, batch: int, copy: float) -> SpecResult:
    device, k = torch.device(bc.device), engine.config.num_speculative_tokens
    ids = enter_decode(engine, batch, bc.context, max_tokens=(2 * bc.steps + 4) * (k + 1), seed=bc.seed + batch,
                       device=device, progress=bc.progress, temperature=bc.temperature,
                       top_p=bc.top_p)
    for _ in tqdm(range(bc.steps), desc=f"warm-up K={k} B={batch}", disable=not bc.progress):
        _step(engine, device)
    ctx: list[int] = []
    st = engine.stats
    rows0, accepted0, gpu0 = st.spec_verify_rows, st.spec_accepted, st.device_seconds
    graphed0 = engine.runner.graph_steps
    if engine.depth:  # async scheduling, as a server runs (K > 0: verify steps chained on the one in flight)
        _, mean, steady = pipelined_step_times(engine, batch, bc.steps, device, ctx)
        step_ms = steady if steady is not None else mean
        emitted = (st.spec_verify_rows - rows0 + st.spec_accepted - accepted0) / bc.steps if k else float(batch)
    else:
        times = []
        for _ in tqdm(range(bc.steps), desc=f"K={k} B={batch}", disable=not bc.progress):
            ctx.append(sum(r.num_computed_tokens for r in engine.scheduler.running))
            times.append(_step(engine, device)[1])
            _check_decode_step(engine, batch)
        step_ms = statistics.median(times)
        emitted = (st.spec_verify_rows - rows0 + st.spec_accepted - accepted0) / bc.steps
    # `steps` steps launched and as many read (K = 0: the first read is the one launched before the window).
    gpu_ms = (st.device_seconds - gpu0) * 1e3 / bc.steps
    graphed = (engine.runner.graph_steps - graphed0) / bc.steps
    one_ms = 0.0
    if engine.depth:
        with one_step_at_a_time(engine):
            engine.step()  # reads the step left in flight
            if k:
                one_ms = statistics.median(_step(engine, device)[1] for _ in range(bc.steps))
    sync(device)
    for rid in ids:
        engine.abort(rid)
    cfg, dtype = engine.model_config, engine.dtype
    context = statistics.fmean(ctx)
    floor = decode_traffic(cfg, dtype, engine.ssm_dtype, batch, context).total
    floor += k * draft_pass_bytes(cfg, dtype, batch, context)
    return SpecResult(k=k, batch=batch, step_ms=step_ms, gpu_ms=gpu_ms, tokens_per_step=emitted,
                      floor_ms=floor / (copy * 1e9) * 1e3, context_tokens=context, graphed=graphed,
                      one_at_a_time_ms=one_ms)


@dataclass(frozen=True)
class CaptureCost:
    """What capturing an engine's verify graphs (every batch size up to the largest) took: the greedy variant,
    then (sampled) the tempered and filtered ones; seconds and the growth of the allocator's reserved memory
    (the graphs' pool: their intermediates)."""
    k: int
    greedy_s: float
    greedy_mib: float
    sampled_s: float = 0.0
    sampled_mib: float = 0.0


def capture(engine: LLMEngine, sampled: bool) -> CaptureCost:
    """Capture every graph as a server does before taking traffic, timing the greedy variant and the sampling ones
    apart (the sampling ones only when `sampled`)."""
    device = torch.device(engine.config.device)
    reserved = (lambda: torch.cuda.memory_reserved(device) / 2**20) if device.type == "cuda" else (lambda: 0.0)
    # The engine before this one must be gone first: a capture collects garbage, and its memory leaving the cache
    # then would count against this one's graphs.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    costs = []
    for variants in (False, True) if sampled else (False,):
        sync(device)
        t0, m0 = time.perf_counter(), reserved()
        engine.capture_graphs(sampled_verify=variants)
        sync(device)
        costs += [time.perf_counter() - t0, reserved() - m0]
    return CaptureCost(engine.config.num_speculative_tokens, *costs)


@dataclass
class Report:
    meta: dict
    copy_gbps: float
    results: list[SpecResult] = field(default_factory=list)
    captures: list[CaptureCost] = field(default_factory=list)


def acceptance_of(bc: SpecBenchConfig, k: int) -> float | None:
    return bc.acceptance[k - 1] if k and len(bc.acceptance) >= k else (1.0 if not k else None)


def break_even(results: list[SpecResult]) -> list[dict]:
    """Per result, step_K / step_0 at its batch: the acceptance length at which K drafts give K = 0's tokens/s."""
    base = {x.batch: x.step_ms for x in results if x.k == 0}
    return [{"k": x.k, "batch": x.batch, "acceptance": x.step_ms / base[x.batch]} for x in results]


def table(r: Report, bc: SpecBenchConfig) -> str:
    base = {x.batch: x.step_ms for x in r.results if x.k == 0}
    lines = ["| K | batch | step ms | one at a time ms | gpu ms | graphed | floor ms | step / floor | tokens / step here "
             "| break-even acceptance | acceptance | speedup | output tok/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for x, even in zip(r.results, break_even(r.results), strict=True):
        tau, be = acceptance_of(bc, x.k), even["acceptance"]
        speed = "–" if tau is None else f"{tau * base[x.batch] / x.step_ms:.2f}×"
        tok = "–" if tau is None else f"{x.batch * tau / x.step_ms * 1e3:,.0f}"
        one = f"{x.one_at_a_time_ms:.3f}" if x.one_at_a_time_ms else "–"
        lines.append(f"| {x.k} | {x.batch} | {x.step_ms:.3f} | {one} | {x.gpu_ms:.3f} | {x.graphed:.0%} | {x.floor_ms:.3f} | "
                     f"{x.floor_ratio:.2f}× | {x.tokens_per_step:.2f} | {be:.2f} | {'–' if tau is None else f'{tau:.3f}'} | {speed} | {tok} |")
    return "\n".join(lines)


def run(bc: SpecBenchConfig, command: str) -> Report:
    device = torch.device(bc.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: expected a CUDA device, found none")
    torch.manual_seed(bc.seed)
    copy = copy_gbps(bc.copy_mib * 2**20, device)
    cfg, hf = model_config(bc.preset)
    dtype = TORCH_DTYPES[cfg.torch_dtype]
    weights = random_weights(cfg, hf, device, dtype, bc.seed, bc.progress)
    n_params = sum(v.numel() for v in weights.values())
    print(f"copy {copy:.0f} GB/s; {bc.preset} + MTP {''.join(cfg.mtp_layer_types)}: {n_params / 1e9:.3f} B params",
          flush=True)
    report = Report(meta={"device_name": device_name(device), "commit": git_commit(), "torch": torch.__version__,
                          "command": command, "params": n_params, "bench_config": asdict(bc)}, copy_gbps=copy)
    for k in bc.ks:
        engine = build_engine(cfg, weights, bc, k)
        # Every batch size's graph, as a server does before taking traffic (the sampling rows' with --temperature).
        report.captures.append(capture(engine, bc.temperature > 0))
        report.results += [bench_batch(engine, bc, b, copy) for b in bc.batches]
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def sampling_label(bc: SpecBenchConfig) -> str:
    if not bc.temperature:
        return "greedy"
    return f"temperature {bc.temperature:g}" + (f", top-p {bc.top_p:g}" if bc.top_p < 1 else "")


def _float_list(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None


def acceptance_from_json(path: Path) -> tuple[float, ...]:
    """mtp_bench.py --json: mean acceptance length per K = 1, 2, ... (its rows must run K = 1 up without a gap)."""
    rows = {r["k"]: r["mean_acceptance_length"] for r in json.loads(path.read_text())["mtp"] if r["k"]}
    if sorted(rows) != list(range(1, len(rows) + 1)):
        raise ValueError(f"{path}: expected mtp rows for K = 1..n, got K = {sorted(rows)}")
    return tuple(rows[k] for k in sorted(rows))


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SpecBenchConfig]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"])
    ap.add_argument("--preset", help="make_model preset (default 8b-like; tiny with --smoke; Qwen3.5: "
                                     "qwen3.5-27b-like, or qwen3.5-tiny with --smoke)")
    ap.add_argument("--ks", default="0,1,2,3,4", help="draft tokens per step, comma-separated, 0 included")
    ap.add_argument("--batches", help="decode batch sizes, comma-separated (default 1,8,32)")
    ap.add_argument("--context", type=int, help="prompt tokens per request (default 1024)")
    ap.add_argument("--steps", type=int, help="timed steps per (K, batch), after as many warm-up steps")
    ap.add_argument("--copy-mib", type=int, help="copy size for the bandwidth (default 1024)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--acceptance", help="mean tokens per verify row for K = 1, 2, ..., comma-separated")
    src.add_argument("--acceptance-json", type=Path, help="mtp_bench.py --json output: its acceptance lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request samples at this temperature, seeded (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="with --temperature: nucleus sampling too (< 1: every step cuts its rows' distributions)")
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU (seconds)")
    ap.add_argument("--out", type=Path, help=f"directory for {JSON_NAME}")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    device, pick = device_and_pick(args, DEFAULTS)

    if args.acceptance_json is not None:
        acceptance = acceptance_from_json(args.acceptance_json)
    else:
        acceptance = _float_list("--acceptance", args.acceptance) if args.acceptance else ()
    bc = SpecBenchConfig(device=device, preset=pick("preset"), ks=_int_list("--ks", args.ks),
                         batches=_int_list("--batches", str(pick("batches"))),
                         context=pick("context"), steps=pick("steps"), acceptance=acceptance,
                         copy_mib=pick("copy_mib"), seed=args.seed, temperature=args.temperature,
                         top_p=args.top_p, progress=not args.no_progress)
    return args, bc


def main(argv: list[str] | None = None) -> int:
    args, bc = parse_args(argv)
    command = " ".join(["python benchmarks/spec_bench.py", *(sys.argv[1:] if argv is None else argv)])
    report = run(bc, command)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / JSON_NAME
        path.write_text(json.dumps({**asdict(report), "acceptance": list(bc.acceptance),
                                    "break_even": break_even(report.results)}, indent=1) + "\n")
        print(f"wrote {path}")
    print()
    print(f"## Speculative decoding steps — {report.meta['device_name']}, commit {report.meta['commit']}, "
          f"{bc.preset} + 1 MTP layer, context {bc.context}, "
          f"{sampling_label(bc)}; copy {report.copy_gbps:.0f} GB/s")
    print()
    print(f"`{command}`")
    print()
    print(table(report, bc))
    print()
    for c in report.captures:
        line = f"K = {c.k}: greedy graphs captured in {c.greedy_s:.1f} s, pool +{c.greedy_mib:,.0f} MiB"
        if bc.temperature:
            line += f"; sampling graphs (tempered, filtered) +{c.sampled_s:.1f} s, +{c.sampled_mib:,.0f} MiB"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
