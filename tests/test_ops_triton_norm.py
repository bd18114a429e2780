"""Triton RMSNorm and gated grouped RMSNorm kernels against the torch modules of `layers.norms`.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors; the `gpu` tests run them compiled at
the full size of a Nemotron-H-8B-like layer. `bench_norms` is a timing helper (µs per call, CUDA events).
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (and of the kernels' module).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.layers.norms import GatedRMSNorm, RMSNorm  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402
from baton.engine.ops.norm.kernel import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5

# The fp32 sum of squares is reduced in another order than torch's (and, on GPU, rsqrt / exp are the
# hardware approximations), so fp32 agrees to a few ulp and a half-precision output may differ by one
# rounding step on a rare element; everything else (casts, rounding points) is the reference's.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 8e-3, id="bf16"),
    pytest.param(torch.float16, 1e-3, 1e-3, id="fp16"),
]
HIDDEN = [1, 8, 64, 100, 384, 1000]
GROUPS = [(64, 1), (64, 4), (96, 2), (96, 3), (200, 8), (1000, 5)]  # (hidden, groups); group sizes 8..1000


def make(shape, dtype, seed, scale=3.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def rms_module(hidden, dtype, seed=10, device=DEVICE):
    m = RMSNorm(hidden, EPS).to(device)
    with torch.no_grad():
        m.weight.copy_(make(hidden, torch.float32, seed, scale=1.0, device=device))
    return m.to(dtype)


def gated_module(hidden, groups, dtype, seed=11, device=DEVICE):
    m = GatedRMSNorm(hidden, hidden // groups, EPS).to(device)
    with torch.no_grad():
        m.weight.copy_(make(hidden, torch.float32, seed, scale=1.0, device=device))
    return m.to(dtype)


def run_module(module, monkeypatch, mode, *args):
    getattr(module, "__self__", module).kernels = resolve_kernels(mode, args[0].device)  # a module or its method
    with torch.no_grad():
        return module(*args)


def assert_close(actual, expected, atol, rtol):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --------------------------------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_matches_module(dtype, atol, rtol, hidden, monkeypatch):
    m = rms_module(hidden, dtype)
    x = make((5, hidden), dtype, seed=hidden)
    ref = run_module(m, monkeypatch, "torch", x)
    got = run_module(m, monkeypatch, "triton", x)
    assert_close(got, ref, atol, rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_rms_norm_leading_shapes_and_strided_rows(dtype, atol, rtol, monkeypatch):
    m = rms_module(48, dtype)
    x3 = make((2, 3, 48), dtype, seed=1)
    assert_close(run_module(m, monkeypatch, "triton", x3), run_module(m, monkeypatch, "torch", x3), atol, rtol)
    wide = make((6, 100), dtype, seed=2)
    xs = wide[:, 20:68]  # row stride 100: no copy
    assert_close(run_module(m, monkeypatch, "triton", xs), run_module(m, monkeypatch, "torch", xs), atol, rtol)
    xt = make((48, 4), dtype, seed=3).t()  # column stride 4: made contiguous
    assert_close(run_module(m, monkeypatch, "triton", xt), run_module(m, monkeypatch, "torch", xt), atol, rtol)


def test_rms_norm_weight_dtype_differs_from_input():
    w = make(64, torch.float32, 5, scale=1.0)
    x = make((4, 64), torch.bfloat16, 6)
    from baton.engine.ops.norm.reference import rms_norm_reference
    ref = rms_norm_reference(x, w, EPS)
    got = rms_norm_triton(x, w, EPS)
    assert_close(got, ref, 1e-2, 8e-3)


def test_rms_norm_many_rows_and_empty():
    w = make(40, torch.bfloat16, 5, scale=1.0)
    x = make((300, 40), torch.bfloat16, 7)  # several programs, a partial last row block
    from baton.engine.ops.norm.reference import rms_norm_reference
    assert_close(rms_norm_triton(x, w, EPS), rms_norm_reference(x, w, EPS), 1e-2, 8e-3)
    empty = torch.empty((0, 40), dtype=torch.bfloat16, device=DEVICE)
    out = rms_norm_triton(empty, w, EPS)
    assert out.shape == (0, 40) and out.dtype == torch.bfloat16
    assert rms_norm_triton(torch.empty((2, 0, 40), device=DEVICE), w.float(), EPS).shape == (2, 0, 40)


def test_rms_norm_bf16_rounds_to_nearest_even():
    """Values whose fp32 result sits just above a bf16 halfway point must round up, as torch's `.to()` does
    (the interpreter's own cast truncates)."""
    x = torch.full((1, 4), 1.0, device=DEVICE)
    w = torch.tensor([1.0 + 2 ** -8 + 2 ** -20, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8 + 2 ** -20)],
                     device=DEVICE)
    from baton.engine.ops.norm.reference import rms_norm_reference
    x16 = x.to(torch.bfloat16)
    # eps = 0 keeps the scale exactly 1 so the weight's low bits decide the rounding.
    assert torch.equal(rms_norm_triton(x16, w, 0.0), rms_norm_reference(x16, w, 0.0))


