"""Where a decode (or prefill) step's GPU time goes: the kernels of engine steps at batch 1, 32, 256 (and of
`--prefill` steps), grouped by kind.

engine_bench (a) says how far a decode step is from its traffic roofline; this says what the rest is made of.
Per batch size it enters decode as engine_bench does (B requests of `--context` prompt tokens, re-admitted on
their caches), warms up, then runs `--steps` engine steps (async scheduling, as a server runs them) under the
torch profiler and reads the kernels out of its trace (CUDA graph replays included: CUPTI reports each node).
Per step:

    kind          kernels / step, GPU µs / step, share of the step's wall time, effective GB/s where the bytes
                  are known (GEMMs: the weights; the state update: its state read + write)
    busy          sum of all kernel times; wall = on the GPU the device's span over the steps' kernels (first
                  start to last end) / steps, on the CPU the steps' wall time / steps; the weights' bytes over the
                  time of all GEMMs (cuBLAS and the fused GEMVs)
    idle          wall - busy: gaps between kernels (launch latency inside a graph, host time not hidden)

Kinds come from kernel names (`KINDS`, first match wins): our Triton kernels by their function names, cuBLAS /
CUTLASS GEMMs by their families, copies and sets, and the rest (torch elementwise ops, sampling) as `other`.

Prefill (`--prefill 1x8192,4x2048`: prompts x tokens, each shape one step of fresh prompts that sample their last
token, engine_bench's (c) step): after a warm-up step of the shape, `--steps` such steps under the profiler (queued
at once, stepped with async scheduling as a prefill node steps them), the
rows then carrying TFLOP/s where the FLOPs are known (GEMMs: linear layers + lm_head; scan; attention:
`engine_bench.prefill_flops`) instead of GB/s. Where a prefill step falls short of the matmul rate, per kind.

  python benchmarks/step_profile.py --out /tmp/profile                      # 8b-like on one GPU
  python benchmarks/step_profile.py --prefill 1x8192,4x2048 --no-decode     # its prefill steps only
  python benchmarks/step_profile.py --batches 256 --sampling extras --top 16  # rows with penalties, min-p, logprobs
  python benchmarks/step_profile.py --smoke --out /tmp/profile              # tiny preset on the CPU: aten ops
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from baton.engine.sampling_params import SamplingParams  # noqa: E402
from baton.engine.weights import TORCH_DTYPES  # noqa: E402
from benchmarks.engine_bench import (  # noqa: E402
    BenchConfig,
    _prefill_step,
    _prompts,
    build_engine,
    copy_gbps,
    decode_traffic,
    enter_decode,
    prefill_flops,
    sync,
)
from benchmarks.run_info import device_name, git_commit  # noqa: E402
from benchmarks.sampling_cost_bench import KINDS as SAMPLING_KINDS  # noqa: E402
from benchmarks.spec_bench import SpecBenchConfig  # noqa: E402
from benchmarks.spec_bench import build_engine as spec_build_engine  # noqa: E402
from benchmarks.spec_bench import model_config as spec_model_config  # noqa: E402
from benchmarks.spec_bench import random_weights as spec_random_weights  # noqa: E402

JSON_NAME = "step_profile.json"
GAP_MIN_US = 20.0  # an idle stretch this long is host time not hidden (launch latency is a few µs)
# (kind, regex on the kernel name), first match wins. GPU kernel names, and aten op names for the CPU smoke run.
KINDS: tuple[tuple[str, str], ...] = (
    ("state update", r"_ssu_|selective_state_update|_record_kernel|_gdn_decode|_gdn_verify"),
    ("gdn prefill", r"_wy_|_chunk_table|_gdn_prefill"),
    ("conv", r"_conv_|conv1d"),
    ("scan", r"_ssd_|chunk_scan"),
    ("gated norm", r"_gated_rms_norm|gated_rms_norm|_norm_gate"),
    ("rope", r"_rope_"),
    ("norm", r"_rms_norm|rms_norm|rsqrt"),
    ("relu2", r"_relu2"),
    ("attention", r"_paged_attention|paged_attention|_attn_"),
    ("kv write", r"_write_kv|write_kv"),
    ("fused gemv", r"_gemv_kernel"),
    ("sampling", r"_process_kernel|_min_p_kernel|_slice_kernel|_pack_kernel|_tempered_verify_kernel"),
    ("gemm", r"gemm|gemv|nvjet|cutlass|xmma|cublas|splitk|aten::(?:linear|addmm|mm|matmul|bmm)\b"),
    ("copy", r"[Mm]emcpy|[Mm]emset|copy_|aten::copy|aten::to\b|aten::_to_copy"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


@dataclass(frozen=True)
class Kernel:
    name: str
    ts_us: float
    dur_us: float


def trace_kernels(trace: dict, gpu: bool) -> list[Kernel]:
    """The kernels of a chrome trace (torch profiler export): GPU kernels, copies and sets on the GPU; on the
    CPU the outermost aten ops of each thread (what a CPU step runs, without counting nested ops twice)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if gpu:
        cats = {"kernel", "gpu_memcpy", "gpu_memset"}
        return sorted((Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in events if e.get("cat") in cats),
                      key=lambda k: k.ts_us)
    out: list[Kernel] = []
    by_thread: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") == "cpu_op" and e["name"].startswith("aten::"):
            by_thread.setdefault(e.get("tid"), []).append(e)
    for evs in by_thread.values():
        end = -1.0
        for e in sorted(evs, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            if float(e["ts"]) >= end:  # not inside the last outermost op
                out.append(Kernel(e["name"], float(e["ts"]), float(e["dur"])))
                end = float(e["ts"]) + float(e["dur"])
    return sorted(out, key=lambda k: k.ts_us)


@dataclass(frozen=True)
class Gap:
    """An idle stretch of the device between two kernels (the one ending last before it, the next to start)."""
    us: float
    before: str
    after: str


def gaps_of(kernels: Sequence[Kernel], min_us: float) -> list[Gap]:
    """The device's idle stretches of at least `min_us` between `kernels` (sorted by start; overlapping kernels
    merge), in time order."""
    out: list[Gap] = []
    end, last = None, None
    for k in kernels:
        if end is not None and k.ts_us - end >= min_us:
            out.append(Gap(k.ts_us - end, last.name, k.name))
        if end is None or k.ts_us + k.dur_us > end:
            end, last = k.ts_us + k.dur_us, k
    return out


def device_span_us(kernels: Sequence[Kernel]) -> float:
    """From the first kernel's start to the last one's end: the device's time over the traced steps, without the
    host's latency before the first launch (the device idles after the sync until then)."""
    if not kernels:
        raise ValueError("device_span_us: expected at least one kernel, got none")
    return max(k.ts_us + k.dur_us for k in kernels) - min(k.ts_us for k in kernels)


@dataclass(frozen=True)
class KindRow:
    kind: str
    kernels_per_step: float
    us_per_step: float
    share: float            # of the step's wall time
    gbps: float | None      # bytes the kind must move / its time, where known
    tflops: float | None = None  # FLOPs the kind must compute / its time, where known (prefill steps)


@dataclass(frozen=True)
class Profile:
    batch: int
    steps: int
    wall_us_per_step: float
    busy_us_per_step: float
    rows: tuple[KindRow, ...]
    top: tuple[tuple[str, int, float], ...]  # (name, kernels / step x steps, µs / step) of the costliest kernels
    weights_gbps: float | None = None  # the weights' bytes / the time of all GEMMs (cuBLAS and fused GEMVs)
    # A prefill step's shape (0 for decode steps): its prompts and their tokens in all.
    prompts: int = 0
    prompt_tokens: int = 0
    # Idle stretches of at least GAP_MIN_US: their count and time per step, and the longest (µs, before, after).
    long_gaps_per_step: float = 0.0
    long_gap_us_per_step: float = 0.0
    longest_gaps: tuple[tuple[float, str, str], ...] = ()

    @property
    def idle_us_per_step(self) -> float:
        return max(0.0, self.wall_us_per_step - self.busy_us_per_step)


def profile_of(kernels: Sequence[Kernel], batch: int, steps: int, wall_us: float,
               kind_bytes: dict[str, float] | None = None, top: int = 8,
               kind_flops: dict[str, float] | None = None) -> Profile:
    """Group `kernels` (those of `steps` steps taking `wall_us` in all) by kind, per step; `kind_bytes` /
    `kind_flops`: what one step's kernels of a kind must move / compute."""
    if steps < 1 or wall_us <= 0:
        raise ValueError(f"profile: expected steps >= 1 and a positive wall time, got {steps}, {wall_us}")
    kind_bytes = kind_bytes or {}
    kind_flops = kind_flops or {}
    count: dict[str, int] = {}
    time_us: dict[str, float] = {}
    per_name: dict[str, list[float]] = {}
    for k in kernels:
        kind = kind_of(k.name)
        count[kind] = count.get(kind, 0) + 1
        time_us[kind] = time_us.get(kind, 0.0) + k.dur_us
        per_name.setdefault(k.name, []).append(k.dur_us)
    wall = wall_us / steps
    rows = []
    for kind in sorted(time_us, key=lambda k: -time_us[k]):
        us = time_us[kind] / steps
        b, f = kind_bytes.get(kind), kind_flops.get(kind)
        rows.append(KindRow(kind, count[kind] / steps, us, us / wall, None if b is None or us == 0 else b / us / 1e3,
                            None if f is None or us == 0 else f / us / 1e6))
    costly = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    gaps = gaps_of(kernels, GAP_MIN_US)
    longest = sorted(gaps, key=lambda g: -g.us)[:8]
    return Profile(batch=batch, steps=steps, wall_us_per_step=wall, busy_us_per_step=sum(time_us.values()) / steps,
                   rows=tuple(rows),
                   top=tuple((name[:90], len(d), sum(d) / steps) for name, d in costly),
                   long_gaps_per_step=len(gaps) / steps, long_gap_us_per_step=sum(g.us for g in gaps) / steps,
                   longest_gaps=tuple((g.us, g.before[:60], g.after[:60]) for g in longest))


def _trace(prof: torch.profiler.profile) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def spec_engine(bc: BenchConfig, k: int):
    """The preset with one MTP layer (random weights), drafting k tokens a step: spec_bench.py's engine."""
    sbc = SpecBenchConfig(device=bc.device, preset=bc.preset, ks=(0, k), batches=bc.batches, context=bc.context,
                          steps=bc.steps, progress=bc.progress)
    cfg, hf = spec_model_config(bc.preset)
    weights = spec_random_weights(cfg, hf, torch.device(bc.device), TORCH_DTYPES[cfg.torch_dtype], bc.seed,
                                  bc.progress)
    return spec_build_engine(cfg, weights, sbc, k)


def profile_decode(engine, bc: BenchConfig, batch: int, progress: bool,
                   sampling: SamplingParams | None = None, top: int = 8) -> Profile:
    """`sampling`: every row's parameters (None: greedy); `top`: the costliest kernels listed."""
    device = torch.device(bc.device)
    gpu = device.type == "cuda"
    ids = enter_decode(engine, batch, bc.context, max_tokens=3 * bc.steps + 16, seed=bc.seed + batch,
                       device=device, progress=progress, sampling=sampling)
    for _ in tqdm(range(bc.steps), desc=f"warm-up B={batch}", disable=not progress):
        engine.step()
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(bc.steps):
            engine.step()
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    # decode_traffic takes the batch's context summed over its requests (the KV every row reads).
    ctx = sum(r.num_computed_tokens for r in engine.scheduler.running)
    for rid in ids:
        engine.abort(rid)
    t = decode_traffic(engine.model_config, engine.dtype, engine.ssm_dtype, batch, ctx)
    kind_bytes = {"state update": t.ssm_state, "conv": t.conv_state, "attention": t.kv_read}
    kernels = trace_kernels(_trace(prof), gpu)
    if gpu and kernels:
        wall_us = device_span_us(kernels)  # idle gaps between the steps count, the first launch's latency not
    p = profile_of(kernels, batch, bc.steps, wall_us, kind_bytes, top=top)
    gemm_us = sum(r.us_per_step for r in p.rows if r.kind in ("gemm", "fused gemv"))
    return dataclasses.replace(p, weights_gbps=t.weights / gemm_us / 1e3 if gemm_us else None)


def profile_prefill(engine, bc: BenchConfig, prompts: int, length: int, progress: bool) -> Profile:
    """`bc.steps` prefill steps of `prompts` fresh prompts of `length` tokens each (after one warm-up step), by
    kind; GEMMs, the scan and attention with their TFLOP/s. The steps' prompts are queued at once and stepped as
    a prefill node steps them (async scheduling: the host builds step n+1 while the device runs step n), so the
    idle stretches left are those a serving node has."""
    device = torch.device(bc.device)
    gpu = device.type == "cuda"
    ids = _prompts(prompts, length, engine.model_config.vocab_size, bc.seed + 7919 * prompts + length)
    _prefill_step(engine, ids, f"profile-warm-{prompts}x{length}", device)
    sync(device)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i in range(bc.steps):
        for j, p in enumerate(ids):
            engine.add_request(p, params, request_id=f"profile-{prompts}x{length}-{i}-{j}")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    done = 0
    with torch.profiler.profile(activities=acts) as prof:
        t0 = time.perf_counter()
        with tqdm(total=bc.steps * prompts, desc=f"prefill {prompts}x{length}", disable=not progress) as bar:
            while engine.has_unfinished():
                finished = sum(o.finished for o in engine.step())
                done += finished
                bar.update(finished)
        sync(device)
        wall_us = (time.perf_counter() - t0) * 1e6
    if done != bc.steps * prompts:
        raise RuntimeError(f"prefill profile: expected {bc.steps * prompts} prompts done, got {done}")
    kernels = trace_kernels(_trace(prof), gpu)
    if gpu and kernels:
        wall_us = device_span_us(kernels)  # the host's turns the device waits for count as idle
    f = prefill_flops(engine.model_config, [length] * prompts)
    p = profile_of(kernels, prompts, bc.steps, wall_us,
                   kind_flops={"gemm": f.linear + f.lm_head, "scan": f.ssd, "attention": f.attention})
    return dataclasses.replace(p, prompts=prompts, prompt_tokens=prompts * length)


def table(profiles: Iterable[Profile], meta: dict) -> str:
    spec = f" + MTP, K = {meta['spec']} (verify steps)" if meta.get("spec") else ""
    spec += f", {meta['sampling']} sampling" if meta.get("sampling", "greedy") != "greedy" else ""
    lines = [f"## Step profile — {meta['device_name']}, commit {meta['commit']}, preset {meta['preset']}{spec}, "
             f"decode context {meta['context']}; copy {meta['copy_gbps']:.0f} GB/s", "", f"`{meta['command']}`", ""]
    for p in profiles:
        head = (f"prefill {p.prompts} x {p.prompt_tokens // p.prompts:,} tokens" if p.prompts else f"batch {p.batch}")
        tail = (f"{p.prompt_tokens / p.wall_us_per_step * 1e6:,.0f} tokens/s" if p.prompts else
                f"weights read by all GEMMs at {'–' if p.weights_gbps is None else format(p.weights_gbps, ',.0f')} "
                "GB/s")
        unit = "TFLOP/s" if p.prompts else "GB/s"
        lines += [f"{head}: wall {p.wall_us_per_step:,.0f} µs/step, kernels busy {p.busy_us_per_step:,.0f} "
                  f"µs, idle {p.idle_us_per_step:,.0f} µs ({p.idle_us_per_step / p.wall_us_per_step:.0%}); {tail}", "",
                  f"| kind | kernels / step | µs / step | share of wall | {unit} |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in p.rows:
            rate = r.tflops if p.prompts else r.gbps
            rate_s = "–" if rate is None else f"{rate:,.0f}"
            lines.append(f"| {r.kind} | {r.kernels_per_step:.0f} | {r.us_per_step:,.1f} | {r.share:.1%} | {rate_s} |")
        lines += ["", "| costliest kernels | launches | µs / step |", "| --- | ---: | ---: |"]
        lines += [f"| `{n}` | {c} | {us:,.1f} |" for n, c, us in p.top]
        lines += ["", f"idle stretches of {GAP_MIN_US:.0f} µs or more: {p.long_gaps_per_step:.1f} per step, "
                  f"{p.long_gap_us_per_step:,.0f} µs per step"]
        if p.longest_gaps:
            lines += ["", "| longest idle | kernel before | kernel after |", "| ---: | --- | --- |"]
            lines += [f"| {us:,.0f} µs | `{a}` | `{b}` |" for us, a, b in p.longest_gaps]
        lines.append("")
    return "\n".join(lines)


def prefill_shapes(text: str) -> list[tuple[int, int]]:
    """"1x8192,4x2048" -> [(1, 8192), (4, 2048)] (prompts, tokens each); "" -> []."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        n, sep, length = part.partition("x")
        if not (sep and n.isdigit() and length.isdigit() and int(n) > 0 and int(length) > 0):
            raise SystemExit(f"--prefill: expected PROMPTSxTOKENS with positive integers (e.g. 4x2048), got {part!r}")
        shapes.append((int(n), int(length)))
    return shapes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU (aten ops, not kernels)")
    ap.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,32,256)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 1024)")
    ap.add_argument("--steps", type=int, default=None, help="profiled steps per batch (and as many warm-up)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--prefill", default=None,
                    help="prefill steps to profile, comma-separated PROMPTSxTOKENS (e.g. 1x8192,4x2048)")
    ap.add_argument("--no-decode", action="store_true", help="profile the --prefill steps only")
    ap.add_argument("--fused-gemv-max-tokens", type=int, default=None,
                    help="the engine's (default: its own, 1 on an H100 or H200, else 0)")
    ap.add_argument("--spec", type=int, default=0, metavar="K",
                    help="decode steps drafting K tokens (the preset with one MTP layer, spec_bench.py's engine): "
                         "verify steps")
    ap.add_argument("--sampling", choices=["greedy", *SAMPLING_KINDS], default="greedy",
                    help="every decode row's sampling: greedy, or sampling_cost_bench.py's plain (temperature + "
                         "top-p) or extras (plus penalties, min-p and logprobs)")
    ap.add_argument("--top", type=int, default=8, help="the costliest decode kernels listed per batch (default 8)")
    ap.add_argument("--out", type=Path, default=None, help=f"directory for {JSON_NAME}")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("step_profile: expected a CUDA device (or --smoke for the CPU)")
    base = {"device": "cpu", "preset": "tiny", "batches": (1, 4), "context": 24, "steps": 3} if args.smoke else \
        {"device": "cuda", "preset": "8b-like", "batches": (1, 32, 256), "context": 1024, "steps": 10}
    if args.batches:
        try:
            base["batches"] = tuple(int(b) for b in args.batches.split(","))
        except ValueError:
            raise SystemExit(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    for name in ("context", "steps", "preset"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    shapes = prefill_shapes(args.prefill or "")
    if args.no_decode and not shapes:
        raise SystemExit("step_profile: --no-decode expected --prefill shapes to profile, got none")
    # The prefill budget holds the largest shape's tokens in one step (engine_bench's (c) step), the running
    # requests its most prompts.
    tokens = max((n * length for n, length in shapes), default=16)
    bc = BenchConfig(device=base["device"], preset=base["preset"], batches=base["batches"], context=base["context"],
                     steps=base["steps"], prefill_tokens=tokens,
                     prefill_splits=tuple(sorted({n for n, _ in shapes})) or (1,), copy_mib=8 if args.smoke else 1024,
                     fused_gemv_max_tokens=args.fused_gemv_max_tokens, progress=not args.no_progress)
    device = torch.device(bc.device)
    copy = copy_gbps(bc.copy_mib * 2**20, device)
    if args.spec:
        if shapes:
            raise SystemExit("step_profile: --spec profiles decode (verify) steps; expected no --prefill")
        if args.fused_gemv_max_tokens is not None:
            raise SystemExit("step_profile: --spec runs the engine's own fused-GEMV setting; expected no "
                             "--fused-gemv-max-tokens")
        engine = spec_engine(bc, args.spec)
    else:
        engine = build_engine(bc)
    sampling = SAMPLING_KINDS.get(args.sampling)
    profiles = [] if args.no_decode else [profile_decode(engine, bc, b, bc.progress, sampling, args.top)
                                          for b in bc.batches]
    profiles += [profile_prefill(engine, bc, n, length, bc.progress) for n, length in shapes]
    command = " ".join(["python benchmarks/step_profile.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(device), "commit": git_commit(), "preset": bc.preset, "context": bc.context,
            "spec": args.spec, "sampling": args.sampling,
            "prefill": [f"{n}x{length}" for n, length in shapes],
            "copy_gbps": copy, "command": command, "fused_gemv_max_tokens": engine.fused_gemv_max_tokens}
    print(table(profiles, meta))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        data = {"meta": meta, "profiles": [asdict(p) | {"idle_us_per_step": p.idle_us_per_step} for p in profiles]}
        (args.out / JSON_NAME).write_text(json.dumps(data, indent=1))
        print(f"wrote {args.out / JSON_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
