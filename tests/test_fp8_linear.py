"""The FP8 linear op: quantizers, the dequantizing reference, the layer, and (on a GPU with FP8 tensor cores) the
scaled-matmul and Triton block-scaled GEMMs against the reference."""

from __future__ import annotations

import pytest
import torch

from baton.engine.layers.fp8_linear import FP8Linear, fp8_gemm_supported
from baton.engine.ops.fp8_linear.reference import (
    FP8_DTYPE,
    dequantize,
    expand_block_scale,
    fp8_linear_reference,
    quantize_activation,
    quantize_blockwise,
    quantize_per_tensor,
)
from baton.engine.quant_config import FP8_MAX


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5


def test_per_tensor_round_trip_is_within_e4m3_precision():
    w = _w(96, 80)
    q, s = quantize_per_tensor(w)
    assert q.dtype == FP8_DTYPE and s.shape == () and s.dtype == torch.float32
    assert q.float().abs().max() == FP8_MAX  # the largest weight maps to the top of the range
    err = (dequantize(q, s, None) - w).norm() / w.norm()
    assert 0 < err < 0.04  # e4m3: 3 mantissa bits


def test_blockwise_scales_each_block_and_handles_partial_blocks():
    w = _w(200, 130)
    w[:128, :128] *= 100  # one loud block must not cost the others their precision
    q, s = quantize_blockwise(w, (128, 128))
    assert s.shape == (2, 2)
    back = dequantize(q, s, (128, 128))
    for rows, cols in ((slice(0, 128), slice(128, 130)), (slice(128, 200), slice(0, 128))):
        assert ((back - w)[rows, cols].norm() / w[rows, cols].norm()) < 0.04
    assert expand_block_scale(s, (200, 130), (128, 128))[199, 129] == s[1, 1]


def test_activation_quantization_per_token_and_group():
    x = _w(5, 300, 1)
    x[2] *= 1000
    for group in (None, 128):
        xq, xs = quantize_activation(x, None, group)
        assert xs.shape == ((5, 1) if group is None else (5, 3))
        scale = xs if group is None else xs.repeat_interleave(group, 1)[:, :300]
        assert ((xq.float() * scale - x).norm(dim=1) / x.norm(dim=1)).max() < 0.04
    xq, xs = quantize_activation(x, torch.tensor(0.05), None)  # static: clamps what exceeds 448 * 0.05
    assert xs.shape == () and xq.float().abs().max() == FP8_MAX


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_reference_equals_linear_of_the_dequantized_weight(block):
    w = _w(64, 48)
    q, s = quantize_per_tensor(w) if block is None else quantize_blockwise(w, block)
    x, bias = _w(7, 48, 2), torch.randn(64)
    ref = torch.nn.functional.linear(x, dequantize(q, s, block), bias)
    assert torch.equal(fp8_linear_reference(x, q, s, block, bias), ref)
    assert (fp8_linear_reference(x, q, s, block, bias, act_quant=True) - ref).abs().max() < 0.05 * ref.abs().max()


def test_layer_loads_checkpoint_names_and_runs_the_reference_on_cpu():
    w = _w(32, 16)
    q, s = quantize_per_tensor(w)
    layer = FP8Linear(16, 32, bias=False, block=None, static_input=True)
    layer.load_state_dict({"weight": q, "weight_scale": s, "input_scale": torch.tensor(0.01)})
    layer.bind()
    assert not layer.use_kernel and not fp8_gemm_supported(torch.device("cpu"))
    x = _w(3, 16, 3)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize(q, s, None)))
    blk = FP8Linear(300, 200, bias=True, block=(128, 128), static_input=False)
    assert blk.weight_scale_inv.shape == (2, 3) and blk.input_scale is None


# ---- GPU: the FP8 kernels against the reference with the same activation rounding, at 8b-like shapes -------------

def _gpu_or_skip() -> torch.device:
    if not torch.cuda.is_available() or not fp8_gemm_supported(torch.device("cuda")):
        pytest.skip("needs a GPU with FP8 tensor cores (compute capability 8.9+)")
    return torch.device("cuda")


# 8b-like: Mamba in_proj [18560, 4096], out_proj [4096, 8192], MLP up [21504, 4096], down [4096, 21504]
SHAPES_8B = [(18560, 4096), (4096, 8192), (21504, 4096), (4096, 21504)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 1000])
@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("static", [False, True])
def test_gpu_fp8_linear_matches_reference(m, n, k, block, static):
    dev = _gpu_or_skip()
    if static and block is not None:
        pytest.skip("block-wise FP8 has dynamic activation scales only")
    from baton.engine.ops.fp8_linear import kernel

    g = torch.Generator(dev).manual_seed(m + n)
    w = torch.randn(n, k, generator=g, device=dev) / k ** 0.5
    x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
    bias = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    input_scale = (x.float().abs().amax() / FP8_MAX).reshape(()) if static else None
    if block is None:
        q, s = quantize_per_tensor(w)
        got = kernel.fp8_linear_per_tensor(x, q, s, bias, input_scale)
    else:
        q, s = quantize_blockwise(w, block)
        got = kernel.fp8_linear_blockwise(x, q, s, block, bias)
    ref = fp8_linear_reference(x.float(), q, s, block, bias.float(), input_scale, act_quant=True)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 accumulation in a different order and one bf16 rounding of the output
    assert (got.float() - ref).abs().max() <= 2e-2 * ref.abs().max() + 1e-3
    full = torch.nn.functional.linear(x.float(), w, bias.float())  # the unquantized product, for scale
    assert ((got.float() - full).norm() / full.norm()) < 0.06


@pytest.mark.gpu
def test_gpu_layer_picks_the_kernel_and_graph_captures():
    dev = _gpu_or_skip()
    layer = FP8Linear(4096, 8192, bias=False, block=(128, 128), static_input=False).to(dev)
    q, s = quantize_blockwise(torch.randn(8192, 4096, device=dev) / 64, (128, 128))
    layer.load_state_dict({"weight": q, "weight_scale_inv": s})
    layer.bind()
    assert layer.use_kernel
    x = torch.randn(4, 4096, device=dev, dtype=torch.bfloat16)
    y = layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)


def test_gemv_weight_reads_fp8_layers_only_where_their_kernels_run():
    from baton.engine.layers.gemv_weight import gemv_weight
    from baton.engine.ops.kernels import resolve_kernels

    pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
    layer = FP8Linear(64, 32, bias=False, block=(16, 32), static_input=False)
    q, s = quantize_blockwise(_w(32, 64), (16, 32))
    layer.load_state_dict({"weight": q, "weight_scale_inv": s})
    layer.bind()
    reference, triton = resolve_kernels("torch", "cpu"), resolve_kernels("triton", "cpu")
    gw = gemv_weight(layer, reference)  # the CPU path: the reference op dequantizes as the layer does
    assert gw.weight is layer.weight and gw.weight_scale is layer.weight_scale_inv and gw.block == (16, 32)
    assert gemv_weight(layer, triton) is None  # Triton kernels on a device without FP8 tensor cores
    layer.emulate_act_quant = True
    assert gemv_weight(layer, reference) is None  # the GEMV reads 16-bit inputs
    odd = FP8Linear(96, 32, bias=False, block=(16, 48), static_input=False)
    assert gemv_weight(odd, reference) is None  # the kernel's K groups are powers of two
    lin = torch.nn.Linear(4, 3)
    assert gemv_weight(lin, triton).weight is lin.weight and gemv_weight(lin, triton).weight_scale is None
