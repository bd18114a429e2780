"""The fused-prologue GEMV (`ops.linear.kernel`) against its torch reference (`ops.linear.reference`).

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors at small shapes; the `gpu` tests run it
compiled at the 8b-like layer sizes, for each prologue the layers use.
"""

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.linear.kernel import GemvTiles, default_tiles, fused_linear_triton  # noqa: E402
from baton.engine.ops.linear.reference import PROLOGUES, fused_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5
# f(a) is the separate ops' up to the order of the fp32 sum of squares (one rounding step of a rare 16-bit
# element); the GEMV sums the products in another order than the reference's GEMM. Relative to max |y|.
DTYPES = [
    pytest.param(torch.float32, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, id="bf16"),
    pytest.param(torch.float16, 4e-3, id="fp16"),
]


def make(shape, dtype, seed, scale=1.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(device)


def args_for(prologue, m, n, k, dtype, group_size=None, bias=False, strided=False, device=DEVICE):
    # strided: a, residual and gate are column slices of wider tensors (as the mixer's splits are)
    a = make((m, 2 * k), dtype, 1, 2.0, device)[:, :k] if strided else make((m, k), dtype, 1, 2.0, device)
    w = make((n, k), dtype, 2, k ** -0.5, device)
    kw = {"prologue": prologue, "eps": EPS}
    if prologue == "add_norm":
        kw["residual"] = make((m, 3 * k), dtype, 3, 2.0, device)[:, k:2 * k] if strided else make((m, k), dtype, 3)
    if prologue == "gated_norm":
        kw["gate"] = make((m, 2 * k), dtype, 4, 2.0, device)[:, k:] if strided else make((m, k), dtype, 4, 2.0)
        kw["group_size"] = group_size or k
    if prologue in ("norm", "add_norm", "gated_norm"):
        kw["norm_weight"] = make(k, dtype, 5, 1.0, device)
    b = make(n, dtype, 6, 1.0, device) if bias else None
    return a, w, b, kw


def check(out, ref, tol):
    pairs = list(zip(out, ref, strict=True)) if isinstance(ref, tuple) else [(out, ref)]
    for got, want in pairs:
        assert got.dtype == want.dtype and got.shape == want.shape
        scale = want.float().abs().max().clamp_min(1e-6)
        err = (got.float() - want.float()).abs().max() / scale
        assert err <= tol, f"max error {err:.2e} (relative to max |ref|) > {tol:.0e}"


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("m", [1, 3, 17])
def test_prologues_match_reference(prologue, m, dtype, tol):
    a, w, b, kw = args_for(prologue, m, 40, 96, dtype, group_size=32)
    with torch.no_grad():
        check(fused_linear_triton(a, w, b, **kw), fused_linear(a, w, b, **kw), tol)


@pytest.mark.parametrize("prologue", ["add_norm", "gated_norm", "relu2"])
def test_strided_inputs_bias_and_ragged_tiles(prologue):
    # K not a multiple of BLOCK_K, N not of BLOCK_N, group size not of BLOCK_K; inputs are slices.
    a, w, b, kw = args_for(prologue, 5, 37, 120, torch.bfloat16, group_size=24, bias=True, strided=True)
    ref = fused_linear(a, w, b, **kw)
    for tiles in (GemvTiles(1, 16, 16, 4), GemvTiles(4, 16, 32, 4), GemvTiles(16, 16, 64, 4),
                  GemvTiles(32, 32, 32, 4, 2)):  # the last two: y^T on tensor cores, rows padded
        check(fused_linear_triton(a, w, b, tiles=tiles, **kw), ref, 2e-2)


PERSISTENT = [  # (tiles, N, K, group size): several blocks of N per program; block_k >= K: f(a) held resident
    pytest.param(GemvTiles(1, 8, 16, 4, programs_per_sm=2), 40, 96, 32, id="even"),
    pytest.param(GemvTiles(1, 16, 16, 4, programs_per_sm=3), 37, 120, 24, id="ragged"),  # ragged N, K, groups
    pytest.param(GemvTiles(1, 4, 64, 4, programs_per_sm=64), 12, 48, 16, id="more-programs-than-blocks"),
    pytest.param(GemvTiles(1, 8, 128, 4, programs_per_sm=2), 40, 96, 32, id="resident"),
    pytest.param(GemvTiles(1, 16, 128, 4, programs_per_sm=3), 37, 120, 24, id="resident-ragged"),  # gated: steps
]


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("tiles, n, k, gs", PERSISTENT)
def test_persistent_one_row_kernel_matches_reference(tiles, n, k, gs, prologue, dtype, tol):
    a, w, b, kw = args_for(prologue, 1, n, k, dtype, group_size=gs, bias=True, strided=True)
    with torch.no_grad():
        got = fused_linear_triton(a, w, b, tiles=tiles, **kw)
        check(got, fused_linear(a, w, b, **kw), tol)
        # the same products, norms and roundings as one program per block of N with the tile the persistent kernel
        # takes: all of K (resident), one group (gated_norm), or block_k
        pow2 = gs & (gs - 1) == 0
        resident = tiles.block_k >= k and (prologue != "gated_norm" or pow2)
        block_k = (1 << (k - 1).bit_length() if resident
                   else 1 << (gs - 1).bit_length() if prologue == "gated_norm" else tiles.block_k)
        plain = fused_linear_triton(a, w, b, tiles=GemvTiles(1, tiles.block_n, block_k, 4), **kw)
    # interpreted: bit for bit, but the resident gated norm's groups, added as a tree (compiled, the two kernels'
    # reductions may be laid out apart)
    if DEVICE == "cpu" and not (resident and prologue == "gated_norm"):
        for x, y in zip(got if isinstance(got, tuple) else (got,), plain if isinstance(plain, tuple) else (plain,),
                        strict=True):
            assert torch.equal(x, y)
    else:
        check(got, plain, tol)


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_prologue_apart_is_the_separate_op_then_the_gemm(prologue):
    # 2+ rows on the GPU: the op's own kernel, then the tensor-core GEMM with no prologue (strided inputs, bias)
    a, w, b, kw = args_for(prologue, 5, 37, 120, torch.bfloat16, group_size=24, bias=True, strided=True)
    ref = fused_linear(a, w, b, **kw)
    for cublas in (False, True):  # the GEMM by our kernel or by F.linear
        got = fused_linear_triton(a, w, b, tiles=GemvTiles(16, 16, 64, 4, prologue_apart=True, cublas=cublas), **kw)
        check(got, ref, 2e-2)
        if prologue == "add_norm":  # s is the add, exact
            assert torch.equal(got[1], ref[1])


@pytest.mark.parametrize("m, n, k, split, block_k", [(5, 40, 300, 3, 64), (20, 33, 1000, 2, 128), (3, 64, 200, 8, 32)])
def test_split_k_sums_the_partials_in_split_order(m, n, k, split, block_k):
    """K split over programs (ragged K and rows; 7 tiles over 8 splits: the last one empty): the reference's y,
    the K ranges' products summed in split order, and the tile counters back at zero for the next launch."""
    from baton.engine.ops.linear import kernel as triton_gemv

    a, w, b, _ = args_for("none", m, n, k, torch.float32, bias=True)
    tiles = GemvTiles(16, 32, block_k, 4, 1, split_k=split)
    got = fused_linear_triton(a, w, b, tiles=tiles)
    check(got, fused_linear(a, w, b), 1e-5)
    per = math.ceil(math.ceil(k / block_k) / split) * block_k  # each split's whole tiles of K
    plain = GemvTiles(16, 32, block_k, 4, 1)
    parts = [fused_linear_triton(a[:, lo:lo + per], w[:, lo:lo + per], tiles=plain).double() for lo in range(0, k, per)]
    assert torch.allclose(got.double(), sum(parts) + b.double(), rtol=1e-6, atol=1e-6)
    assert not triton_gemv._COUNTERS[a.device].any()
    assert torch.equal(fused_linear_triton(a, w, b, tiles=tiles), got)  # again: deterministic, counters reused


@pytest.mark.parametrize("prologue, n, k", [("add_norm", 37, 120), ("add_norm", 8300, 72), ("none", 33000, 40),
                                          ("gated_norm", 40, 4200), ("relu2", 33, 4200)])
def test_h200_tiles_for_33_to_64_rows_match_reference_interpreted(prologue, n, k):
    """The H200's tiles for 33-64 rows (one block of 64 rows, some masked; K tiles of 64 for 8192 < N <= 32768,
    128 past that, K split in two past 4096), run by the interpreter on ragged shapes: the reference's y and s."""
    for m in (33, 64):
        tiles = default_tiles(m, n, k, True)
        assert tiles.block_m == 64 and tiles.prologue_apart and not tiles.cublas
        assert tiles.split_k == (2 if k > 4096 else 1) and tiles.block_k == (64 if 8192 < n <= 32768 else 128)
        a, w, b, kw = args_for(prologue, m, n, k, torch.bfloat16, group_size=k // 4, bias=True, strided=True)
        with torch.no_grad():
            check(fused_linear_triton(a, w, b, tiles=tiles, **kw), fused_linear(a, w, b, **kw), 2e-2)


def test_split_k_takes_the_tensor_core_path_without_a_prologue():
    a, w, _, kw = args_for("relu2", 16, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="split_k > 1 expected block_m >= 16 and no prologue, got split_k 2"):
        fused_linear_triton(a, w, tiles=GemvTiles(16, 32, 32, 4, split_k=2), **kw)
    with pytest.raises(ValueError, match="block_m 4"):
        fused_linear_triton(a, w, tiles=GemvTiles(4, 32, 32, 4, split_k=2))


def test_persistent_tiles_take_one_row_only():
    a, w, _, _ = args_for("none", 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="programs_per_sm > 0 expected one row, got 2 rows"):
        fused_linear_triton(a, w, tiles=GemvTiles(1, 4, 16, 4, programs_per_sm=1))


def test_add_norm_residual_is_exact_and_written_once_per_row():
    a, w, _, kw = args_for("add_norm", 6, 70, 64, torch.bfloat16)
    y, s = fused_linear_triton(a, w, tiles=GemvTiles(1, 16, 32, 4), **kw)  # 5 blocks of N: one stores s
    assert torch.equal(s, kw["residual"] + a)  # torch's add, bit for bit


def test_relu2_is_the_separate_op_bit_for_bit_and_norm_within_one_rounding():
    # With an identity weight the GEMV returns f(a) itself: relu2 bit for bit; the norm, rounded once where the
    # separate op rounds twice, within one rounding step.
    from baton.engine.ops.act.reference import relu2_reference
    from baton.engine.ops.norm.reference import rms_norm_reference
    k = 64
    a, _, _, kw = args_for("norm", 3, 1, k, torch.bfloat16)
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(fused_linear_triton(a, eye, prologue="relu2"), relu2_reference(a))
    got = fused_linear_triton(a, eye, **kw)
    want = rms_norm_reference(a, kw["norm_weight"], EPS)
    assert (got.float() - want.float()).abs().le(want.float().abs() * 2 ** -7).all()  # one rounding step at most


def test_empty_and_bad_arguments():
    a, w, _, kw = args_for("add_norm", 0, 8, 16, torch.float32)
    y, s = fused_linear_triton(a, w, **kw)
    assert y.shape == (0, 8) and s.shape == (0, 16)
    a, w, _, _ = args_for("none", 2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="prologue expected one of"):
        fused_linear_triton(a, w, prologue="gelu")
    with pytest.raises(ValueError, match=r"weight \[N, K\], got \(2, 16\) and \(8, 15\)"):
        fused_linear_triton(a, w[:, :15])
    with pytest.raises(ValueError, match="expected residual given, got None"):
        fused_linear_triton(a, w, prologue="add_norm", norm_weight=torch.ones(16))
    with pytest.raises(ValueError, match="expected gate None"):
        fused_linear_triton(a, w, gate=a)
    with pytest.raises(ValueError, match="group_size expected a positive divisor of K = 16, got 5"):
        fused_linear_triton(a, w, prologue="gated_norm", gate=a, norm_weight=torch.ones(16), group_size=5)
    with pytest.raises(ValueError, match=r"bias expected shape \(8,\), got \(7,\)"):
        fused_linear_triton(a, w, torch.ones(7))
    with pytest.raises(ValueError, match="one dtype"):
        fused_linear_triton(a, w.double())


def test_default_tiles_depend_on_m_only_through_block_m():
    for n, k in ((4096, 8192), (18560, 4096), (4096, 21504)):
        # 2-64 rows: one block of rows, at least 16 (the tensor cores' short side)
        assert {default_tiles(m, n, k, True).block_m for m in (1, 2, 3, 4, 5, 16, 17, 64, 256)} == {1, 16, 32, 64}
        assert all(default_tiles(m, n, k, True).block_m >= m for m in range(2, 65))
        assert default_tiles(1, n, k, True) == default_tiles(1, 7, k, True)
        assert default_tiles(1, n, k, True).programs_per_sm > 0  # one row: persistent on the GPU
        assert (default_tiles(1, n, k, True).block_k >= k) == (k <= 8192)  # f(a) held resident up to 8192
        assert all(default_tiles(m, n, k, True).programs_per_sm == 0 for m in (2, 16, 64))
        assert all(default_tiles(m, n, k, True).prologue_apart for m in (2, 16, 64))  # measured: faster apart
        # our kernel at every size (never cuBLAS); K split in two past 8192 up to 32 rows, past 4096 at 33-64
        assert not any(default_tiles(m, n, k, True).cublas for m in (2, 16, 32, 33, 48, 64))
        assert all(default_tiles(m, n, k, True).split_k == (2 if k > 8192 else 1) for m in (2, 16, 32))
        assert all(default_tiles(m, n, k, True).split_k == (2 if k > 4096 else 1) for m in (33, 48, 64))
        for m in (16, 48):  # 4-byte inputs: a K tile of half the length, the same bytes per pipeline stage
            if k > 4096 or m > 32:
                assert default_tiles(m, n, k, True, 4).block_k * 2 == default_tiles(m, n, k, True).block_k
        assert not default_tiles(1, n, k, True).prologue_apart and not default_tiles(5, n, k, False).prologue_apart


# ---- full size on the GPU: the 8b-like layers' linear shapes at decode batch sizes --------------------------

SHAPES_8B = [  # (prologue, N, K, group size): in_proj, qkv, up (after add+norm), out_proj, down
    ("add_norm", 18560, 4096, None), ("add_norm", 6144, 4096, None), ("add_norm", 21504, 4096, None),
    ("gated_norm", 4096, 8192, 1024), ("relu2", 4096, 21504, None), ("norm", 18560, 4096, None),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 32, 48])
@pytest.mark.parametrize("prologue, n, k, gs", SHAPES_8B)
def test_gpu_8b_like_shapes(prologue, n, k, gs, m):
    a, w, _, kw = args_for(prologue, m, n, k, torch.bfloat16, group_size=gs, strided=True)
    check(fused_linear_triton(a, w, **kw), fused_linear(a, w, **kw), 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 32])
def test_gpu_fp32_inputs_take_ieee_dots_not_tf32(m):
    # TF32 keeps 10 mantissa bits: ~1e-3 of max |y| at K = 4096, a hundred times this tolerance.
    a, w, _, kw = args_for("add_norm", m, 6144, 4096, torch.float32)
    check(fused_linear_triton(a, w, **kw), fused_linear(a, w, **kw), 1e-5)
