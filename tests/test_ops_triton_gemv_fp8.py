"""The fused-prologue GEMV (`ops.linear.kernel`) on FP8 weights (per-tensor and block-wise scales) against its torch
reference (`ops.linear.reference.fused_linear`: dequantize, round to a's dtype, then the same F.linear).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors at small shapes (ragged N and K, partial
scale blocks); the `gpu` tests run it compiled at the 8b-like layer sizes and inside a CUDA graph.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter

from baton.engine.ops.fp8_linear.reference import quantize_blockwise, quantize_per_tensor  # noqa: E402
from baton.engine.ops.linear.kernel import GemvTiles, fused_linear_triton  # noqa: E402
from baton.engine.ops.linear.reference import PROLOGUES, fused_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The kernel sums in another order than the reference's GEMM; the row kernel also keeps the products of the
# e4m3 values and the block scales in fp32 where the reference rounds the dequantized weight to bf16 first.
TOL = 2e-2
SCALES = [pytest.param(None, id="per-tensor"), pytest.param((128, 128), id="block128"),
          pytest.param((16, 32), id="block16x32")]


def make(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def fp8_args(prologue, m, n, k, block, bias=True, group_size=None):
    a = make((m, k), torch.bfloat16, 1, 2.0)
    q, s = (quantize_per_tensor if block is None else lambda w: quantize_blockwise(w, block))(
        make((n, k), torch.float32, 2, k ** -0.5))
    kw = {"prologue": prologue, "eps": 1e-5, "weight_scale": s, "block": block}
    if prologue == "add_norm":
        kw["residual"] = make((m, k), torch.bfloat16, 3)
    if prologue == "gated_norm":
        kw["gate"] = make((m, k), torch.bfloat16, 4, 2.0)
        kw["group_size"] = group_size or k
    if prologue in ("norm", "add_norm", "gated_norm"):
        kw["norm_weight"] = make(k, torch.bfloat16, 5)
    return a, q, make(n, torch.bfloat16, 6) if bias else None, kw


def check(got, want):
    for x, y in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                    strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        err = (x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-6)
        assert err <= TOL, f"max error {err:.2e} (relative to max |ref|) > {TOL:.0e}"


@pytest.mark.parametrize("block", SCALES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_fp8_prologues_match_the_dequantizing_reference(prologue, m, block):
    a, q, b, kw = fp8_args(prologue, m, 45, 200, block, group_size=40)  # ragged N, K; partial scale blocks
    with torch.no_grad():
        check(fused_linear_triton(a, q, b, **kw), fused_linear(a, q, b, **kw))


ROW_TILES = [  # one row: the persistent kernel, f(a) resident (block_k >= K) or K in steps of block_k
    pytest.param(GemvTiles(1, 4, 256, 4, programs_per_sm=2), id="resident"),
    pytest.param(GemvTiles(1, 8, 64, 4, programs_per_sm=3), id="steps"),
]


@pytest.mark.parametrize("block", SCALES)
@pytest.mark.parametrize("prologue", ["none", "add_norm", "relu2"])
@pytest.mark.parametrize("tiles", ROW_TILES)
def test_fp8_one_row_persistent_kernel(tiles, prologue, block):
    a, q, b, kw = fp8_args(prologue, 1, 37, 200, block)
    with torch.no_grad():
        check(fused_linear_triton(a, q, b, tiles=tiles, **kw), fused_linear(a, q, b, **kw))


@pytest.mark.parametrize("block", SCALES)
def test_fp8_tensor_core_tiles_split_k_and_prologue_apart(block):
    # 2+ rows on the GPU: K tiles wider than a scale block are narrowed to it; K split over programs
    a, q, b, kw = fp8_args("add_norm", 5, 45, 300, block)
    ref = fused_linear(a, q, b, **kw)
    with torch.no_grad():
        for tiles in (GemvTiles(16, 16, 256, 4, prologue_apart=True, split_k=2), GemvTiles(4, 16, 64, 4)):
            check(fused_linear_triton(a, q, b, tiles=tiles, **kw), ref)


def test_fp8_weight_arguments_are_checked():
    a, q, b, kw = fp8_args("none", 2, 32, 64, (16, 32))
    with pytest.raises(ValueError, match="weight_scale expected shape \\(2, 2\\)"):
        fused_linear_triton(a, q, b, weight_scale=kw["weight_scale"][:, :1], block=(16, 32))
    with pytest.raises(ValueError, match="expected weight_scale with \\(and only with\\)"):
        fused_linear(a, q, b)
    with pytest.raises(ValueError, match="block expected a power-of-two width"):
        fused_linear_triton(a, q, b, weight_scale=torch.ones(2, 3, device=DEVICE), block=(16, 24))
    with pytest.raises(ValueError, match="cublas tiles expected a 16-bit weight"):
        fused_linear_triton(a, q, b, weight_scale=kw["weight_scale"], block=(16, 32),
                            tiles=GemvTiles(16, 16, 32, 4, prologue_apart=True, cublas=True))


# ---- GPU: 8b-like layer sizes, compiled, and captured in a CUDA graph ---------------------------------------------

LAYERS_8B = [("add_norm", 18560, 4096), ("none", 4096, 8192), ("add_norm", 21504, 4096), ("relu2", 4096, 21504)]


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("prologue, n, k", LAYERS_8B)
@pytest.mark.parametrize("m", [1, 4, 32])
def test_gpu_fp8_gemv_at_8b_sizes(m, prologue, n, k, block):
    a, q, b, kw = fp8_args(prologue, m, n, k, block, bias=False)
    check(fused_linear_triton(a, q, b, **kw), fused_linear(a, q, b, **kw))


@pytest.mark.gpu
def test_gpu_fp8_gemv_graph_capture():
    a, q, b, kw = fp8_args("add_norm", 1, 18560, 4096, (128, 128))
    y, s = fused_linear_triton(a, q, b, **kw)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_linear_triton(a, q, b, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], y) and torch.equal(out[1], s)