# ------------------------------------------------------------------------------------- residual add + RMSNorm

@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("hidden", [1, 64, 100, 1000])
def test_add_rms_norm_matches_add_then_module(dtype, atol, rtol, hidden, monkeypatch):
    m = rms_module(hidden, dtype)
    x, h = make((7, hidden), dtype, seed=hidden), make((7, hidden), dtype, seed=hidden + 1)
    with torch.no_grad():
        y, s = run_module(m.add_forward, monkeypatch, "triton", x, h)
        ref_s = h + x
        ref_y = run_module(m, monkeypatch, "torch", ref_s)
    assert torch.equal(s, ref_s)  # the residual stream is torch's add, bit for bit
    assert_close(y, ref_y, atol, rtol)
    ry, rs = run_module(m.add_forward, monkeypatch, "torch", x, h)  # the reference path is the same composition
    assert torch.equal(rs, ref_s) and torch.equal(ry, ref_y)


def test_add_rms_norm_strided_rows_empty_and_errors():
    m = rms_module(64, torch.bfloat16)
    wide = make((5, 96), torch.bfloat16, seed=3)
    x, h = wide[:, :64], make((5, 64), torch.bfloat16, seed=4)  # x with a row stride of 96
    y, s = add_rms_norm_triton(x, h, m.weight, EPS)
    assert torch.equal(s, h + x)
    assert torch.equal(y, rms_norm_triton(h + x, m.weight, EPS))  # the same kernel's norm after the add
    y0, s0 = add_rms_norm_triton(x[:0], h[:0], m.weight, EPS)
    assert y0.shape == s0.shape == (0, 64)
    with pytest.raises(ValueError, match="residual: expected"):
        add_rms_norm_triton(x, h.float(), m.weight, EPS)
    with pytest.raises(ValueError, match="residual: expected"):
        add_rms_norm_triton(x, h[:4], m.weight, EPS)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm_triton(x, h, m.weight[:32], EPS)


# ---------------------------------------------------------------------------------------------- GatedRMSNorm

@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
@pytest.mark.parametrize("hidden, groups", GROUPS)
def test_gated_rms_norm_matches_module(dtype, atol, rtol, hidden, groups, monkeypatch):
    m = gated_module(hidden, groups, dtype)
    x = make((5, hidden), dtype, seed=hidden)
    gate = make((5, hidden), dtype, seed=hidden + 1)
    ref = run_module(m, monkeypatch, "torch", x, gate)
    got = run_module(m, monkeypatch, "triton", x, gate)
    assert_close(got, ref, atol, rtol)


@pytest.mark.parametrize("dtype, atol, rtol", DTYPES)
def test_gated_rms_norm_strided_gate_from_split(dtype, atol, rtol, monkeypatch):
    """The mixer's gate is a split of in_proj's output (row stride > width); x is a view too."""
    hidden, groups, t = 96, 4, 7
    m = gated_module(hidden, groups, dtype)
    proj = make((t, hidden + 40 + 3), dtype, seed=3)
    gate, _, _ = proj.split([hidden, 40, 3], dim=-1)
    x = make((t, 2 * hidden), dtype, seed=4)[:, hidden:]
    assert gate.stride(0) != hidden and not gate.is_contiguous()
    ref = run_module(m, monkeypatch, "torch", x.contiguous(), gate)
    got = run_module(m, monkeypatch, "triton", x, gate)
    assert_close(got, ref, atol, rtol)


