"""Where a decode step's GPU time goes: the kernels of engine steps at batch 1, 32, 256, grouped by kind.

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

  python benchmarks/step_profile.py --out /tmp/profile                      # 8b-like on one GPU
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
from benchmarks.engine_bench import (  # noqa: E402
    BenchConfig,
    build_engine,
    copy_gbps,
    decode_traffic,
    enter_decode,
    sync,
)
from benchmarks.run_info import device_name, git_commit  # noqa: E402

JSON_NAME = "step_profile.json"
# (kind, regex on the kernel name), first match wins. GPU kernel names, and aten op names for the CPU smoke run.
KINDS: tuple[tuple[str, str], ...] = (
    ("state update", r"_ssu_|selective_state_update"),
    ("conv", r"_conv_|conv1d"),
    ("scan", r"_ssd_|chunk_scan"),
    ("gated norm", r"_gated_rms_norm|gated_rms_norm"),
    ("norm", r"_rms_norm|rms_norm|rsqrt"),
    ("relu2", r"_relu2"),
    ("attention", r"_paged_attention|paged_attention|_attn_"),
    ("kv write", r"_write_kv|write_kv"),
    ("fused gemv", r"_gemv_kernel"),
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


@dataclass(frozen=True)
class Profile:
    batch: int
    steps: int
    wall_us_per_step: float
    busy_us_per_step: float
    rows: tuple[KindRow, ...]
    top: tuple[tuple[str, int, float], ...]  # (name, kernels / step x steps, µs / step) of the costliest kernels
    weights_gbps: float | None = None  # the weights' bytes / the time of all GEMMs (cuBLAS and fused GEMVs)

    @property
    def idle_us_per_step(self) -> float:
        return max(0.0, self.wall_us_per_step - self.busy_us_per_step)


def profile_of(kernels: Sequence[Kernel], batch: int, steps: int, wall_us: float,
               kind_bytes: dict[str, float] | None = None, top: int = 8) -> Profile:
    """Group `kernels` (those of `steps` steps taking `wall_us` in all) by kind, per step."""
    if steps < 1 or wall_us <= 0:
        raise ValueError(f"profile: expected steps >= 1 and a positive wall time, got {steps}, {wall_us}")
    kind_bytes = kind_bytes or {}
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
        b = kind_bytes.get(kind)
        rows.append(KindRow(kind, count[kind] / steps, us, us / wall, None if b is None or us == 0 else b / us / 1e3))
    costly = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return Profile(batch=batch, steps=steps, wall_us_per_step=wall, busy_us_per_step=sum(time_us.values()) / steps,
                   rows=tuple(rows),
                   top=tuple((name[:90], len(d), sum(d) / steps) for name, d in costly))


def _trace(prof: torch.profiler.profile) -> dict:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def profile_decode(engine, bc: BenchConfig, batch: int, progress: bool) -> Profile:
    device = torch.device(bc.device)
    gpu = device.type == "cuda"
    ids = enter_decode(engine, batch, bc.context, max_tokens=3 * bc.steps + 16, seed=bc.seed + batch,
                       device=device, progress=progress)
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
    p = profile_of(kernels, batch, bc.steps, wall_us, kind_bytes)
    gemm_us = sum(r.us_per_step for r in p.rows if r.kind in ("gemm", "fused gemv"))
    return dataclasses.replace(p, weights_gbps=t.weights / gemm_us / 1e3 if gemm_us else None)


def table(profiles: Iterable[Profile], meta: dict) -> str:
    lines = [f"## Decode step profile — {meta['device_name']}, commit {meta['commit']}, preset {meta['preset']}, "
             f"context {meta['context']}; copy {meta['copy_gbps']:.0f} GB/s", "", f"`{meta['command']}`", ""]
    for p in profiles:
        lines += [f"batch {p.batch}: wall {p.wall_us_per_step:,.0f} µs/step, kernels busy {p.busy_us_per_step:,.0f} "
                  f"µs, idle {p.idle_us_per_step:,.0f} µs ({p.idle_us_per_step / p.wall_us_per_step:.0%}); "
                  f"weights read by all GEMMs at "
                  f"{'–' if p.weights_gbps is None else format(p.weights_gbps, ',.0f')} GB/s", "",
                  "| kind | kernels / step | µs / step | share of wall | GB/s |", "| --- | ---: | ---: | ---: | ---: |"]
        for r in p.rows:
            gbps = "–" if r.gbps is None else f"{r.gbps:,.0f}"
            lines.append(f"| {r.kind} | {r.kernels_per_step:.0f} | {r.us_per_step:,.1f} | {r.share:.1%} | {gbps} |")
        lines += ["", "| costliest kernels | launches | µs / step |", "| --- | ---: | ---: |"]
        lines += [f"| `{n}` | {c} | {us:,.1f} |" for n, c, us in p.top]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny preset on the CPU (aten ops, not kernels)")
    ap.add_argument("--batches", default=None, help="decode batch sizes, comma-separated (default 1,32,256)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 1024)")
    ap.add_argument("--steps", type=int, default=None, help="profiled steps per batch (and as many warm-up)")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--fused-gemv-max-tokens", type=int, default=None,
                    help="the engine's (default: its own, 1 on an H100 or H200, else 0)")
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
    # Only the decode pools matter here: the prefill step of engine_bench is left small.
    bc = BenchConfig(device=base["device"], preset=base["preset"], batches=base["batches"], context=base["context"],
                     steps=base["steps"], prefill_tokens=16, prefill_splits=(1,), copy_mib=8 if args.smoke else 1024,
                     fused_gemv_max_tokens=args.fused_gemv_max_tokens, progress=not args.no_progress)
    device = torch.device(bc.device)
    copy = copy_gbps(bc.copy_mib * 2**20, device)
    engine = build_engine(bc)
    profiles = [profile_decode(engine, bc, b, bc.progress) for b in bc.batches]
    command = " ".join(["python benchmarks/step_profile.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(device), "commit": git_commit(), "preset": bc.preset, "context": bc.context,
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
