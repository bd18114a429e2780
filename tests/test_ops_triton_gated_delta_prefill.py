"""The chunk-parallel Gated DeltaNet prefill (`kernel_chunk_wy.py`, through `gated_delta_prefill_varlen_triton`)
against the torch reference: varlen rows around the chunk size, with and without initial states, grouped heads,
Dk != Dv, 16-bit inputs and pools, slots out of order; and the device-built chunk table. Every prefill test runs
both second stages, the fused scan and the split state + output kernels (`tuning.WY_SPLIT_SCAN`), with the solve's
diagonal blocks inverted by substitution, and the fused scan once more with the doubling product
(`tuning.WY_SOLVE_DOUBLING`).

Without CUDA the kernels run in Triton's interpreter (set before the kernel modules are imported, as in
test_ops_triton_gated_delta.py); the `gpu` tests run the compiled kernels at Qwen3.5-27B's sizes.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from baton.engine.ops.gated_delta import kernel_chunk_wy, kernel_prefill  # noqa: E402
from baton.engine.ops.gated_delta.kernel_chunk_prep import _inv_diag  # noqa: E402
from baton.engine.ops.gated_delta.kernel_chunk_wy import _chunk_table_kernel  # noqa: E402
from baton.engine.ops.gated_delta.kernel_prefill import chunked, gated_delta_prefill_varlen_triton  # noqa: E402
from baton.engine.ops.gated_delta.reference import gated_delta_prefill_varlen  # noqa: E402
from tests.test_ops_triton_gated_delta import (  # noqa: E402
    DTYPES,
    FULL,
    FULL_CHUNK,
    assert_same,
    close,
    make_params,
    make_pool,
    make_tokens,
    prefill,
    t64,
)

NUM_SLOTS = 12


@pytest.fixture(params=[(False, False), (True, False), (False, True)],
                ids=["fused-substitution", "split-substitution", "fused-doubling"])
def variant(request, monkeypatch):
    """Runs the test with the fused scan and the split second stage, each with the solve's substitution, then with
    the fused scan and the doubling inversion (the tuned pair)."""
    split, doubling = request.param
    monkeypatch.setattr(kernel_prefill, "WY_SPLIT_SCAN", split)
    monkeypatch.setattr(kernel_chunk_wy, "WY_SOLVE_DOUBLING", doubling)
    return request.param


def run_both(shape: dict, dtype, state_dtype, lengths, slots, has_init, chunk, seed=0, device="cpu",
             num_slots=NUM_SLOTS, params=None):  # fmt: skip
    """(o, o_ref, pool, ref_pool, pool before): the kernel and the reference on the same batch; the slots of rows
    without an initial state hold NaN (never read)."""
    params = params or make_params(shape["Hv"], seed=seed, device=device)
    tok = make_tokens((sum(lengths),), dtype, **shape, seed=seed + 1, device=device)
    pool = make_pool(state_dtype, shape["Hv"], shape["Dk"], shape["Dv"], slots=num_slots, seed=seed + 2,
                     device=device)  # fmt: skip
    for s, init in zip(slots, has_init, strict=True):
        if not init:
            pool[s] = float("nan")
    before, ref_pool = pool.clone(), pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init, chunk)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init, chunk)
    return o, o_ref, pool, ref_pool, before


def check(o, o_ref, pool, ref_pool, before, slots, atol, rtol):
    close(o, o_ref, atol, rtol)
    close(pool[slots], ref_pool[slots], atol, rtol)
    others = [s for s in range(pool.shape[0]) if s not in slots]
    assert_same(pool[others], before[others])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_varlen_rows_around_the_chunk(dtype, state_dtype, atol, rtol, variant):
    """Rows shorter than a chunk, exactly one, one less and one more, several chunks and a partial last one, an
    empty row; grouped heads (Hv = 2 Hk), Dk != Dv, slots out of order, some rows new."""
    C = 16
    shape = dict(Hk=2, Hv=4, Dk=32, Dv=16)
    lengths = [3, C, C - 1, 0, C + 1, 3 * C + 5, 1]
    slots = [9, 2, 11, 0, 5, 3, 7]
    has_init = [True, False, True, True, False, True, False]
    check(*run_both(shape, dtype, state_dtype, lengths, slots, has_init, C), slots, atol, rtol)


@pytest.mark.parametrize("chunk", [32, 64])
def test_larger_chunks(chunk, variant):
    """More diagonal blocks in the UT solve (2 and 4): the block rows below the first one, and the model's chunk."""
    shape = dict(Hk=1, Hv=2, Dk=16, Dv=16)
    lengths = [2 * chunk + 7, chunk, 5]
    slots, has_init = [4, 1, 8], [True, False, True]
    check(*run_both(shape, torch.float32, torch.float32, lengths, slots, has_init, chunk), slots, 2e-5, 1e-4)


def test_odd_head_sizes_and_strided_inputs(variant):
    """Dk and Dv not powers of two and below tl.dot's 16 (masked tiles), three value heads per key head; q, k, v
    views of one wider projection."""
    C = 16
    Hk, Hv, Dk, Dv = 1, 3, 12, 6
    lengths, slots, has_init = [C + 3, 0, 7], [6, 1, 10], [False, True, True]
    T = sum(lengths)
    g = torch.Generator().manual_seed(4)
    proj = torch.randn(T, 2 * Dk + Hv * Dv + 5, generator=g)
    tok = dict(q=proj[:, :Dk].view(T, Hk, Dk), k=proj[:, Dk:2 * Dk].view(T, Hk, Dk),
               v=proj[:, 2 * Dk:2 * Dk + Hv * Dv].view(T, Hv, Dv), a=torch.randn(T, Hv, generator=g),
               b=proj[:, -Hv:])  # fmt: skip
    params = make_params(Hv)
    pool = make_pool(torch.float32, Hv, Dk, Dv)
    ref_pool = pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init, C)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init, C)
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)


