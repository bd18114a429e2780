"""The fused-prologue GEMV (`ops.linear.kernel`) against what it replaces, on the 8b-like linear layers.

For each layer shape and decode batch size M, timed inside CUDA graphs (as the engine replays decode steps), the
weights rotated over enough copies that L2 holds none of them between calls:

    separate   the op before the layer as its own kernel (add + RMSNorm, relu2, gated norm: our Triton kernels)
               and then cuBLAS (`F.linear`), what a decode step runs without `fused_gemv_max_tokens`; for
               o_proj and lm_head (no op before them, cuBLAS in the engine either way) cuBLAS alone
    cublas     cuBLAS alone (the weight read, no prologue): the GEMM's own share of `separate`
    fused      one fused_linear_triton launch, default tiles, and the best of a tile sweep (`--sweep-batches`; one
               row: the persistent kernel's programs per SM kept, its blocks of K swept)

GB/s counts the weight bytes only (what a decode step must read); copy = device-to-device copy, read + written.
Last, a decode step's sum over the layers the engine fuses (8b-like: 24 Mamba2, 4 attention, 24 MLP) for each
column.

  python benchmarks/gemv_bench.py                     # one GPU, ~1-2 min with the sweep
  python benchmarks/gemv_bench.py --smoke             # CPU, Triton interpreter, tiny shapes (checks only)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_bench import copy_gbps  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402


@dataclass(frozen=True)
class Layer:
    name: str
    prologue: str
    n: int
    k: int
    per_step: int          # how many such layers a decode step runs (8b-like)
    group_size: int | None = None


LAYERS_8B = (
    Layer("mamba in_proj", "add_norm", 18560, 4096, 24),
    Layer("mamba out_proj", "gated_norm", 4096, 8192, 24, 1024),
    Layer("attention qkv", "add_norm", 6144, 4096, 4),
    Layer("mlp up_proj", "add_norm", 21504, 4096, 24),
    Layer("mlp down_proj", "relu2", 4096, 21504, 24),
    # Not fused in the engine (cuBLAS there): whether a plain Triton GEMV would read them faster.
    Layer("attention o_proj", "none", 4096, 4096, 4),
    Layer("lm_head", "none", 131072, 4096, 1),
)
LAYERS_SMOKE = (
    Layer("in_proj", "add_norm", 40, 32, 2),
    Layer("out_proj", "gated_norm", 32, 64, 2, 16),
    Layer("down_proj", "relu2", 32, 48, 1),
)
SWEEP = {"block_n": (8, 16, 32), "block_k": (256, 512, 1024), "num_warps": (4, 8)}  # each a Triton compile
# 2+ rows on the tensor cores (block of rows >= 16): the block of N is the MMA's long side
SWEEP_DOT = {"block_n": (16, 32, 64, 128), "block_k": (128, 256), "num_warps": (4,)}
# Also tried on the tensor cores with --sweep-OPTION (tile field, what it sweeps): other rows, K tiles, splits of K.
SWEEP_OPTIONS = {"warps": ("num_warps", "warps per program"), "block-n": ("block_n", "blocks of N"),
                 "block-k": ("block_k", "blocks of K"), "block-m": ("block_m", "blocks of rows (default: the default "
                                                                       "tile's)"),
                 "split-k": ("split_k", "splits of K (default 1)")}


@dataclass(frozen=True)
class Row:
    layer: str
    m: int
    separate_us: float
    cublas_us: float
    fused_us: float
    best_us: float
    best_tiles: tuple[int, int, int, int, int, int]  # m, n, k, warps, stages, split
    weight_bytes: int
    max_err: float          # fused vs separate, relative to max |y|

    def gbps(self, us: float) -> float:
        return self.weight_bytes / us / 1e3


def timer(device: torch.device, graphs: bool) -> Callable[[Callable[[int], object], int], float]:
    """µs per call of fn(i) (i: which weight copy), over `reps` calls in a CUDA graph replayed several times."""

    def run(fn: Callable[[int], object], copies: int, reps: int = 24, iters: int = 8) -> float:
        for i in range(3):
            fn(i % copies)
        if not graphs:
            t0 = time.perf_counter()
            for i in range(reps):
                fn(i % copies)
            return (time.perf_counter() - t0) / reps * 1e6
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(reps):
                fn(i % copies)
        g.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            g.replay()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) * 1e3 / (iters * reps)

    return run


def bench_layer(layer: Layer, m: int, device: torch.device, dtype: torch.dtype, sweep: bool,
                l2_bytes: int, stages: tuple[int, ...] = (3,), dot: dict[str, tuple[int, ...]] | None = None) -> Row:
    """dot: the tensor-core sweep's values that differ from SWEEP_DOT's (num_warps, block_n, block_k), and its
    block_m / split_k (default: the default tile's block of rows, no split)."""
    # Imported here: the smoke run sets TRITON_INTERPRET before Triton loads.
    from triton.runtime.errors import OutOfResources

    from baton.engine.ops.kernels import resolve_kernels
    from baton.engine.ops.linear.kernel import GemvTiles, default_tiles, fused_linear_triton
    from baton.engine.ops.linear.reference import fused_linear

    g = torch.Generator(device=device).manual_seed(0)
    wbytes = layer.n * layer.k * dtype.itemsize
    copies = max(1, math.ceil(2 * l2_bytes / wbytes))
    ws = [torch.randn(layer.n, layer.k, generator=g, device=device, dtype=dtype) * layer.k ** -0.5
          for _ in range(copies)]
    a = torch.randn(m, layer.k, generator=g, device=device, dtype=dtype)
    kw: dict = {"prologue": layer.prologue, "eps": 1e-5}
    if layer.prologue == "add_norm":
        kw["residual"] = torch.randn(m, layer.k, generator=g, device=device, dtype=dtype)
    if layer.prologue == "gated_norm":
        kw["gate"] = torch.randn(m, layer.k, generator=g, device=device, dtype=dtype)
        kw["group_size"] = layer.group_size
    if layer.prologue in ("add_norm", "gated_norm", "norm"):
        kw["norm_weight"] = torch.rand(layer.k, generator=g, device=device, dtype=dtype) + 0.5

    kernels = resolve_kernels("triton", device)

    def separate(i: int):  # the op's own kernel, then the GEMM
        if layer.prologue == "add_norm":
            x, _ = kernels.add_rms_norm(a, kw["residual"], kw["norm_weight"], 1e-5)
        elif layer.prologue == "gated_norm":
            x = kernels.gated_rms_norm(a, kw["gate"], kw["norm_weight"], layer.group_size, 1e-5).to(dtype)
        elif layer.prologue == "relu2":
            x = kernels.relu2(a)
        else:
            x = a
        return torch.nn.functional.linear(x, ws[i])

    def out(y):
        return y[0] if isinstance(y, tuple) else y

    on_gpu = device.type == "cuda"
    time_us = timer(device, on_gpu)
    ref = fused_linear(a, ws[0], **kw)
    got = fused_linear_triton(a, ws[0], **kw)
    scale = out(ref).float().abs().max().clamp_min(1e-6)
    err = float((out(got).float() - out(ref).float()).abs().max() / scale)
    sep = time_us(separate, copies)
    cub = time_us(lambda i: torch.nn.functional.linear(a, ws[i]), copies)
    d = default_tiles(m, layer.n, layer.k, on_gpu)
    fused = time_us(lambda i: fused_linear_triton(a, ws[i], tiles=d, **kw), copies)
    best, best_t = fused, (d.block_m, d.block_n, d.block_k, d.num_warps, d.num_stages, d.split_k)
    if sweep:
        on_dot = d.block_m >= 16
        opts = {**SWEEP_DOT, "block_m": (d.block_m,), "split_k": (1,), **(dot or {})} if on_dot else {
            **SWEEP, "block_m": (d.block_m,), "split_k": (1,)}
        grid = [opts[f] for f in ("block_n", "block_k", "num_warps", "block_m", "split_k")]
        seen = set()
        for bn, bk, nw, bm, sk, st in itertools.product(*grid, stages):
            t = GemvTiles(bm, bn, min(bk, 1 << (layer.k - 1).bit_length()), nw, st, d.programs_per_sm,
                          d.prologue_apart, split_k=sk)
            if t in seen or (sk > 1 and (math.ceil(layer.k / t.block_k) < sk  # a split needs a K tile each,
                                         or (layer.prologue != "none" and not t.prologue_apart))):  # and a plain GEMM
                continue
            seen.add(t)
            if not on_dot and bm * bn * t.block_k > 32768:  # register tile too large for one program
                continue
            if on_dot and (st * (bn + 2 * bm) + bm) * t.block_k * 2 > 232_448:  # shared memory: W, a
                continue  # and the residual / gate per stage, the MMA's f(a) tile
            try:
                us = time_us(lambda i, t=t: fused_linear_triton(a, ws[i], tiles=t, **kw), copies)
            except OutOfResources:
                continue
            if us < best:
                best, best_t = us, (t.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, t.split_k)
    return Row(layer.name, m, sep, cub, fused, best, best_t, wbytes, err)


def table(rows: list[Row], layers: tuple[Layer, ...], meta: dict) -> str:
    lines = [f"## Fused-prologue GEMV vs separate op + cuBLAS — {meta['device_name']}, commit {meta['commit']}", "",
             f"`{meta['command']}`; copy {meta['copy_gbps']:.0f} GB/s", "",
             "| layer | M | separate µs | cuBLAS alone µs | fused µs | best fused µs (m, n, k, warps, stages, split) | "
             "fused / separate | best GB/s | max err |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r.layer} | {r.m} | {r.separate_us:.1f} | {r.cublas_us:.1f} | {r.fused_us:.1f} | "
                     f"{r.best_us:.1f} {r.best_tiles} | {r.best_us / r.separate_us:.2f}× | "
                     f"{r.gbps(r.best_us):,.0f} | {r.max_err:.1e} |")
    per = {lay.name: lay.per_step for lay in layers if lay.prologue != "none"}  # what the engine fuses
    lines += ["", "| M | per step: separate µs | cuBLAS alone µs | fused (default) µs | fused (best) µs | saved µs |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in sorted({r.m for r in rows}):
        rs = [r for r in rows if r.m == m and r.layer in per]
        tot = {f: sum(getattr(r, f) * per[r.layer] for r in rs) for f in ("separate_us", "cublas_us", "fused_us",
                                                                           "best_us")}
        lines.append(f"| {m} | {tot['separate_us']:,.0f} | {tot['cublas_us']:,.0f} | {tot['fused_us']:,.0f} | "
                     f"{tot['best_us']:,.0f} | {tot['separate_us'] - tot['best_us']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--batches", default=None, help="M values, comma-separated (default 1,2,4,8,16,32,64)")
    ap.add_argument("--sweep-batches", default="1,16", help="M values that get the tile sweep (default 1,16; "
                    "'' for none)")
    ap.add_argument("--sweep-stages", default="3",
                    help="software-pipeline stages the sweep tries, comma-separated (default 3, Triton's own; each "
                         "value multiplies the sweep's compiles)")
    for opt, (_, what) in SWEEP_OPTIONS.items():
        ap.add_argument(f"--sweep-{opt}", default=None,
                        help=f"{what} the tensor-core sweep (2+ rows) tries, comma-separated powers of two")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, layers, l2 = torch.device("cpu"), torch.float32, LAYERS_SMOKE, 0
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gemv_bench: expected a CUDA device (or --smoke)")
        device, dtype, layers = torch.device("cuda"), torch.bfloat16, LAYERS_8B
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
    try:
        ms = tuple(int(x) for x in (args.batches or ("1,2" if args.smoke else "1,2,4,8,16,32,64")).split(","))
    except ValueError:
        raise SystemExit(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    copy = copy_gbps(1 << 30, device) if device.type == "cuda" else 0.0
    rows = []
    jobs = [(lay, m) for lay in layers for m in ms]
    sweep = set() if args.smoke or not args.sweep_batches else {int(x) for x in args.sweep_batches.split(",")}
    try:
        stages = tuple(int(x) for x in args.sweep_stages.split(","))
    except ValueError:
        raise SystemExit(f"--sweep-stages: expected comma-separated integers, got {args.sweep_stages!r}") from None
    if not stages or min(stages) < 1:
        raise SystemExit(f"--sweep-stages: expected integers >= 1, got {args.sweep_stages!r}")
    dot = {}
    for opt, (field, _) in SWEEP_OPTIONS.items():
        given = getattr(args, f"sweep_{opt.replace('-', '_')}")
        if given is None:
            continue
        try:
            vals = tuple(int(x) for x in given.split(","))
        except ValueError:
            vals = ()
        if not vals or any(v < 1 or v & (v - 1) for v in vals):
            raise SystemExit(f"--sweep-{opt}: expected comma-separated powers of two, got {given!r}")
        dot[field] = vals
    for lay, m in tqdm(jobs, desc="gemv", disable=args.no_progress):
        rows.append(bench_layer(lay, m, device, dtype, sweep=m in sweep, l2_bytes=l2, stages=stages,
                                dot=dot))
        r = rows[-1]
        tqdm.write(f"{r.layer} M={r.m}: cuBLAS {r.cublas_us:.1f} µs, fused {r.fused_us:.1f}, best {r.best_us:.1f} "
                   f"{r.best_tiles}", file=sys.stderr)
    command = " ".join(["python benchmarks/gemv_bench.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(device), "commit": git_commit(), "command": command, "copy_gbps": copy}
    print(table(rows, layers, meta))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    bad = [r for r in rows if r.max_err > (2e-2 if dtype == torch.bfloat16 else 1e-4)]
    if bad:
        print(f"gemv_bench: fused output differs from the reference: {[(r.layer, r.m, r.max_err) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
