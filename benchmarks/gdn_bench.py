"""Issue #48 (b): Baton's Triton Gated DeltaNet kernels against flash-linear-attention's, measured in one run.

1. Chunked prefill: `gated_delta_prefill_varlen_triton` against fla's `chunk_gated_delta_rule` (the field's
   reference, `fla.ops.gated_delta_rule`), on the same inputs: one row of `--tokens` tokens at one Qwen3.5-27B
   linear-attention layer (16 key heads, 48 value heads, head dims 128), bf16 q, k, v, an fp32 initial state, the
   final state returned, q/k L2-normalised in the kernel. Ours takes the raw gate projections (a, b) and makes g
   and beta itself; fla gets them made (outside its timing). Outputs and final states are compared (relative max
   error) before timing. Device time: `--calls` calls queued back to back between two events (median of 7).
2. Decode (the recurrent update) at batch 1, 32, 256 as a CUDA graph of `--graph-launches` launches, in GB/s of
   the bytes it must move (the fp32 state read and written, q, k, v, a, b read, the output written) against a
   device-to-device copy measured in the run. `--decode-sweep 2048x4,8192x4x2s,...` also times each (state
   elements per tile) x (warps) [x (tiles per program)] [s: L2 streaming hints] launch at every batch: what
   `tuning.DECODE_LAUNCH` is chosen from. `--wy-sweep 8192x8x2x4,...` times the chunk-parallel prefill at each
   (scan tile x scan warps x scan stages x prep warps): what `tuning.WY_*` are chosen from. `--split-scan` times
   the chunk-parallel prefill's two second stages in the same run (the fused scan and the split state + output
   kernels, `tuning.WY_SPLIT_SCAN`), each with its kernels' device times and its errors against fla;
   `--solve-doubling` likewise times both inversions of the prep's diagonal blocks (`tuning.WY_SOLVE_DOUBLING`);
   `--split-sweep 4096x4x2x8192x4,...` times the split one at each (state tile x state warps x state stages x
   output tile x output warps).

fla is not a dependency: carry its wheels (`pip download fla-core==0.6.0 flash-linear-attention==0.6.0 --no-deps
-d .whl-fla`; pure Python + Triton) and install them on the GPU machine; without it, part 1 times ours alone.

  python benchmarks/gdn_bench.py --json out.json     # one CUDA GPU
  python benchmarks/gdn_bench.py --split-scan --batches 1 --json out.json   # fused vs split second stage
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HK, HV, DK, DV = 16, 48, 128, 128  # one Qwen3.5-27B Gated DeltaNet layer
CHUNK = 64


def device_ms(fn: Callable[[], object], calls: int = 20, reps: int = 7) -> float:
    from tests.cuda_timing import time_call_ms

    return statistics.median(time_call_ms(fn, warmup=3 if i == 0 else 0, iters=calls) for i in range(reps))


def inputs(tokens: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    return dict(q=randn(tokens, HK, DK), k=randn(tokens, HK, DK), v=randn(tokens, HV, DV), a=randn(tokens, HV),
                b=randn(tokens, HV), A_log=torch.log(torch.linspace(1, 16, HV, device="cuda")),
                dt_bias=randn(HV, scale=0.5, dtype=torch.float32), init=randn(HV, DK, DV, scale=0.1,
                                                                               dtype=torch.float32))


def kernel_us(fn: Callable[[], object], calls: int = 5) -> dict[str, float]:
    """Device µs per call of each kernel `fn` launches, from the torch profiler (mean over `calls` calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:60]] = per.get(e.name[:60], 0.0) + e.device_time / calls
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def prefill_call(tokens: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, Callable[[], torch.Tensor]]:
    """(inputs, a two-slot pool, our prefill of one `tokens`-token row into slot 1 from its state there). Timed
    calls start from what the one before left: the work does not depend on the state's values."""
    from baton.engine.ops.gated_delta.kernel_prefill import gated_delta_prefill_varlen_triton

    t = inputs(tokens)
    pool = torch.zeros(2, HV, DK, DV, dtype=torch.float32, device="cuda")
    qsl = torch.tensor([0, tokens], device="cuda")
    slots = torch.tensor([1], device="cuda")
    init = torch.tensor([True], device="cuda")

    def ours():
        return gated_delta_prefill_varlen_triton(pool, t["q"], t["k"], t["v"], t["a"], t["b"], t["A_log"],
                                                 t["dt_bias"], qsl, slots, init, CHUNK)

    return t, pool, ours


