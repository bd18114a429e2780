"""The fused-MoE kernels on FP8 expert weights (float8_e4m3fn stacks, per-expert or block scales, weight-only)
against the torch reference of `ops.moe`, which dequantizes each expert it runs.

Without CUDA the kernels run in Triton's interpreter on CPU tensors at small shapes (ragged N and K, partial scale
blocks, a gated stack whose segments do not fill their last block); the `gpu` tests run them compiled at
Nemotron-3-Nano's expert shapes (128 experts, top-6, hidden 2688, intermediate 1856) and Qwen3-Next's.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.fp8_linear.reference import FP8_DTYPE  # noqa: E402
from baton.engine.ops.moe.kernel import moe_experts_triton  # noqa: E402
from baton.engine.ops.moe.reference import (  # noqa: E402
    dequantize_experts,
    moe_experts_reference,
    quantize_experts,
    route_sigmoid_grouped,
    route_softmax,
)
from baton.engine.ops.moe.tuning import INTERPRETER, LARGE, SMALL  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E, HIDDEN = 8, 48
# (atol, rtol) per activation dtype: fp32 differs from the reference by the order of the fp32 sums (and, per tensor,
# by the scale applied to the sums instead of each weight); 16-bit also by where the kernel rounds (the activation
# on the fp32 accumulator, the reference's on the linear's rounded output).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
SCALES = [pytest.param(None, id="per-tensor"), pytest.param((16, 16), id="block16"),
          pytest.param((32, 32), id="block32"), pytest.param((128, 128), id="block128")]


def _fp8_case(num_experts, hidden, inter, gated, t, top_k, block, dtype, seed, device=DEV):
    """(x, w_up, w_up_scale, w_down, w_down_scale, ids, weights): the stacks quantized as checkpoints store them."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * inter if gated else inter
    # quantized where they run (the model-size stacks are GBs in fp32: the GPU quantizes them in a blink)
    w_up, up_scale = quantize_experts((torch.randn(num_experts, rows, hidden, generator=gen) / hidden ** 0.5).to(device),
                                      block, 2 if gated else 1)
    w_down, down_scale = quantize_experts(
        (torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5).to(device), block, 1)
    x = torch.randn(t, hidden, generator=gen).to(device, dtype)
    logits = torch.randn(t, num_experts, generator=gen).to(device)
    if gated:
        ids, weights = route_softmax(logits, top_k, True)
        weights = weights.to(dtype)  # as the Qwen layer passes them
    else:
        ids, weights = route_sigmoid_grouped(logits, torch.zeros(num_experts, device=device), 1, 1, top_k, True, 2.5)
    return x, w_up, up_scale, w_down, down_scale, ids, weights


def _both(x, w_up, up_scale, w_down, down_scale, ids, weights, gated, block, tiles=INTERPRETER) -> tuple[Tensor, Tensor]:
    kw = dict(activation="silu" if gated else "relu2", gated=gated, w_up_scale=up_scale, w_down_scale=down_scale,
              block=block)
    return (moe_experts_triton(x, w_up, w_down, ids, weights, tiles=tiles, **kw),
            moe_experts_reference(x, w_up, w_down, ids, weights, **kw))


CASES = [  # (tokens, top_k, inter, gated, dtype)
    (1, 2, 16, False, torch.float32),
    (17, 3, 40, False, torch.float32),   # N and K past one tile, ragged
    (3, 2, 24, True, torch.float32),     # gated: each segment's last block partial
    (17, 3, 32, True, torch.float32),
    (17, 3, 40, False, torch.bfloat16),
    (17, 2, 24, True, torch.bfloat16),
    (5, 2, 32, True, torch.float16),
]


@pytest.mark.parametrize("block", SCALES)
@pytest.mark.parametrize(("t", "top_k", "inter", "gated", "dtype"), CASES)
def test_fp8_experts_match_the_reference(t, top_k, inter, gated, dtype, block):
    x, w_up, up_s, w_down, down_s, ids, weights = _fp8_case(E, HIDDEN, inter, gated, t, top_k, block, dtype,
                                                            t + 10 * inter)
    assert w_up.dtype == FP8_DTYPE and w_down.dtype == FP8_DTYPE
    got, want = _both(x, w_up, up_s, w_down, down_s, ids, weights, gated, block)
    atol, rtol = TOL[dtype]
    assert got.dtype == dtype and got.shape == (t, HIDDEN)
    torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=rtol)