def test_strong_decay_and_aligned_keys_stay_finite(variant):
    """Decays that underflow exp within a chunk and keys all nearly one direction (the UT system's worst
    conditioning) still match the reference: no overflow in the masked decays, an accurate solve."""
    C = 16
    shape = dict(Hk=1, Hv=2, Dk=16, Dv=16)
    lengths, slots, has_init = [2 * C + 3, C], [3, 7], [True, True]
    params = dict(A_log=torch.tensor([2.8, 0.0]), dt_bias=torch.tensor([5.0, -4.0]))  # g about -80 and -0.02
    tok = make_tokens((sum(lengths),), torch.float32, **shape, seed=3)
    tok["k"] = torch.ones_like(tok["k"]) + 0.05 * tok["k"]
    tok["b"] = tok["b"].abs() + 3.0  # beta near 1
    pool = make_pool(torch.float32, 2, 16, 16)
    ref_pool = pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init, C)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init, C)
    assert torch.isfinite(o).all() and torch.isfinite(pool).all()
    close(o, o_ref, 1e-4, 1e-4)
    close(pool, ref_pool, 1e-4, 1e-4)


def test_only_empty_rows(variant):
    """A batch of empty rows: each slot keeps its state (initial) or is zeroed (new)."""
    shape = dict(Hk=2, Hv=4, Dk=16, Dv=16)
    slots, has_init = [3, 8], [True, False]
    o, o_ref, pool, ref_pool, before = run_both(shape, torch.float32, torch.float32, [0, 0], slots, has_init, 16)
    assert o.shape == (0, 4, 16)
    assert_same(pool[3], before[3])
    assert (pool[8] == 0).all()
    check(o, o_ref, pool, ref_pool, before, slots, 0.0, 0.0)


@triton.jit
def _inverse_kernel(a_ptr, o_ptr, DOUBLING: tl.constexpr):
    offs = tl.arange(0, 16)
    tile = offs[:, None] * 16 + offs[None, :]
    tl.store(o_ptr + tile, _inv_diag(tl.load(a_ptr + tile), 16, DOUBLING))


@pytest.mark.parametrize("doubling", [False, True], ids=["substitution", "doubling"])
@pytest.mark.parametrize("case", ["random", "aligned"])
def test_diagonal_block_inverse(doubling, case):
    """(I + A)^-1 of a strictly lower 16x16 block, as the UT solve makes them (|A_ij| <= 1), within fp32 rounding of
    float64's inverse: random entries, and the worst conditioning (every entry -1: aligned keys, beta 1, no
    decay), whose inverse has entries up to 2^14."""
    g = torch.Generator().manual_seed(7)
    a = torch.rand(16, 16, generator=g) * 2 - 1 if case == "random" else -torch.ones(16, 16)
    a = torch.tril(a, -1)
    ref = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + a.double())
    out = torch.empty(16, 16)
    _inverse_kernel[(1,)](a, out, DOUBLING=doubling)
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


@pytest.mark.parametrize("lengths", [[0, 40, 16, 0, 1, 17], [1] * 5, [], [100]])
def test_chunk_table(lengths):
    """Each chunk's first token and length, row after row (0 past the batch's chunks), and each row's first chunk."""
    C, R = 16, len(lengths)
    qsl = t64([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])
    n_max = -(-sum(lengths) // C) + R + 3
    starts, lens = torch.full((n_max,), -1, dtype=torch.int32), torch.full((n_max,), -1, dtype=torch.int32)
    first = torch.full((R,), -1, dtype=torch.int32)
    _chunk_table_kernel[(-(-n_max // 8),)](qsl, starts, lens, first, R, n_max, CHUNK=C, BLOCK=8)  # last block partial
    exp_starts, exp_lens, exp_first = [], [], []
    for r, n in enumerate(lengths):
        exp_first.append(len(exp_starts))
        lo = int(qsl[r])
        for c in range(0, n, C):
            exp_starts.append(lo + c)
            exp_lens.append(min(C, n - c))
    assert lens.tolist() == exp_lens + [0] * (n_max - len(exp_starts))
    assert starts[: len(exp_starts)].tolist() == exp_starts
    assert first.tolist() == exp_first


def test_chunked_picks_powers_of_two_up_to_64():
    assert [c for c in (4, 8, 15, 16, 24, 32, 64, 128) if chunked(c)] == [16, 32, 64]


# ---- full size (compiled, on a GPU) -----------------------------------------------------------------

GPU_DTYPES = [
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 2e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 2e-2, id="bf16-bf16state"),
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-3, id="fp32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[8192], [3000, 64, 1, 5000]], ids=["8k", "varlen"])
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
def test_gpu_27b_sizes(dtype, state_dtype, atol, rtol, lengths, variant):
    """Qwen3.5-27B's GDN layer (Hk 16, Hv 48, D 128, chunk 64): a long row and a varlen mix, against the reference."""
    slots = [5, 1, 7, 2][: len(lengths)]
    has_init = [True, False, True, True][: len(lengths)]
    check(*run_both(FULL, dtype, state_dtype, lengths, slots, has_init, FULL_CHUNK, device="cuda"), slots, atol,
          rtol)  # fmt: skip
