"""The fused-MoE kernels (`ops.moe.kernel`) against the per-expert loop they replace and a dense GEMM pair of the
same active FLOPs, on Nemotron-3-Nano-like routed experts (128 experts, top-6, hidden 2688, intermediate 1856,
relu2) or Qwen3-Next-like ones (512 experts, top-10, hidden 2048, intermediate 512, gated SiLU).

For each token count T (random router logits through the model's router):

    loop    `moe_experts_reference`: one host sync for the expert segments, then per expert two cuBLAS GEMMs
            and the activation (the layers' form before the kernels)
    fused   `moe_experts_triton`: align, grouped GEMM up (activation fused), down (routing weight fused), top-k sum
    dense   x [T, H] @ [H, top_k * I], the activation, @ [top_k * I, H] in cuBLAS: the active FLOPs of one
            token's experts as a dense layer (what the routed GEMMs could at best cost once compute-bound)

With `--fp8 per-tensor|block` also:

    fp8     `moe_experts_triton` on the same experts quantized to float8_e4m3fn (each expert's segments apart, as
            the checkpoints store them; one scale per expert, or per 128 x 128 block), weight-only: the same
            activations in the model dtype, half the weight bytes the decode-sized steps stream

Times are ms per call (CUDA events around repeated eager calls, after a warm-up that compiles); err is fused vs
loop, max |difference| over max |loop|; fp8 err is the FP8 fused path vs the loop on the same FP8 experts (the
reference dequantizes each expert it runs).

  python benchmarks/moe_bench.py                        # one GPU, Nemotron-3-Nano-like, T = 1, 32, 256, 8192
  python benchmarks/moe_bench.py --shape qwen-next --json out.json
  python benchmarks/moe_bench.py --fp8 block            # the 16-bit and the FP8-weight fused paths side by side
  python benchmarks/moe_bench.py --smoke                # CPU, Triton interpreter, tiny shapes (checks only)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.engine_bench import time_ms  # noqa: E402
from benchmarks.run_info import device_name, git_commit  # noqa: E402


@dataclass(frozen=True)
class Shape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    gated: bool


SHAPES = {
    "nano": Shape(128, 6, 2688, 1856, False),
    "qwen-next": Shape(512, 10, 2048, 512, True),
    "smoke": Shape(8, 2, 32, 16, False),
}


FP8_CHOICES = ("per-tensor", "block")
FP8_BLOCK = (128, 128)  # the block-wise checkpoints' weight_block_size


@dataclass(frozen=True)
class Row:
    tokens: int
    loop_ms: float
    fused_ms: float
    dense_ms: float
    max_err: float
    fp8_ms: float | None = None  # --fp8: the fused path on FP8 experts
    fp8_err: float | None = None


def _timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        fn()  # warm-up (compiles)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time_ms(fn, iters, device)

    return run


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


def bench(shape: Shape, tokens: int, device: torch.device, dtype: torch.dtype, iters: int,
          fp8: str | None = None) -> Row:
    # Imported here: the smoke run sets TRITON_INTERPRET before Triton loads.
    from baton.engine.ops.moe.kernel import moe_experts_triton
    from baton.engine.ops.moe.reference import (
        moe_experts_reference,
        quantize_experts,
        route_sigmoid_grouped,
        route_softmax,
    )

    g = torch.Generator(device=device).manual_seed(tokens)
    e, k, h, i = shape.num_experts, shape.top_k, shape.hidden, shape.inter
    w_up = torch.randn(e, (2 if shape.gated else 1) * i, h, generator=g, device=device, dtype=dtype) * h ** -0.5
    w_down = torch.randn(e, h, i, generator=g, device=device, dtype=dtype) * i ** -0.5
    x = torch.randn(tokens, h, generator=g, device=device, dtype=dtype)
    logits = torch.randn(tokens, e, generator=g, device=device)
    if shape.gated:
        ids, weights = route_softmax(logits, k, True)
        weights, act = weights.to(dtype), "silu"
    else:
        ids, weights = route_sigmoid_grouped(logits, torch.zeros(e, device=device), 1, 1, k, True, 2.5)
        act = "relu2"
    dense_up = torch.randn((2 if shape.gated else 1) * k * i, h, generator=g, device=device, dtype=dtype) * h ** -0.5
    dense_down = torch.randn(h, k * i, generator=g, device=device, dtype=dtype) * (k * i) ** -0.5
    del g

    def dense():
        y = torch.nn.functional.linear(x, dense_up)
        if shape.gated:
            gate, up = y.chunk(2, dim=-1)
            y = torch.nn.functional.silu(gate) * up
        else:
            y = torch.relu(y).square()
        return torch.nn.functional.linear(y, dense_down)

    loop = lambda: moe_experts_reference(x, w_up, w_down, ids, weights, activation=act, gated=shape.gated)  # noqa: E731
    fused = lambda: moe_experts_triton(x, w_up, w_down, ids, weights, activation=act, gated=shape.gated)  # noqa: E731
    want, got = loop(), fused()
    err = _err(got, want)
    time_ms = _timer(device, iters)
    row = Row(tokens, time_ms(loop), time_ms(fused), time_ms(dense), err)
    if fp8 is None:
        return row
    block = FP8_BLOCK if fp8 == "block" else None
    q_up, s_up = quantize_experts(w_up, block, 2 if shape.gated else 1)
    q_down, s_down = quantize_experts(w_down, block, 1)
    kw = dict(activation=act, gated=shape.gated, w_up_scale=s_up, w_down_scale=s_down, block=block)
    fused8 = lambda: moe_experts_triton(x, q_up, q_down, ids, weights, **kw)  # noqa: E731
    err8 = _err(fused8(), moe_experts_reference(x, q_up, q_down, ids, weights, **kw))
    return replace(row, fp8_ms=time_ms(fused8), fp8_err=err8)


def table(rows: list[Row], shape: Shape, meta: dict) -> str:
    fp8 = meta.get("fp8")
    head = "| T | loop ms | fused ms | dense ms | loop / fused | fused / dense | max err |"
    rule = "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    if fp8:
        head += f" fp8 ({fp8}) ms | fused / fp8 | fp8 err |"
        rule += " ---: | ---: | ---: |"
    lines = [f"## Fused MoE vs per-expert loop vs dense — {meta['device_name']}, commit {meta['commit']}", "",
             f"`{meta['command']}`; {shape.num_experts} experts, top-{shape.top_k}, hidden {shape.hidden}, "
             f"intermediate {shape.inter}, {'gated SiLU' if shape.gated else 'relu2'}, {meta['dtype']}", "", head, rule]
    for r in rows:
        line = (f"| {r.tokens} | {r.loop_ms:.3f} | {r.fused_ms:.3f} | {r.dense_ms:.3f} | "
                f"{r.loop_ms / r.fused_ms:.2f}× | {r.fused_ms / r.dense_ms:.2f}× | {r.max_err:.1e} |")
        if fp8:
            line += f" {r.fp8_ms:.3f} | {r.fused_ms / r.fp8_ms:.2f}× | {r.fp8_err:.1e} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    ap.add_argument("--shape", choices=("nano", "qwen-next"), default="nano")
    ap.add_argument("--tokens", default=None, help="token counts, comma-separated (default 1,32,256,8192)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 20; smoke 1)")
    ap.add_argument("--fp8", choices=FP8_CHOICES, default=None,
                    help="also time the fused path on FP8 experts (per-expert or 128 x 128 block scales)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        tokens = tuple(int(t) for t in (args.tokens or ("1,5" if args.smoke else "1,32,256,8192")).split(","))
    except ValueError:
        raise SystemExit(f"--tokens: expected comma-separated integers, got {args.tokens!r}") from None
    if not tokens or min(tokens) < 1:
        raise SystemExit(f"--tokens: expected integers >= 1, got {args.tokens!r}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, shape = torch.device("cpu"), torch.float32, SHAPES["smoke"]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("moe_bench: expected a CUDA device (or --smoke)")
        device, dtype, shape = torch.device("cuda"), torch.bfloat16, SHAPES[args.shape]
    if args.iters is not None and args.iters < 1:
        raise SystemExit(f"--iters: expected an integer >= 1, got {args.iters}")
    iters = args.iters or (1 if args.smoke else 20)
    rows = []
    for t in tokens:
        rows.append(bench(shape, t, device, dtype, iters, args.fp8))
        r = rows[-1]
        fp8 = f", fp8 {r.fp8_ms:.3f}" if args.fp8 else ""
        print(f"T={t}: loop {r.loop_ms:.3f} ms, fused {r.fused_ms:.3f}, dense {r.dense_ms:.3f}{fp8}", file=sys.stderr)
    command = " ".join(["python benchmarks/moe_bench.py", *(sys.argv[1:] if argv is None else argv)])
    meta = {"device_name": device_name(device), "commit": git_commit(), "command": command,
            "dtype": str(dtype).removeprefix("torch."), "shape": asdict(shape), "fp8": args.fp8}
    print(table(rows, shape, meta))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    bad = [r for r in rows if r.max_err > tol or (r.fp8_err is not None and r.fp8_err > tol)]
    if bad:
        print(f"moe_bench: fused output differs from the loop: {[(r.tokens, r.max_err, r.fp8_err) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