@contextlib.contextmanager
def solve_inversion(doubling: bool | None) -> Iterator[None]:
    """Runs the block with the prep's diagonal blocks inverted by substitution (False) or by the doubling product
    (True, `tuning.WY_SOLVE_DOUBLING`); None: as tuned."""
    from baton.engine.ops.gated_delta import kernel_chunk_wy

    if doubling is None:  # as tuned: also a tree with one inversion only
        yield
        return
    tuned = kernel_chunk_wy.WY_SOLVE_DOUBLING
    kernel_chunk_wy.WY_SOLVE_DOUBLING = doubling
    try:
        yield
    finally:
        kernel_chunk_wy.WY_SOLVE_DOUBLING = tuned


@contextlib.contextmanager
def variant(split: bool | None, doubling: bool | None) -> Iterator[None]:
    with second_stage(split), solve_inversion(doubling):
        yield


@contextlib.contextmanager
def second_stage(split: bool | None) -> Iterator[None]:
    """Runs the block with the chunk-parallel prefill's fused (False) or split (True) second stage; None: as tuned."""
    from baton.engine.ops.gated_delta import kernel_prefill

    if split is None:  # as tuned: also a tree whose prefill has one second stage only
        yield
        return
    tuned = kernel_prefill.WY_SPLIT_SCAN
    kernel_prefill.WY_SPLIT_SCAN = tuned if split is None else split
    try:
        yield
    finally:
        kernel_prefill.WY_SPLIT_SCAN = tuned


