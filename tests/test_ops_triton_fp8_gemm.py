"""The block-wise FP8 GEMM path (`ops.fp8_linear.kernel.fp8_linear_blockwise`): its one-launch activation
quantization against `reference.quantize_activation`, and the block-scaled fp8 x fp8 GEMM against the dequantizing
reference with the same activation rounding, for the tuning table's tiles and others. Without CUDA the kernels run
under TRITON_INTERPRET=1 on CPU tensors at small shapes; tests/test_fp8_linear.py runs the GPU sizes."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter

from baton.engine.ops.fp8_linear.kernel import fp8_linear_blockwise  # noqa: E402
from baton.engine.ops.fp8_linear.kernel_act_quant import quantize_activation_triton  # noqa: E402
from baton.engine.ops.fp8_linear.reference import (  # noqa: E402
    fp8_linear_reference,
    quantize_activation,
    quantize_blockwise,
)
from baton.engine.ops.fp8_linear.tuning import GEMM_TILES, SWEEP, Fp8GemmTiles, gemm_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [32, 128])
def test_activation_quantization_equals_the_reference(group, dtype):
    x = make((7, 2 * 300), dtype, 1, 3.0)[:, :300]  # strided rows, a partial last group
    x[2] *= 1000
    x[4, :group] = 0  # an all-zero group: the tiny scale, zeros
    q, s = quantize_activation_triton(x, group)
    q_ref, s_ref = quantize_activation(x, None, group)
    assert s.shape == s_ref.shape == (7, -(-300 // group)) and s.stride() == (1, 7)  # group-major storage
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


def test_activation_quantization_refuses_bad_input():
    with pytest.raises(ValueError, match="group expected a power of two, got 96"):
        quantize_activation_triton(make((2, 192), torch.bfloat16, 0), 96)
    with pytest.raises(ValueError, match="expected x \\[M, K\\]"):
        quantize_activation_triton(make(192, torch.bfloat16, 0), 128)
    q, s = quantize_activation_triton(make((0, 192), torch.bfloat16, 0), 128)
    assert q.shape == (0, 192) and s.shape == (0, 2)


SMALL_TILES = [
    pytest.param(None, id="table"),
    pytest.param(Fp8GemmTiles(16, 32, 32, 4, 2, group_m=2), id="grouped-halfblock-k"),
    pytest.param(Fp8GemmTiles(32, 16, 64, 4, 3), id="narrow-n"),
]


@pytest.mark.parametrize("tiles", SMALL_TILES)
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("block", [(64, 64), (32, 64)])
def test_block_gemm_matches_the_reference_with_the_same_activation_rounding(block, m, tiles):
    n, k = 100, 200  # ragged N and K: partial scale blocks on both axes
    q, s = quantize_blockwise(make((n, k), torch.float32, 2, k ** -0.5), block)
    x = make((m, k), torch.bfloat16, 3, 2.0)
    bias = make(n, torch.bfloat16, 4)
    got = fp8_linear_blockwise(x, q, s, block, bias, tiles=tiles)
    ref = fp8_linear_reference(x.float(), q, s, block, bias.float(), act_quant=True)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 sums in another order, one bf16 rounding of the output
    assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_block_gemm_leading_dims_empty_rows_and_bad_tiles():
    q, s = quantize_blockwise(make((64, 128), torch.float32, 2, 0.1), (64, 64))
    x = make((2, 3, 128), torch.bfloat16, 3)
    got = fp8_linear_blockwise(x, q, s, (64, 64))
    assert got.shape == (2, 3, 64)
    assert torch.equal(got, fp8_linear_blockwise(x.reshape(6, 128), q, s, (64, 64)).reshape(2, 3, 64))
    assert fp8_linear_blockwise(x[:0], q, s, (64, 64)).shape == (0, 3, 64)
    with pytest.raises(ValueError, match="block_k expected a divisor of the weight block's width 64, got 128"):
        fp8_linear_blockwise(x, q, s, (64, 64), tiles=Fp8GemmTiles(16, 16, 128, 4, 2))


def test_tuning_table_covers_every_row_count_and_tiles_are_validated():
    rows = [r for r, _, _ in GEMM_TILES]
    assert rows == sorted(rows) and all(why for _, _, why in GEMM_TILES)
    assert gemm_tiles(1) == GEMM_TILES[0][1] and gemm_tiles(1 << 20) == GEMM_TILES[-1][1]
    assert all(128 % t.block_k == 0 for t in (*SWEEP, *(t for _, t, _ in GEMM_TILES)))
    with pytest.raises(ValueError, match="block_n expected a power of two >= 16, got 96"):
        Fp8GemmTiles(64, 96, 128, 4, 3)
    with pytest.raises(ValueError, match="num_warps in 1..16"):
        Fp8GemmTiles(64, 64, 128, 3, 3)


def test_block_width_not_a_power_of_two_quantizes_by_torch_and_steps_k_by_its_divisor():
    block = (32, 48)  # K steps of 16 (the largest power-of-two divisor); activations by the torch quantizer
    q, s = quantize_blockwise(make((50, 100), torch.float32, 2, 0.1), block)
    x = make((5, 100), torch.bfloat16, 3)
    got = fp8_linear_blockwise(x, q, s, block)
    ref = fp8_linear_reference(x.float(), q, s, block, act_quant=True)
    assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
