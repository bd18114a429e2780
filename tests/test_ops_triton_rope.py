"""Triton RoPE (`ops.rope.kernel`) against the torch reference `ops.rope.reference.apply_rope`.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; the `gpu` test runs it compiled at
Qwen3.5-27B's attention sizes (24 query heads, 4 KV heads, head_dim 256, a quarter of it rotary, theta 1e7).
The kernel keeps every rounding point of the reference, so only cos / sin may differ (by an ulp, where the
interpreter's numpy or libdevice rounds otherwise than torch's): fp32 agrees to an ulp of an output, and a bf16 /
fp16 output by one rounding step on a rare element; given the reference's own cos / sin, fp32 is bit for bit.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.ops.rope.kernel import apply_rope_triton  # noqa: E402
from baton.engine.ops.rope.reference import apply_rope, rope_inv_freq, token_positions  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# rtol: one rounding step of an output; fp32's atol: an ulp of cos / sin times |x|.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 8e-3, id="bf16"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
]
# On the GPU a 16-bit cos / sin may also round a step apart (libdevice against torch's CUDA cos / sin, expected
# the same function), which moves an output by up to |x| times that step.
GPU_DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-6, id="fp32"),
    pytest.param(torch.bfloat16, 1e-1, 8e-3, id="bf16"),
    pytest.param(torch.float16, 1e-2, 1e-3, id="fp16"),
]
# (head_dim, rotary_dim): Qwen3.5's quarter, full rotary, widths and halves that are not powers of two.
DIMS = [(256, 64), (16, 16), (16, 4), (24, 8), (40, 10), (12, 12)]


def make(shape, dtype, seed, scale=3.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def mixed_positions(device=DEVICE):
    """A prefill row of 5 new tokens after 3 cached, a fresh row of 4, a decode token at 99, one far out (odd T)."""
    lens = [5, 4, 1, 1]
    seq_lens = torch.tensor([8, 4, 100, 262144], device=device)
    qsl = torch.tensor([0] + np.cumsum(lens).tolist(), device=device)
    return token_positions(qsl, seq_lens, sum(lens))


def check(got, want, atol, rtol):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
        if w.dtype != torch.float32:  # 16-bit outputs: a rare element off, the rest bit for bit
            assert (g != w).float().mean().item() <= 1e-3


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("d,rot", DIMS)
def test_rope_matches_reference(dtype, atol, rtol, d, rot):
    positions = mixed_positions()
    t = positions.shape[0]
    assert positions.tolist() == [3, 4, 5, 6, 7, 0, 1, 2, 3, 99, 262143]
    q, k = make((t, 6, d), dtype, seed=d), make((t, 2, d), dtype, seed=d + 1)  # GQA: 6 query heads, 2 KV heads
    inv = rope_inv_freq(1e7, rot, DEVICE)
    q0, k0 = q.clone(), k.clone()
    got = apply_rope_triton(q, k, positions, inv)
    check(got, apply_rope(q, k, positions, inv), atol, rtol)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # out of place, as the reference
    assert torch.equal(got[0][..., rot:], q[..., rot:]) and torch.equal(got[1][..., rot:], k[..., rot:])


@pytest.mark.skipif(DEVICE != "cpu", reason="patches the CPU reference's cos / sin with the interpreter's numpy")
@pytest.mark.parametrize("d,rot", [(256, 64), (40, 10)])
def test_fp32_bit_for_bit_given_the_same_cos_sin(d, rot, monkeypatch):
    """The interpreter's cos / sin are numpy's: with those in the reference too, every rounding point agrees."""
    monkeypatch.setattr(torch.Tensor, "cos", lambda x: torch.from_numpy(np.cos(x.numpy())))
    monkeypatch.setattr(torch.Tensor, "sin", lambda x: torch.from_numpy(np.sin(x.numpy())))
    positions = mixed_positions()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k = make((11, 3, d), dtype, seed=5), make((11, 1, d), dtype, seed=6)
        inv = rope_inv_freq(1e6, rot)
        for g, w in zip(apply_rope_triton(q, k, positions, inv), apply_rope(q, k, positions, inv), strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_strided_views_of_a_fused_projection(dtype, atol, rtol):
    """q as GatedAttention slices it from q_proj's [T, Hq, 2D] (queries then gates), k and v from one fused
    [T, (Hq + 2 Hk) D] output, and a channel-strided view (made contiguous first)."""
    t, hq, hk, d, rot = 7, 4, 2, 32, 8
    qg = make((t, hq, 2 * d), dtype, seed=1)
    q = qg[..., :d]
    fused = make((t, (hq + 2 * hk) * d), dtype, seed=2)
    k = fused[:, hq * d:(hq + hk) * d].view(t, hk, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    positions = torch.tensor([0, 9, 1, 2, 3, 500, 4], device=DEVICE)
    inv = rope_inv_freq(1e4, rot, DEVICE)
    check(apply_rope_triton(q, k, positions, inv), apply_rope(q, k, positions, inv), atol, rtol)
    wide = make((t, hq, 2 * d), dtype, seed=3)[..., ::2]
    check(apply_rope_triton(wide, k, positions, inv), apply_rope(wide, k, positions, inv), atol, rtol)


def test_int32_positions_bf16_inv_freq_and_empty_batch():
    q, k = make((3, 2, 16), torch.bfloat16, seed=7), make((3, 1, 16), torch.bfloat16, seed=8)
    inv = rope_inv_freq(1e4, 8, DEVICE).to(torch.bfloat16)  # a model cast whole keeps its buffer in bf16
    pos = torch.tensor([7, 0, 4096], dtype=torch.int32, device=DEVICE)
    check(apply_rope_triton(q, k, pos, inv), apply_rope(q, k, pos, inv), 1e-2, 8e-3)
    qo, ko = apply_rope_triton(q[:0], k[:0], pos[:0], inv)
    assert qo.shape == (0, 2, 16) and ko.shape == (0, 1, 16)


def test_bad_inputs_raise():
    q, k = make((3, 2, 16), torch.float32, seed=9), make((3, 1, 16), torch.float32, seed=10)
    pos, inv = torch.arange(3, device=DEVICE), rope_inv_freq(1e4, 8, DEVICE)
    with pytest.raises(ValueError, match="expected q"):
        apply_rope_triton(q, k[:2], pos, inv)
    with pytest.raises(TypeError, match="one dtype"):
        apply_rope_triton(q, k.half(), pos, inv)
    with pytest.raises(ValueError, match="positions"):
        apply_rope_triton(q, k, pos.float(), inv)
    with pytest.raises(ValueError, match="positions"):
        apply_rope_triton(q, k, pos[:2], inv)
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope_triton(q, k, pos, rope_inv_freq(1e4, 32, DEVICE))
    with pytest.raises(TypeError, match="inv_freq"):
        apply_rope_triton(q, k, pos, inv.double())


def test_triton_path_takes_the_kernel():
    assert resolve_kernels("triton", DEVICE).rope is apply_rope_triton
    assert resolve_kernels("torch", DEVICE).rope is apply_rope


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
def test_gpu_qwen3_5_27b_sizes(dtype, atol, rtol):
    """A mixed batch of 2,048 prefill tokens and decode tokens far into the context, q sliced from q_proj's
    output as the layer does."""
    hq, hk, d, rot = 24, 4, 256, 64
    lens = [1500, 540] + [1] * 8
    seq_lens = torch.tensor([1500, 4000] + [262144 - 7 * i for i in range(8)], device="cuda")
    qsl = torch.tensor([0] + np.cumsum(lens).tolist(), device="cuda")
    positions = token_positions(qsl, seq_lens, sum(lens))
    t = positions.shape[0]
    q = make((t, hq, 2 * d), dtype, seed=11, device="cuda")[..., :d]
    k = make((t, hk, d), dtype, seed=12, device="cuda")
    inv = rope_inv_freq(1e7, rot, "cuda")
    check(apply_rope_triton(q, k, positions, inv), apply_rope(q, k, positions, inv), atol, rtol)
    graph = torch.cuda.CUDAGraph()  # no host syncs: it captures, and a replay gives the eager result
    apply_rope_triton(q, k, positions, inv)
    with torch.cuda.graph(graph):
        qo, ko = apply_rope_triton(q, k, positions, inv)
    graph.replay()
    want = apply_rope_triton(q, k, positions, inv)
    assert torch.equal(qo, want[0]) and torch.equal(ko, want[1])