@pytest.mark.parametrize("w_dtype, x_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float16)])
def test_gated_rms_norm_mixed_dtypes_promote_like_torch(w_dtype, x_dtype):
    from baton.engine.ops.norm.reference import gated_rms_norm_reference
    w = make(64, w_dtype, 5, scale=1.0)
    x, gate = make((3, 64), x_dtype, 6), make((3, 64), torch.bfloat16, 7)
    ref = gated_rms_norm_reference(x, gate, w, 16, EPS)
    got = gated_rms_norm_triton(x, gate, w, 16, EPS)
    assert got.dtype == ref.dtype == torch.promote_types(w_dtype, x_dtype)
    assert_close(got, ref, 1e-3 if got.dtype == torch.float32 else 1e-2, 8e-3)


def test_gated_rms_norm_leading_shape_many_rows_and_empty():
    from baton.engine.ops.norm.reference import gated_rms_norm_reference
    w = make(60, torch.bfloat16, 5, scale=1.0)
    x, gate = make((3, 70, 60), torch.bfloat16, 6), make((3, 70, 60), torch.bfloat16, 7)
    assert_close(gated_rms_norm_triton(x, gate, w, 20, EPS), gated_rms_norm_reference(x, gate, w, 20, EPS),
                 1e-2, 8e-3)
    empty = torch.empty((0, 60), dtype=torch.bfloat16, device=DEVICE)
    out = gated_rms_norm_triton(empty, empty, w, 20, EPS)
    assert out.shape == (0, 60) and out.dtype == torch.bfloat16


def test_shape_and_dtype_errors():
    w = torch.ones(64, device=DEVICE)
    x = torch.ones((2, 64), device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(TypeError, match="x"):
        rms_norm_triton(x.to(torch.int32), w, EPS)
    with pytest.raises(ValueError, match="group_size"):
        gated_rms_norm_triton(x, x, w, 48, EPS)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm_triton(x, x[:1], w, 16, EPS)


def test_dispatch_picks_by_mode():
    t = torch.zeros(1)
    kernels = resolve_kernels("triton", t.device)
    assert kernels.rms_norm is rms_norm_triton
    assert kernels.gated_rms_norm is gated_rms_norm_triton
    assert kernels.add_rms_norm is add_rms_norm_triton
    kernels = resolve_kernels("torch", t.device)
    assert kernels.rms_norm.__name__ == "rms_norm_reference"
    assert kernels.gated_rms_norm.__name__ == "gated_rms_norm_reference"
    assert kernels.add_rms_norm.__name__ == "add_rms_norm_reference"
    assert resolve_kernels("auto", t.device).rms_norm.__name__ == "rms_norm_reference"  # CPU tensor


def test_module_parameters_unchanged():
    """Checkpoints load by name: the modules keep exactly one parameter, `weight`."""
    assert [n for n, _ in RMSNorm(8, EPS).named_parameters()] == ["weight"]
    assert [n for n, _ in GatedRMSNorm(8, 4, EPS).named_parameters()] == ["weight"]


# ------------------------------------------------------------------------------------------------ full size

HIDDEN_8B, INTERMEDIATE_8B, GROUPS_8B = 4096, 8192, 8


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_full_size_rms_norm(rows, monkeypatch):
    m = rms_module(HIDDEN_8B, torch.bfloat16, device="cuda")
    x = make((rows, HIDDEN_8B), torch.bfloat16, seed=1, device="cuda")
    assert_close(run_module(m, monkeypatch, "triton", x), run_module(m, monkeypatch, "torch", x), 1e-2, 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_full_size_add_rms_norm(rows, monkeypatch):
    m = rms_module(HIDDEN_8B, torch.bfloat16, device="cuda")
    x, h = (make((rows, HIDDEN_8B), torch.bfloat16, seed=s, device="cuda") for s in (1, 2))
    y, s = run_module(m.add_forward, monkeypatch, "triton", x, h)
    assert torch.equal(s, h + x)
    assert_close(y, run_module(m, monkeypatch, "torch", h + x), 1e-2, 8e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 256])
def test_gpu_full_size_gated_rms_norm(rows, monkeypatch):
    m = gated_module(INTERMEDIATE_8B, GROUPS_8B, torch.bfloat16, device="cuda")
    proj = make((rows, 2 * INTERMEDIATE_8B + 2 * GROUPS_8B * 128 + 128), torch.bfloat16, seed=2, device="cuda")
    gate = proj[:, :INTERMEDIATE_8B]  # strided like the mixer's split of in_proj
    x = make((rows, INTERMEDIATE_8B), torch.bfloat16, seed=3, device="cuda")
    ref = run_module(m, monkeypatch, "torch", x, gate)
    got = run_module(m, monkeypatch, "triton", x, gate)
    assert_close(got, ref, 1e-2, 8e-3)


def bench_norms(rows=1, dtype=torch.bfloat16, hidden=HIDDEN_8B, intermediate=INTERMEDIATE_8B, groups=GROUPS_8B,
                iters=200, warmup=20):
    """µs per call on CUDA of the Triton kernels and of the torch references, at the 8B-like sizes:
    {"rms_norm_triton", "rms_norm_torch", "gated_rms_norm_triton", "gated_rms_norm_torch"} -> µs.
    Back-to-back launches (no CUDA graph), so the torch numbers include one launch per small kernel."""
    from baton.engine.ops.norm.reference import gated_rms_norm_reference, rms_norm_reference
    w = make(hidden, dtype, 1, scale=1.0, device="cuda")
    x = make((rows, hidden), dtype, 2, device="cuda")
    wg = make(intermediate, dtype, 3, scale=1.0, device="cuda")
    y = make((rows, intermediate), dtype, 4, device="cuda")
    gate = make((rows, 2 * intermediate), dtype, 5, device="cuda")[:, :intermediate]
    gs = intermediate // groups
    calls = {
        "rms_norm_triton": lambda: rms_norm_triton(x, w, EPS),
        "rms_norm_torch": lambda: rms_norm_reference(x, w, EPS),
        "gated_rms_norm_triton": lambda: gated_rms_norm_triton(y, gate, wg, gs, EPS),
        "gated_rms_norm_torch": lambda: gated_rms_norm_reference(y, gate, wg, gs, EPS),
    }
    out = {}
    for name, call in calls.items():
        for _ in range(warmup):
            call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            call()
        end.record()
        torch.cuda.synchronize()
        out[name] = start.elapsed_time(end) * 1e3 / iters
    return out


@pytest.mark.gpu
def test_gpu_bench_norms_runs():
    us = bench_norms(iters=5, warmup=2)
    assert set(us) == {"rms_norm_triton", "rms_norm_torch", "gated_rms_norm_triton", "gated_rms_norm_torch"}
    assert all(v > 0 for v in us.values())