def bench_prefill(tokens: int, calls: int, split_scan: bool = False, solve_doubling: bool = False
                  ) -> dict[str, object]:  # fmt: skip
    """Our prefill (as tuned; with `split_scan` each second stage, "fused" and "split"; with `solve_doubling` each
    inversion of the solve's diagonal blocks, "substitution" and "doubling") against fla's."""
    from baton.engine.ops.gated_delta.reference import gdn_gates

    t, pool, ours = prefill_call(tokens)
    variants: dict[str, tuple[bool | None, bool | None]] = {"ours": (None, None)}
    if split_scan:
        variants = {"fused": (False, None), "split": (True, None)}
    if solve_doubling:
        variants = {"substitution": (None, False), "doubling": (None, True)}
    runs: dict[str, dict[str, object]] = {}
    for name, (split, doubling) in variants.items():
        with variant(split, doubling):
            pool[1] = t["init"]
            o = ours()
            runs[name] = dict(o=o, final=pool[1].clone(), ms=device_ms(ours, calls))
    out: dict[str, object] = {"tokens": tokens, "paths": {n: {"ms": r["ms"]} for n, r in runs.items()}}
    if split_scan:
        out["split_vs_fused"] = {"o": rel_err(runs["split"]["o"], runs["fused"]["o"]),
                                 "state": rel_err(runs["split"]["final"], runs["fused"]["final"])}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        out["fla"] = f"not installed ({e})"
        return out
    g, beta = gdn_gates(t["a"], t["b"], t["A_log"], t["dt_bias"])
    q, k, v = t["q"][None], t["k"][None], t["v"][None]
    expand = ""
    try:  # fla with grouped value heads (more v heads than q/k heads), as Qwen3.5 runs it
        chunk_gated_delta_rule(q, k, v, g=g[None], beta=beta[None].to(v.dtype), initial_state=t["init"][None],
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    except Exception as e:  # an fla without grouped heads: q, k repeated per value head (3x their reads)
        expand = f"q/k repeated to {HV} heads ({type(e).__name__})"
        q, k = (x.repeat_interleave(HV // HK, dim=2) for x in (q, k))

    def fla():
        return chunk_gated_delta_rule(q, k, v, g=g[None], beta=beta[None].to(v.dtype), initial_state=t["init"][None],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)

    o_ref, final_ref = fla()
    kernels = {}
    for name, (split, doubling) in variants.items():
        with variant(split, doubling):
            kernels[name] = kernel_us(ours)
    kernels["fla"] = kernel_us(fla)
    out.update(kernels=kernels, fla_ms=device_ms(fla, calls), fla_heads=expand or "grouped")
    for name, r in runs.items():
        out["paths"][name].update(err_o=rel_err(r["o"], o_ref[0]), err_state=rel_err(r["final"], final_ref[0]),
                                  speedup=out["fla_ms"] / r["ms"])
    return out


def bench_decode(batch: int, launches: int, copy: float, launch: tuple[int, int, int, bool] | None = None
                 ) -> dict[str, object]:  # fmt: skip
    from baton.engine.ops.gated_delta.kernel import gated_delta_decode_triton
    from tests.cuda_timing import time_call_ms

    g = torch.Generator(device="cuda").manual_seed(1)
    pool = torch.randn(batch, HV, DK, DV, generator=g, device="cuda") * 0.1

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda").bfloat16()

    q, k, v, a, b = randn(batch, HK, DK), randn(batch, HK, DK), randn(batch, HV, DV), randn(batch, HV), randn(batch, HV)
    A_log, dt_bias = torch.zeros(HV, device="cuda"), torch.zeros(HV, device="cuda")
    slots = torch.arange(batch, device="cuda")
    tile, warps, tiles, stream = launch or (None, None, None, None)

    def once():
        gated_delta_decode_triton(pool, q, k, v, a, b, A_log, dt_bias, slots, tile=tile, num_warps=warps, tiles=tiles,
                                  stream=stream)

    ms = time_call_ms(once, warmup=1, iters=10, graph_launches=launches)
    nbytes = batch * (2 * HV * DK * DV * 4 + (2 * HK * DK + 2 * HV * DV + 2 * HV) * 2 + 8)
    gbps = nbytes / (ms / 1e3) / 1e9
    name = "tuned" if launch is None else f"{tile}x{warps}x{tiles}" + ("s" if stream else "")
    return dict(batch=batch, us=ms * 1e3, gbps=gbps, vs_copy=gbps / copy, launch=name)


def parse_sweep(text: str) -> list[tuple[int, int, int, bool]]:
    """'2048x4,8192x4x2s' -> [(2048, 4, 1, False), (8192, 4, 2, True)]: state elements per program x warps, then
    optionally x tiles per program, and a trailing 's' for the L2 streaming hints; powers of two."""
    out = []
    for item in text.split(","):
        stream = item.endswith("s")
        parts = item.removesuffix("s").split("x")
        try:
            t, w, n = (int(x) for x in (parts + ["1"])[:3]) if len(parts) in (2, 3) else (0, 0, 0)
        except ValueError:
            t = w = n = 0
        if min(t, w, n) < 1 or t & (t - 1) or w & (w - 1):
            raise ValueError(f"--decode-sweep: expected TILExWARPS[xTILES][s] items of powers of two like 4096x4 or "
                             f"8192x4x2s, got {item!r}")
        out.append((t, w, n, stream))
    return out


def parse_launches(text: str, flag: str, fields: str, example: str) -> list[tuple[int, ...]]:
    """'8192x8x2x4,4096x4x3x4' -> [(8192, 8, 2, 4), (4096, 4, 3, 4)]: positive integers, as many per item as the
    x-separated `fields` name."""
    n = len(fields.split("x"))
    out = []
    for item in text.split(","):
        try:
            vals = tuple(int(x) for x in item.split("x"))
        except ValueError:
            vals = ()
        if len(vals) != n or min(vals) < 1:
            raise ValueError(f"{flag}: expected {fields} items like {example}, got {item!r}")
        out.append(vals)
    return out


def parse_wy_sweep(text: str) -> list[tuple[int, ...]]:
    """'8192x8x2x4,4096x4x3x4' -> [(scan tile, scan warps, scan stages, prep warps), ...]."""
    return parse_launches(text, "--wy-sweep", "SCANTILExSCANWARPSxSTAGESxPREPWARPS", "8192x8x2x4")


def parse_split_sweep(text: str) -> list[tuple[int, ...]]:
    """'4096x4x2x8192x4' -> [(state tile, state warps, state stages, output tile, output warps), ...]."""
    return parse_launches(text, "--split-sweep", "STATETILExSTATEWARPSxSTAGESxOUTTILExOUTWARPS", "4096x4x2x8192x4")


def parse_prep_sweep(text: str) -> list[tuple[int, ...]]:
    """'4x32x8x32,2x32x4x32' -> [(solve warps, solve key slice, W/U warps, W/U columns), ...]."""
    return parse_launches(text, "--prep-sweep", "SOLVEWARPSxSOLVEBKxPREPWARPSxCOLS", "4x32x8x32")


def parse_stages_sweep(text: str) -> list[tuple[int, ...]]:
    """'1x1,1x2,2x2' -> [(solve stages, W/U stages), ...]."""
    return parse_launches(text, "--stages-sweep", "SOLVESTAGESxPREPSTAGES", "1x2")


def bench_launches(tokens: int, calls: int, module: object, names: tuple[str, ...], sweep: list[tuple[int, ...]],
                   split: bool) -> list[dict[str, object]]:  # fmt: skip
    """The chunk-parallel prefill with the fused (or `split`) second stage at each launch of `sweep`, the tuning
    entries `names` of `module` set to its values, its output checked against the tuned launch's."""
    t, pool, ours = prefill_call(tokens)
    tuned = tuple(getattr(module, n) for n in names)
    rows = []
    with second_stage(split):
        pool[1] = t["init"]
        ref = ours()
        try:
            for launch in sweep:
                for n, x in zip(names, launch, strict=True):
                    setattr(module, n, x)
                name = "x".join(str(x) for x in launch)
                try:
                    pool[1] = t["init"]
                    err = rel_err(ours(), ref)
                    rows.append(dict(launch=name, ms=device_ms(ours, calls), err_vs_tuned=err))
                except Exception as e:  # a launch past the SM's shared memory: recorded, not fatal
                    rows.append(dict(launch=name, error=f"{type(e).__name__}: {str(e)[:120]}"))
        finally:
            for n, x in zip(names, tuned, strict=True):
                setattr(module, n, x)
    return rows


def bench_wy(tokens: int, calls: int, sweep: list[tuple[int, ...]]) -> list[dict[str, object]]:
    """The fused chunk-parallel prefill at each (scan tile, scan warps, scan stages, prep warps)."""
    from baton.engine.ops.gated_delta import kernel_chunk_wy as wy

    names = ("WY_SCAN_TILE", "WY_SCAN_WARPS", "WY_SCAN_STAGES", "WY_PREP_WARPS")
    return bench_launches(tokens, calls, wy, names, sweep, split=False)


def bench_prep(tokens: int, calls: int, sweep: list[tuple[int, ...]]) -> list[dict[str, object]]:
    """The fused chunk-parallel prefill at each (solve warps, solve key slice, W/U warps, W/U columns) of the prep."""
    from baton.engine.ops.gated_delta import kernel_chunk_wy as wy

    names = ("WY_SOLVE_WARPS", "WY_SOLVE_BK", "WY_PREP_WARPS", "WY_PREP_COLS")
    return bench_launches(tokens, calls, wy, names, sweep, split=False)


def bench_stages(tokens: int, calls: int, sweep: list[tuple[int, ...]]) -> list[dict[str, object]]:
    """The fused chunk-parallel prefill at each (solve stages, W/U stages): the prep loops' software pipelining."""
    from baton.engine.ops.gated_delta import kernel_chunk_wy as wy

    return bench_launches(tokens, calls, wy, ("WY_SOLVE_STAGES", "WY_PREP_STAGES"), sweep, split=False)


def bench_split(tokens: int, calls: int, sweep: list[tuple[int, ...]]) -> list[dict[str, object]]:
    """The split chunk-parallel prefill at each (state tile, state warps, state stages, output tile, output warps)."""
    from baton.engine.ops.gated_delta import kernel_chunk_state as st

    names = ("WY_STATE_TILE", "WY_STATE_WARPS", "WY_STATE_STAGES", "WY_OUT_TILE", "WY_OUT_WARPS")
    return bench_launches(tokens, calls, st, names, sweep, split=True)


def print_prefill(prefill: dict[str, object]) -> None:
    paths = prefill["paths"]
    print(f"prefill, {prefill['tokens']} tokens, one 27B GDN layer: "
          + ", ".join(f"{n} {p['ms']:.3f} ms" for n, p in paths.items()), end="")
    if "fla_ms" in prefill:
        print(f"; fla {prefill['fla_ms']:.3f} ms ({prefill['fla_heads']})")
        for n, p in paths.items():
            print(f"  {n}: {p['speedup']:.2f}x fla; rel err o {p['err_o']:.1e}, state {p['err_state']:.1e}")
    else:
        print(f"; fla {prefill['fla']}")
    if "split_vs_fused" in prefill:
        d = prefill["split_vs_fused"]
        print(f"  split vs fused: rel err o {d['o']:.1e}, state {d['state']:.1e}")
    for side, kernels in prefill.get("kernels", {}).items():
        print(f"  {side} kernels (µs per call): " + ", ".join(f"{n} {us:.0f}" for n, us in list(kernels.items())[:8]))


def print_launches(rows: list[dict[str, object]], what: str) -> None:
    print(f"| prefill launch ({what}) | ms | rel err vs tuned |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['launch']} | " + (f"{r['ms']:.3f} | {r['err_vs_tuned']:.1e} |" if "ms" in r
                                       else f"{r['error']} | |"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="prefill row length")
    p.add_argument("--batches", default="1,32,256", help="decode batch sizes, comma-separated")
    p.add_argument("--graph-launches", type=int, default=100)
    p.add_argument("--calls", type=int, default=20, help="prefill calls queued back to back per timing")
    p.add_argument("--decode-sweep", default="",
                   help="decode launches to time too, TILExWARPS[xTILES][s] comma-separated (s: L2 streaming hints)")
    p.add_argument("--wy-sweep", default="", help="chunk-parallel prefill launches to time too, "
                   "SCANTILExSCANWARPSxSTAGESxPREPWARPS comma-separated")
    p.add_argument("--solve-doubling", action="store_true", help="time the chunk-parallel prefill with each "
                   "inversion of the solve's diagonal blocks (substitution, doubling product)")
    p.add_argument("--split-scan", action="store_true", help="time the chunk-parallel prefill with each second "
                   "stage, the fused scan and the split state + output kernels, against fla in the same run")
    p.add_argument("--split-sweep", default="", help="split chunk-parallel prefill launches to time too, "
                   "STATETILExSTATEWARPSxSTAGESxOUTTILExOUTWARPS comma-separated")
    p.add_argument("--prep-sweep", default="", help="chunk-parallel prefill prep launches to time too, "
                   "SOLVEWARPSxSOLVEBKxPREPWARPSxCOLS comma-separated")
    p.add_argument("--stages-sweep", default="", help="chunk-parallel prefill prep pipelining to time too, "
                   "SOLVESTAGESxPREPSTAGES comma-separated")
    p.add_argument("--no-prefill", action="store_true", help="decode only")
    p.add_argument("--json", type=Path, default=None, help="write the results here too")
    a = p.parse_args(argv)
    try:
        sweep = parse_sweep(a.decode_sweep) if a.decode_sweep else []
        wy_sweep = parse_wy_sweep(a.wy_sweep) if a.wy_sweep else []
        split_sweep = parse_split_sweep(a.split_sweep) if a.split_sweep else []
        prep_sweep = parse_prep_sweep(a.prep_sweep) if a.prep_sweep else []
        stages_sweep = parse_stages_sweep(a.stages_sweep) if a.stages_sweep else []
    except ValueError as e:
        p.error(str(e))
    try:
        batches = [int(x) for x in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches: expected comma-separated integers, got {a.batches!r}")
    if a.tokens < 1 or any(b < 1 for b in batches) or a.graph_launches < 1 or a.calls < 1:
        p.error(f"--tokens, --batches, --graph-launches, --calls: expected integers >= 1, got {a.tokens}, "
                f"{a.batches}, {a.graph_launches}, {a.calls}")
    if a.split_scan and a.solve_doubling:
        p.error("--split-scan and --solve-doubling: expected one of them, got both")
    if not torch.cuda.is_available():
        print("gdn_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    from benchmarks.kernels_bench import copy_gbps

    print(f"device: {torch.cuda.get_device_name()}")
    prefill = {} if a.no_prefill else bench_prefill(a.tokens, a.calls, a.split_scan, a.solve_doubling)
    if prefill:
        print_prefill(prefill)
    wy_rows = bench_wy(a.tokens, a.calls, wy_sweep) if wy_sweep and not a.no_prefill else []
    if wy_rows:
        print_launches(wy_rows, "scan tile x warps x stages x prep warps")
    prep_rows = bench_prep(a.tokens, a.calls, prep_sweep) if prep_sweep and not a.no_prefill else []
    if prep_rows:
        print_launches(prep_rows, "prep: solve warps x key slice x W/U warps x columns")
    stages_rows = bench_stages(a.tokens, a.calls, stages_sweep) if stages_sweep and not a.no_prefill else []
    if stages_rows:
        print_launches(stages_rows, "prep pipelining: solve stages x W/U stages")
    split_rows = bench_split(a.tokens, a.calls, split_sweep) if split_sweep and not a.no_prefill else []
    if split_rows:
        print_launches(split_rows, "split: state tile x warps x stages x output tile x warps")
    copy = copy_gbps()
    decode = [bench_decode(b, a.graph_launches, copy) for b in batches]
    print(f"decode (graph of {a.graph_launches} launches), copy {copy:.0f} GB/s")
    print("| batch | us | GB/s | of copy |\n| ---: | ---: | ---: | ---: |")
    for d in decode:
        print(f"| {d['batch']} | {d['us']:.1f} | {d['gbps']:.0f} | {d['vs_copy']:.0%} |")
    swept = [bench_decode(b, a.graph_launches, copy, launch) for b in batches for launch in sweep]
    if swept:
        print("| batch | tile x warps x tiles | us | of copy |\n| ---: | --- | ---: | ---: |")
        for d in swept:
            print(f"| {d['batch']} | {d['launch']} | {d['us']:.1f} | {d['vs_copy']:.0%} |")
    if a.json:
        a.json.write_text(json.dumps({"prefill": prefill, "prefill_sweep": wy_rows, "prefill_split_sweep": split_rows,
                                      "prefill_prep_sweep": prep_rows, "prefill_stages_sweep": stages_rows,
                                      "decode": decode, "decode_sweep": swept, "copy_gbps": copy}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
