"""Issue #7 (b): Baton's Triton Mamba2 kernels against the field's reference kernels, measured in one run.

1. Chunked scan (prefill): `mamba_chunk_scan_varlen_triton` against state-spaces/mamba's Triton
   `mamba_chunk_scan_combined` (mamba_ssm 2.2.4, `ops/triton/ssd_combined.py`), on the same inputs: one
   row of `--tokens` tokens at the 8b-like layer size (H=128, P=64, N=128, G=8), bf16 activations, fp32
   state, an initial state, the final state returned, dt softplus with dt_bias, D skip. Both outputs are
   compared (relative max error) before timing. The reference runs at its own best chunk size among 128
   and 256; ours at the model's (128). The reference's kernels are `@triton.autotune`d: each process picks their
   configurations by timing them at the first call, and that pick varies between processes (benchmarks/RESULTS.md,
   the chunked scan history). So it is tuned `--ref-tunings` times (its tuning
   caches cleared in between) and timed after each, ours timed as often in between; each side's fastest counts.
   Timed as device time: `--calls` calls queued back to back between two events (median of 7), so the host
   stays ahead of the GPU, as inside a model's forward. Ours runs on one pool slot, set once before its checked
   call and not restored between timed calls (the reference takes its initial state as an argument). The
   single-call latency (events around one call on an idle GPU, median of 30) is printed beside it: it also
   holds the host's launch work, which for the reference (several launches and tensor reshuffles in Python)
   has exceeded its kernels' time (benchmarks/RESULTS.md, the chunked scan history), so it is no measure of the kernels.
2. State update (decode) at batch 1, 32, 256 as a CUDA graph of `--graph-launches` back-to-back launches
   (as the engine's decode graphs run it: no per-launch host cost), in GB/s of the bytes it must move
   against a device-to-device copy measured in the run.

The reference is not a dependency: fetch its source once with `bash benchmarks/fetch_reference.sh` (PyPI
sdist, 92 KB, unpacked into `.ref/`); only its pure-Triton files are imported, through an empty package
stub, so its CUDA extensions are never built.

  python benchmarks/scan_bench.py --ref .ref/mamba_ssm-2.2.4     # one CUDA GPU
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import types
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baton.engine.ops.chunk_scan.kernel import build_chunk_meta, mamba_chunk_scan_varlen_triton  # noqa: E402
from baton.engine.ops.ssm_update.kernel import selective_state_update_triton  # noqa: E402
from benchmarks.kernels_bench import copy_gbps  # noqa: E402
from tests.cuda_timing import time_call_ms  # noqa: E402

H, P, N, G = 128, 64, 128, 8
DT_MIN = 1e-4


def load_reference(root: Path) -> Callable:
    """`mamba_chunk_scan_combined` from an unpacked mamba_ssm sdist, without its package __init__ (which
    imports CUDA extensions)."""
    pkg = root / "mamba_ssm"
    if not (pkg / "ops" / "triton" / "ssd_combined.py").is_file():
        raise ValueError(f"--ref: expected an unpacked mamba_ssm sdist with mamba_ssm/ops/triton/ssd_combined.py, "
                         f"got {root}")
    for name, path in (("mamba_ssm", pkg), ("mamba_ssm.ops", pkg / "ops"), ("mamba_ssm.utils", pkg / "utils")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(path)]
        sys.modules[name] = mod
    return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined


def retune_reference() -> int:
    """Clear the tuning caches of the reference's autotuned kernels (the next call tunes them again); returns how
    many autotuners were found."""
    from triton.runtime.autotuner import Autotuner

    tuners = {id(v): v for name, mod in list(sys.modules.items()) if name.startswith("mamba_ssm.ops.triton")
              for v in vars(mod).values() if isinstance(v, Autotuner)}  # fmt: skip
    for t in tuners.values():
        t.cache.clear()
    return len(tuners)


def time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30) -> float:
    """Median ms of `fn` over `iters` CUDA-event-timed single calls (latency: the host's launch work included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def device_ms(fn: Callable[[], object], calls: int = 20, reps: int = 7, warmup: int = 3) -> float:
    """Device ms per call of `fn`: `calls` calls queued back to back between two events, median over `reps`."""
    return statistics.median(time_call_ms(fn, warmup=warmup if i == 0 else 0, iters=calls) for i in range(reps))


def scan_inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    return dict(
        x=randn(tokens, H, P), dt=randn(tokens, H, scale=0.5), B=randn(tokens, G, N, scale=0.3),
        C=randn(tokens, G, N, scale=0.3),
        A=-torch.exp(torch.rand(H, generator=g, device="cuda") * 2.0),
        D=torch.rand(H, generator=g, device="cuda"), dt_bias=randn(H, scale=0.5, dtype=torch.float32) - 2.0,
        init=randn(H, P, N, scale=0.1, dtype=torch.float32),
    )


def bench_scan(ref: Callable, tokens: int, chunk: int, calls: int = 20, ref_tunings: int = 3) -> dict[str, float]:
    t = scan_inputs(tokens)
    pool = torch.zeros(2, H, P, N, dtype=torch.float32, device="cuda")
    qsl = torch.tensor([0, tokens], device="cuda")
    slots = torch.tensor([1], device="cuda")
    has_init = torch.tensor([True], device="cuda")
    meta = build_chunk_meta([0, tokens], chunk, "cuda")

    # The op reads the row's initial state from its pool slot and writes the final state over it. The slot is set
    # once, for the checked call; the timed calls start from whatever state the one before left there (the kernels'
    # work does not depend on the state's values). Restoring it in every timed call was a 4 MB copy charged to
    # our side alone, since the reference takes its initial state as an argument.
    def ours(share_cb: bool = True):
        return mamba_chunk_scan_varlen_triton(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], qsl,
                                              pool, slots, has_init, chunk, DT_MIN, chunk_meta=meta,
                                              share_cb=share_cb)

    def reference(chunk_size: int):
        def run():
            return ref(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], chunk_size, D=t["D"],
                       dt_bias=t["dt_bias"], initial_states=t["init"][None], dt_softplus=True,
                       dt_limit=(DT_MIN, float("inf")), return_final_states=True)
        return run

    pool[1] = t["init"]
    y = ours()
    final = pool[1].clone()
    y_ref, final_ref = reference(256)()
    err_y = ((y.float() - y_ref[0].float()).abs().max() / y_ref.float().abs().max()).item()
    err_s = ((final - final_ref[0].float()).abs().max() / final_ref.float().abs().max()).item()
    ms_per_head_cb = device_ms(lambda: ours(share_cb=False), calls)
    tuned: dict[int, list[float]] = {c: [] for c in (128, 256)}
    ours_ms: list[float] = []
    for _ in range(ref_tunings):
        ours_ms.append(device_ms(ours, calls))
        for c in tuned:
            if retune_reference() == 0:
                raise ValueError("scan_bench: expected the reference's autotuned kernels in mamba_ssm.ops.triton, "
                                 "found none")
            fn = reference(c)
            fn()  # tunes (and compiles) with this process's timings
            tuned[c].append(device_ms(fn, calls))
    ref_ms = {c: min(v) for c, v in tuned.items()}
    best = min(ref_ms, key=ref_ms.get)
    ms_ours = min(ours_ms)
    return dict(ours_ms=ms_ours, ours_per_head_cb_ms=ms_per_head_cb, ref_ms=ref_ms[best], ref_chunk=best,
                ref_ms_128=ref_ms[128], ref_ms_256=ref_ms[256], speedup=ref_ms[best] / ms_ours, err_y=err_y,
                err_state=err_s, ours_latency_ms=time_ms(ours), ref_latency_ms=time_ms(reference(best)),
                ref_tuned_ms=tuned[best], ours_each_ms=ours_ms)


