"""FP8 linear layers against bf16 at the 8b-like layer shapes, per row count M, in one run.

Timed inside CUDA graphs (as the engine replays steps), weights rotated over enough copies that L2 holds none of
them between calls (`gemv_bench.timer`):

    bf16          cuBLAS (`F.linear`), what a bf16 layer runs past `fused_gemv_max_tokens`
    bf16 gemv     the fused GEMV on the bf16 weight (no prologue), what a few-token step runs
    fp8 gemv      the same GEMV on the block-wise e4m3 weight, dequantized in registers
    fp8 block     `fp8_linear_blockwise`: the one-launch activation quantization + the block-scaled fp8 x fp8 GEMM,
                  with the tuning table's tiles (`ops.fp8_linear.tuning.GEMM_TILES`) and each of `SWEEP`'s; the
                  best one is reported with its tiles
    act quant     the activation quantization alone (its share of `fp8 block`)
    fp8 tensor    per-tensor FP8 (`torch._scaled_mm`, row-wise activation scales)

The GEMVs run only for M <= --gemv-max-rows. Ratios are FP8 over bf16 (below 1: FP8 is faster).

  python benchmarks/fp8_gemm_bench.py                     # one GPU with FP8 tensor cores (Hopper), a few minutes
  python benchmarks/fp8_gemm_bench.py --smoke             # CPU, Triton interpreter, tiny shapes (checks only)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemv_bench import timer  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    n: int
    k: int


SHAPES_8B = (Shape("mamba in_proj", 18560, 4096), Shape("mamba out_proj", 4096, 8192),
             Shape("attention qkv", 6144, 4096), Shape("mlp up_proj", 21504, 4096),
             Shape("mlp down_proj", 4096, 21504))
SHAPES_SMOKE = (Shape("in_proj", 72, 256), Shape("down_proj", 40, 200))


@dataclass(frozen=True)
class Row:
    layer: str
    m: int
    bf16_us: float
    bf16_gemv_us: float      # 0: not timed (M past --gemv-max-rows)
    fp8_gemv_us: float
    fp8_block_us: float      # the tuning table's tiles
    best_block_us: float
    best_tiles: str
    act_quant_us: float
    fp8_tensor_us: float
    max_err: float           # fp8 block (table tiles) against the dequantizing reference, relative to max |y|


def _tiles_str(t) -> str:
    return f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}"


def bench_shape(shape: Shape, m: int, device: torch.device, l2_bytes: int, gemv_max_rows: int, sweep: bool) -> Row:
    # Imported here: the smoke run sets TRITON_INTERPRET before Triton loads.
    from triton.runtime.errors import OutOfResources

    from baton.engine.ops.fp8_linear.kernel import fp8_linear_blockwise, fp8_linear_per_tensor
    from baton.engine.ops.fp8_linear.kernel_act_quant import quantize_activation_triton
    from baton.engine.ops.fp8_linear.reference import (
        fp8_linear_reference,
        quantize_blockwise,
        quantize_per_tensor,
    )
    from baton.engine.ops.fp8_linear.tuning import SWEEP, gemm_tiles
    from baton.engine.ops.linear.kernel import fused_linear_triton

    on_gpu = device.type == "cuda"
    block = (128, 128)
    g = torch.Generator(device=device).manual_seed(0)
    copies = max(1, math.ceil(2 * l2_bytes / (shape.n * shape.k)))  # fp8 bytes: the bf16 copies are twice that
    w32 = [torch.randn(shape.n, shape.k, generator=g, device=device) * shape.k ** -0.5 for _ in range(copies)]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    w16 = [w.to(dtype) for w in w32]
    wb = [quantize_blockwise(w, block) for w in w32]
    wt = [quantize_per_tensor(w) for w in w32]
    del w32
    x = torch.randn(m, shape.k, generator=g, device=device, dtype=dtype)
    reps = max(2, min(24, int(4e9 // max(1, m * shape.n * 2))))  # each call's output lives in the graph's pool
    time_us = timer(device, on_gpu)

    def run(fn) -> float:
        return time_us(fn, copies, reps=reps)

    bf16 = run(lambda i: torch.nn.functional.linear(x, w16[i]))
    gemv16 = gemv8 = 0.0
    if m <= gemv_max_rows:
        gemv16 = run(lambda i: fused_linear_triton(x, w16[i]))
        gemv8 = run(lambda i: fused_linear_triton(x, wb[i][0], weight_scale=wb[i][1], block=block))
    table = gemm_tiles(m)
    blk = run(lambda i: fp8_linear_blockwise(x, wb[i][0], wb[i][1], block))
    best, best_t = blk, _tiles_str(table)
    for t in SWEEP if sweep else ():
        if t == table:
            continue
        try:
            us = run(lambda i, t=t: fp8_linear_blockwise(x, wb[i][0], wb[i][1], block, tiles=t))
        except OutOfResources:
            continue
        if us < best:
            best, best_t = us, _tiles_str(t)
    quant = run(lambda i: quantize_activation_triton(x, block[1]))
    tensor = run(lambda i: fp8_linear_per_tensor(x, wt[i][0], wt[i][1])) if on_gpu else 0.0
    got = fp8_linear_blockwise(x, wb[0][0], wb[0][1], block).float()
    ref = fp8_linear_reference(x.float(), wb[0][0], wb[0][1], block, act_quant=True)
    err = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
    return Row(shape.name, m, bf16, gemv16, gemv8, blk, best, best_t, quant, tensor, err)


def table(rows: list[Row], meta: dict) -> str:
    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}×" if a and b else "–"

    lines = [f"## FP8 (block-wise 128x128, per tensor) vs bf16 linear layers — {meta['device_name']}, commit "
             f"{meta['commit']}", "", f"`{meta['command']}`", "",
             "| layer | M | bf16 µs | fp8 block µs | best fp8 block µs (tiles) | act quant µs | fp8 tensor µs | "
             "best block / bf16 | bf16 gemv µs | fp8 gemv µs | fp8 gemv / bf16 gemv | max err |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gemv = (f"{r.bf16_gemv_us:.1f} | {r.fp8_gemv_us:.1f} | {ratio(r.fp8_gemv_us, r.bf16_gemv_us)}"
                if r.bf16_gemv_us else "– | – | –")
        lines.append(f"| {r.layer} | {r.m} | {r.bf16_us:.1f} | {r.fp8_block_us:.1f} | {r.best_block_us:.1f} "
                     f"({r.best_tiles}) | {r.act_quant_us:.1f} | {r.fp8_tensor_us:.1f} | "
                     f"{ratio(r.best_block_us, r.bf16_us)} | {gemv} | {r.max_err:.1e} |")
    return "\n".join(lines)


def _ints(flag: str, text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag}: expected comma-separated integers >= 1, got {text!r}")
    return vals


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--batches", default=None, help="row counts M, comma-separated (default 1,32,256,8192)")
    ap.add_argument("--gemv-max-rows", type=int, default=64, help="largest M the GEMVs are timed at (default 64)")
    ap.add_argument("--no-sweep", action="store_true", help="time the tuning table's tiles only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        import os
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, shapes, l2 = torch.device("cpu"), SHAPES_SMOKE, 0
    else:
        if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
            raise SystemExit("fp8_gemm_bench: expected a CUDA device with FP8 tensor cores (or --smoke)")
        device, shapes = torch.device("cuda"), SHAPES_8B
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
    ms = _ints("--batches", args.batches or ("1,3,20" if args.smoke else "1,32,256,8192"))
    rows = []
    for shape in shapes:
        for m in ms:
            r = bench_shape(shape, m, device, l2, args.gemv_max_rows, sweep=not args.no_sweep and not args.smoke)
            rows.append(r)
            print(f"{r.layer} M={r.m}: bf16 {r.bf16_us:.1f} µs, fp8 block {r.fp8_block_us:.1f} (best "
                  f"{r.best_block_us:.1f} {r.best_tiles}), gemv bf16 {r.bf16_gemv_us:.1f} fp8 {r.fp8_gemv_us:.1f}",
                  file=sys.stderr, flush=True)
    command = " ".join(["python benchmarks/fp8_gemm_bench.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(device), "commit": git_commit(), "command": command}
    print(table(rows, meta))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    bad = [r for r in rows if r.max_err > 2e-2]
    if bad:
        print(f"fp8_gemm_bench: the block-scaled GEMM differs from the reference: "
              f"{[(r.layer, r.m, r.max_err) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