@pytest.mark.parametrize("block", SCALES)
@pytest.mark.parametrize("gated", [False, True], ids=["relu2", "gated-silu"])
def test_the_reference_is_the_dequantized_stacks(block, gated):
    """The reference on FP8 stacks is exactly the reference on the stacks dequantized (each segment with its own
    scales), so a model loading FP8 experts computes what the dequantized checkpoint's model does."""
    x, w_up, up_s, w_down, down_s, ids, weights = _fp8_case(E, HIDDEN, 24, gated, 9, 2, block, torch.float32, 4)
    kw = dict(activation="silu" if gated else "relu2", gated=gated)
    got = moe_experts_reference(x, w_up, w_down, ids, weights, w_up_scale=up_s, w_down_scale=down_s, block=block,
                                **kw)
    want = moe_experts_reference(x, dequantize_experts(w_up, up_s, block, 2 if gated else 1),
                                 dequantize_experts(w_down, down_s, block, 1), ids, weights, **kw)
    assert torch.equal(got, want)


def test_gated_segments_keep_their_own_scales():
    """A gated stack's gate and up rows carry scales far apart: reading the up rows with the gate's scales (or one
    scale grid over both) would be off by that factor."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(E, 48, HIDDEN, generator=gen)
    w[:, 24:] *= 50.0  # the up rows
    for block, parts_shape in ((None, (E, 2)), ((16, 16), (E, 4, 3))):
        q, s = quantize_experts(w, block, 2)
        assert s.shape == parts_shape
        torch.testing.assert_close(dequantize_experts(q, s, block, 2), w, atol=0.07 * 50, rtol=0.07)
        x, _, _, w_down, down_s, ids, weights = _fp8_case(E, HIDDEN, 24, True, 5, 2, block, torch.float32, 5)
        got, want = _both(x, q.to(DEV), s.to(DEV), w_down, down_s, ids, weights, True, block)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_fp8_arguments_are_refused_naming_what_is_wrong():
    x, w_up, up_s, w_down, down_s, ids, weights = _fp8_case(E, HIDDEN, 16, False, 3, 2, (16, 16), torch.float32, 0)
    with pytest.raises(ValueError, match=r"w_up_scale expected with \(and only with\) a torch.float8_e4m3fn w_up"):
        moe_experts_triton(x, w_up, w_down, ids, weights, w_down_scale=down_s, block=(16, 16))
    with pytest.raises(ValueError, match=r"w_down_scale expected shape \(8, 3, 1\) for w_down \(8, 48, 16\) and "
                                         r"block \(16, 16\), got \(8, 2, 1\)"):
        moe_experts_reference(x, w_up, w_down, ids, weights, w_up_scale=up_s, w_down_scale=down_s[:, :2],
                              block=(16, 16))
    with pytest.raises(ValueError, match=r"w_up_scale expected shape \(8,\)"):
        moe_experts_triton(x, w_up, w_down, ids, weights, w_up_scale=up_s, w_down_scale=down_s)  # block scales
    with pytest.raises(ValueError, match="block expected None without FP8 weights"):
        moe_experts_reference(x, w_up.float(), w_down.float(), ids, weights, block=(16, 16))
    _, w_up8, up8, w_down8, down8, _, _ = _fp8_case(E, HIDDEN, 16, False, 3, 2, (16, 8), torch.float32, 0)
    with pytest.raises(ValueError, match=r"block expected a K size divisible by 16 .*, got \(16, 8\)"):
        moe_experts_triton(x, w_up8, w_down8, ids, weights, w_up_scale=up8, w_down_scale=down8, block=(16, 8))


# --- compiled, at model sizes ---------------------------------------------------------------------------------------

# Nemotron-3-Nano-30B-A3B's experts (relu2) and Qwen3-Next-80B-A3B's (gated SiLU).
NANO = dict(num_experts=128, top_k=6, hidden=2688, inter=1856, gated=False)
QWEN_NEXT = dict(num_experts=512, top_k=10, hidden=2048, inter=512, gated=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-tensor", "block128"])
@pytest.mark.parametrize("shape", [NANO, QWEN_NEXT], ids=["nano", "qwen-next"])
@pytest.mark.parametrize("t", [1, 7, 64, 300, 2048])
def test_model_sizes_match_the_reference(shape, t, block):
    args = _fp8_case(shape["num_experts"], shape["hidden"], shape["inter"], shape["gated"], t, shape["top_k"], block,
                     torch.bfloat16, t)
    got, want = _both(*args, shape["gated"], block, tiles=None)
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-tensor", "block128"])
@pytest.mark.parametrize("tiles", [SMALL, LARGE], ids=["small", "large"])
def test_both_tilings_compile_and_match(tiles, block):
    args = _fp8_case(NANO["num_experts"], NANO["hidden"], NANO["inter"], False, 256, NANO["top_k"], block,
                     torch.bfloat16, 1)
    got, want = _both(*args, False, block, tiles=tiles)
    torch.testing.assert_close(got, want, atol=3e-2 * want.abs().max().item(), rtol=3e-2)
