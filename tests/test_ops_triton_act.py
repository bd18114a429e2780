"""Triton relu2 (`ops.act.kernel`) against torch's relu(x).square(): bit for bit in every float dtype.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; the `gpu` test runs it compiled at an
8b-like MLP's width.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.layers.mlp import MLP  # noqa: E402
from baton.engine.ops.act.kernel import BLOCK, relu2_triton  # noqa: E402
from baton.engine.ops.act.reference import relu2_reference  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(shape, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1,), (3, 5), (7, 300), (2, BLOCK + 1), (0, 8)])
def test_relu2_equals_torch_bit_for_bit(dtype, shape):
    x = make(shape, dtype, seed=sum(shape))
    y = relu2_triton(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, relu2_reference(x))


def test_relu2_nan_inf_signed_zero_and_strided_input():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -2.5, 3.0], device=DEVICE)
    y = relu2_triton(x)
    assert torch.equal(y.isnan(), torch.tensor([True, False, False, False, False, False, False], device=DEVICE))
    assert torch.equal(y[1:], relu2_reference(x)[1:])
    wide = make((4, 64), torch.bfloat16, seed=1)
    assert torch.equal(relu2_triton(wide[:, ::2]), relu2_reference(wide[:, ::2]))  # made contiguous first
    with pytest.raises(TypeError, match="x expected"):
        relu2_triton(torch.ones(3, dtype=torch.int32, device=DEVICE))


def test_mlp_takes_the_kernel_on_the_triton_path():
    m = MLP(16, 48, "relu2", bias=False).to(DEVICE, torch.bfloat16)
    x = make((5, 16), torch.bfloat16, seed=2)
    with torch.no_grad():
        m.kernels = resolve_kernels("torch", x.device)
        ref = m(x)
        assert m.kernels.relu2 is relu2_reference
        m.kernels = resolve_kernels("triton", x.device)
        assert m.kernels.relu2 is relu2_triton
        assert torch.equal(m(x), ref)


@pytest.mark.gpu
def test_gpu_full_width_relu2():
    x = make((256, 21504), torch.bfloat16, seed=3, device="cuda")
    assert torch.equal(relu2_triton(x), relu2_reference(x))