def bench_state_update_graph(batch: int, launches: int, copy: float) -> dict[str, float]:
    g = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randn(batch, H, P, N, generator=g, device="cuda") * 0.1
    x = torch.randn(batch, H, P, generator=g, device="cuda").bfloat16()
    dt = torch.randn(batch, H, generator=g, device="cuda").bfloat16()
    B = torch.randn(batch, G, N, generator=g, device="cuda").bfloat16()
    C = torch.randn(batch, G, N, generator=g, device="cuda").bfloat16()
    A = -torch.rand(H, device="cuda")
    D, dt_bias = torch.rand(H, device="cuda"), torch.zeros(H, device="cuda")
    slots = torch.arange(batch, device="cuda")

    def once():
        selective_state_update_triton(pool, x, dt, A, B, C, D, dt_bias, slots, DT_MIN)

    ms = time_call_ms(once, warmup=1, iters=10, graph_launches=launches)
    nbytes = batch * (2 * H * P * N * 4 + (2 * H * P + H + 2 * G * N) * 2 + 8)
    gbps = nbytes / (ms / 1e3) / 1e9
    return dict(batch=batch, us=ms * 1e3, gbps=gbps, vs_copy=gbps / copy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ref", type=Path, default=Path(".ref/mamba_ssm-2.2.4"), help="unpacked mamba_ssm sdist")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=128, help="our chunk size (the 8b-like preset's)")
    p.add_argument("--graph-launches", type=int, default=100)
    p.add_argument("--calls", type=int, default=20, help="scan calls queued back to back per timing")
    p.add_argument("--ref-tunings", type=int, default=3,
                   help="times the reference's autotuned kernels are tuned afresh (the fastest tuning counts)")
    a = p.parse_args(argv)
    if a.ref_tunings < 1:
        p.error(f"--ref-tunings: expected >= 1, got {a.ref_tunings}")
    if not torch.cuda.is_available():
        print("scan_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    ref = load_reference(a.ref)
    copy = copy_gbps()
    s = bench_scan(ref, a.tokens, a.chunk, a.calls, a.ref_tunings)
    ups = [bench_state_update_graph(b, a.graph_launches, copy) for b in (1, 32, 256)]
    print(f"\n## Mamba2 kernels vs reference — {torch.cuda.get_device_name()}, copy {copy:,.0f} GB/s\n")
    print("| kernel | shape | Baton ms | reference ms | speedup | goal | max rel. error y / state |")
    print("| --- | --- | ---: | ---: | ---: | --- | --- |")
    goal = "met" if s["speedup"] >= 1.5 else "missed"
    print(f"| chunked scan | {a.tokens} tokens, chunk {a.chunk} (ref best chunk {s['ref_chunk']}: "
          f"128 → {s['ref_ms_128']:.3f}, 256 → {s['ref_ms_256']:.3f} ms) | {s['ours_ms']:.3f} | {s['ref_ms']:.3f} | "
          f"{s['speedup']:.2f}× | ≥ 1.5× {goal} | {s['err_y']:.1e} / {s['err_state']:.1e} |")
    print(f"\n(Device time, {a.calls} calls queued back to back. C·Bᵀ computed once per group; per head instead: "
          f"{s['ours_per_head_cb_ms']:.3f} ms. Single-call latency, the host's launch work included: Baton "
          f"{s['ours_latency_ms']:.3f} ms, reference {s['ref_latency_ms']:.3f} ms. The reference at chunk "
          f"{s['ref_chunk']} after each of {len(s['ref_tuned_ms'])} tunings: "
          f"{', '.join(f'{v:.3f}' for v in s['ref_tuned_ms'])} ms; Baton between them: "
          f"{', '.join(f'{v:.3f}' for v in s['ours_each_ms'])} ms.)")
    print("\n| state update (fp32 state), CUDA graph | batch | µs | GB/s | vs copy | goal |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for u in ups:
        target = {1: 0.5, 256: 0.9}.get(u["batch"])
        goal = "–" if target is None else f"≥ {target:.0%} {'met' if u['vs_copy'] >= target else 'missed'}"
        print(f"| decode | {u['batch']} | {u['us']:.1f} | {u['gbps']:,.0f} | {u['vs_copy']:.0%} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
