"""Mamba2 scan ops against a naive fp64 recurrence and HF NemotronH's torch implementation."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import (
    mamba2_chunk_scan,
    mamba2_selective_state_update,
)

from baton.engine.ops.chunk_scan.reference import mamba_chunk_scan_varlen
from baton.engine.ops.ssm_update.reference import selective_state_update

H, P, N = 4, 8, 16
NUM_SLOTS = 10
CHUNK = 8
DT_MIN = 1e-3
# Row lengths around the chunk size: 1, 2, chunk-1, chunk, chunk+1, 3*chunk+5.
LENGTHS = [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5]
SLOTS = [7, 2, 9, 0, 4, 5]
HAS_INIT = [True, False, True, False, True, True]

# (input dtype, state pool dtype, atol, rtol): bf16 rounds the inputs the reference also sees, then
# the output (and a bf16 pool the state) once more.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 1e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2e-2, 1e-2, id="bf16-bf16state"),
]


def make_params(num_groups: int = 2, seed: int = 0):
    """Per-layer parameters like a trained Mamba2 layer: dt spans ~1e-4 .. 1, A in [-16, -1]."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(H, generator=g) * math.log(16.0))  # [H]
    dt0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    # Inverse softplus, so that softplus(dt_bias) = dt0.
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # [H]
    D = torch.randn(H, generator=g)  # [H]
    return dict(A=A, D=D, dt_bias=dt_bias, G=num_groups)


def make_tokens(T: int, num_groups: int, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=g).to(dtype)  # [T, H, P]
    dt = torch.randn(T, H, generator=g).to(dtype)  # [T, H]
    B = torch.randn(T, num_groups, N, generator=g).to(dtype)  # [T, G, N]
    C = torch.randn(T, num_groups, N, generator=g).to(dtype)  # [T, G, N]
    return x, dt, B, C


def make_pool(state_dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_SLOTS, H, P, N, generator=g).to(state_dtype)  # [S, H, P, N]


def qsl(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def naive_scan(x, dt, A, B, C, D, dt_bias, state, dt_min=DT_MIN):
    """Token-by-token fp64 recurrence for one row: h = exp(dt A) h + dt x B^T; y = h C + D x."""
    x, dt, B, C = x.double(), dt.double(), B.double(), C.double()
    heads_per_group = H // B.shape[1]
    B = B.repeat_interleave(heads_per_group, dim=1)  # [L, H, N]
    C = C.repeat_interleave(heads_per_group, dim=1)  # [L, H, N]
    dt = F.softplus(dt + dt_bias.double()).clamp(min=dt_min)  # [L, H]
    h = state.double().clone()  # [H, P, N]
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * A.double())[:, None, None] * h + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]) + D.double()[:, None] * x[t])
    y = torch.stack(ys) if ys else torch.zeros(0, H, P, dtype=torch.float64)
    return y, h


def run_scan(x, dt, B, C, params, lengths, pool, slots, has_init, chunk=CHUNK, dt_min=DT_MIN):
    return mamba_chunk_scan_varlen(
        x, dt, params["A"], B, C, params["D"], params["dt_bias"], qsl(lengths), pool,
        torch.tensor(slots), torch.tensor(has_init), chunk, dt_min,
    )


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("num_groups", [1, 2])
def test_scan_matches_naive_recurrence(dtype, state_dtype, atol, rtol, num_groups):
    params = make_params(num_groups)
    x, dt, B, C = make_tokens(sum(LENGTHS), num_groups, dtype)
    pool = make_pool(state_dtype)
    # A row without initial state must not read its slot: fill those with garbage.
    for slot, init in zip(SLOTS, HAS_INIT, strict=True):
        if not init:
            pool[slot] = float("nan")
    before = pool.clone()

    y = run_scan(x, dt, B, C, params, LENGTHS, pool, SLOTS, HAS_INIT)

    assert y.dtype == dtype and y.shape == x.shape
    bounds = qsl(LENGTHS).tolist()
    for r, (slot, init) in enumerate(zip(SLOTS, HAS_INIT, strict=True)):
        lo, hi = bounds[r], bounds[r + 1]
        h0 = before[slot] if init else torch.zeros(H, P, N)
        y_ref, h_ref = naive_scan(x[lo:hi], dt[lo:hi], params["A"], B[lo:hi], C[lo:hi], params["D"],
                                  params["dt_bias"], h0)
        torch.testing.assert_close(y[lo:hi].double(), y_ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(pool[slot].double(), h_ref, atol=atol, rtol=rtol)
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("chunk,lengths", [(CHUNK, LENGTHS), (64, [63, 64, 65, 197])])
def test_scan_matches_hf_per_row(dtype, state_dtype, atol, rtol, chunk, lengths):
    params = make_params()
    x, dt, B, C = make_tokens(sum(lengths), 2, dtype)
    pool = make_pool(state_dtype)
    slots, has_init = SLOTS[: len(lengths)], HAS_INIT[: len(lengths)]
    before = pool.clone()

    y = run_scan(x, dt, B, C, params, lengths, pool, slots, has_init, chunk=chunk)

    bounds = qsl(lengths).tolist()
    for r, (slot, init) in enumerate(zip(slots, has_init, strict=True)):
        lo, hi = bounds[r], bounds[r + 1]
        y_hf, h_hf = mamba2_chunk_scan(
            x[None, lo:hi].float(), dt[None, lo:hi].float(), params["A"], B[None, lo:hi].float(),
            C[None, lo:hi].float(), chunk, D=params["D"], dt_bias=params["dt_bias"],
            initial_states=before[slot][None].float() if init else None, dt_softplus=True,
            dt_limit=(DT_MIN, float("inf")), return_final_states=True,
        )
        torch.testing.assert_close(y[lo:hi].float(), y_hf[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(pool[slot].float(), h_hf[0], atol=atol, rtol=rtol)


def test_scan_applies_dt_min_clamp():
    params = make_params()
    # softplus(dt + dt_bias) is ~1e-9 here, so every step is the clamped dt_min.
    params["dt_bias"] = torch.full((H,), -20.0)
    x, dt, B, C = make_tokens(CHUNK + 3, 2, torch.float32)
    pool = make_pool(torch.float32)
    y = run_scan(x, dt, B, C, params, [CHUNK + 3], pool, [0], [False], dt_min=0.05)
    y_ref, h_ref = naive_scan(x, dt, params["A"], B, C, params["D"], params["dt_bias"], torch.zeros(H, P, N),
                              dt_min=0.05)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[0].double(), h_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("split", [1, CHUNK - 1, CHUNK, CHUNK + 3, 2 * CHUNK])
def test_chunked_prefill_continuity(dtype, state_dtype, atol, rtol, split):
    """Scanning a sequence in two calls (the second with initial state) equals one call."""
    params = make_params()
    total = 3 * CHUNK + 5
    x, dt, B, C = make_tokens(total + 9, 2, dtype)
    pool_one, pool_two = make_pool(state_dtype), make_pool(state_dtype)

    # One call: the sequence beside another row of 9 tokens.
    y_one = run_scan(x, dt, B, C, params, [total, 9], pool_one, [3, 6], [False, True])

    # Two calls: the sequence's first part beside the other row, then its rest alone.
    first = torch.cat([torch.arange(split), torch.arange(total, total + 9)])
    y_a = run_scan(x[first], dt[first], B[first], C[first], params, [split, 9], pool_two, [3, 6], [False, True])
    rest = torch.arange(split, total)
    y_b = run_scan(x[rest], dt[rest], B[rest], C[rest], params, [total - split], pool_two, [3], [True])

    torch.testing.assert_close(y_a[:split], y_one[:split], atol=atol, rtol=rtol)
    torch.testing.assert_close(y_b, y_one[split:total], atol=atol, rtol=rtol)
    torch.testing.assert_close(pool_two, pool_one, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_update_matches_naive_step_and_untouched_slots(dtype, state_dtype, atol, rtol):
    params = make_params()
    x, dt, B, C = make_tokens(4, 2, dtype)
    pool = make_pool(state_dtype)
    before = pool.clone()
    slots = [8, 1, 5, 3]

    y = selective_state_update(pool, x, dt, params["A"], B, C, params["D"], params["dt_bias"],
                               torch.tensor(slots), DT_MIN)

    assert y.dtype == dtype and y.shape == x.shape
    for b, slot in enumerate(slots):
        y_ref, h_ref = naive_scan(x[b:b + 1], dt[b:b + 1], params["A"], B[b:b + 1], C[b:b + 1], params["D"],
                                  params["dt_bias"], before[slot])
        torch.testing.assert_close(y[b].double(), y_ref[0], atol=atol, rtol=rtol)
        torch.testing.assert_close(pool[slot].double(), h_ref, atol=atol, rtol=rtol)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_update_matches_hf_without_clamp(dtype, state_dtype, atol, rtol):
    """HF's recurrent step has no dt_min clamp; with dt_min = 0 the two agree."""
    params = make_params()
    x, dt, B, C = make_tokens(3, 2, dtype)
    pool = make_pool(state_dtype)
    slots = torch.tensor([4, 0, 9])
    hf_state = pool[slots].float()

    y = selective_state_update(pool, x, dt, params["A"], B, C, params["D"], params["dt_bias"], slots, 0.0)

    # HF's mixer passes the per-head parameters expanded over head_dim and state.
    y_hf = mamba2_selective_state_update(
        hf_state, x.float(), dt.float()[:, :, None].expand(-1, -1, P),
        params["A"][:, None, None].expand(-1, P, N), B.float(), C.float(),
        params["D"][:, None].expand(-1, P), dt_bias=params["dt_bias"][:, None].expand(-1, P), dt_softplus=True,
    )
    torch.testing.assert_close(y.float(), y_hf, atol=atol, rtol=rtol)
    torch.testing.assert_close(pool[slots].float(), hf_state, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_update_equals_scan_on_length_one_rows(dtype, state_dtype, atol, rtol):
    params = make_params()
    x, dt, B, C = make_tokens(5, 2, dtype)
    slots = [6, 0, 2, 9, 4]
    pool_scan, pool_step = make_pool(state_dtype), make_pool(state_dtype)

    y_scan = run_scan(x, dt, B, C, params, [1] * 5, pool_scan, slots, [True] * 5)
    y_step = selective_state_update(pool_step, x, dt, params["A"], B, C, params["D"], params["dt_bias"],
                                    torch.tensor(slots), DT_MIN)

    # Both paths do the same fp32 math; only the final rounding to the output/pool dtype may differ.
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=atol, rtol=rtol)
    torch.testing.assert_close(y_step, y_scan, **tol)
    torch.testing.assert_close(pool_step, pool_scan, **tol)


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_prefill_then_decode_steps_equal_one_scan(dtype, state_dtype, atol, rtol):
    params = make_params()
    total, prompt = 2 * CHUNK + 3, CHUNK + 1
    x, dt, B, C = make_tokens(total, 2, dtype)
    pool_one, pool_steps = make_pool(state_dtype), make_pool(state_dtype)

    y_one = run_scan(x, dt, B, C, params, [total], pool_one, [1], [False])

    ys = [run_scan(x[:prompt], dt[:prompt], B[:prompt], C[:prompt], params, [prompt], pool_steps, [1], [False])]
    for t in range(prompt, total):
        ys.append(selective_state_update(pool_steps, x[t:t + 1], dt[t:t + 1], params["A"], B[t:t + 1],
                                         C[t:t + 1], params["D"], params["dt_bias"], torch.tensor([1]), DT_MIN))
    torch.testing.assert_close(torch.cat(ys), y_one, atol=atol, rtol=rtol)
    torch.testing.assert_close(pool_steps, pool_one, atol=atol, rtol=rtol)


def test_new_row_ignores_garbage_slot():
    """R2: a row without initial state gives the zero-state result whatever its slot holds."""
    params = make_params()
    x, dt, B, C = make_tokens(CHUNK + 2, 2, torch.float32)
    pool_nan, pool_zero = make_pool(torch.float32), make_pool(torch.float32)
    pool_nan[3] = float("nan")
    pool_zero[3] = 0.0

    y_nan = run_scan(x, dt, B, C, params, [CHUNK + 2], pool_nan, [3], [False])
    y_zero = run_scan(x, dt, B, C, params, [CHUNK + 2], pool_zero, [3], [True])

    assert torch.isfinite(y_nan).all() and torch.isfinite(pool_nan[3]).all()
    torch.testing.assert_close(y_nan, y_zero, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(pool_nan, pool_zero, atol=1e-6, rtol=1e-6)


def test_shape_and_metadata_errors():
    params = make_params()
    x, dt, B, C = make_tokens(5, 2, torch.float32)
    pool = make_pool(torch.float32)
    with pytest.raises(ValueError, match=r"dt expected shape \[T, H\]"):
        run_scan(x, dt[:4], B, C, params, [5], pool, [0], [False])
    with pytest.raises(ValueError, match="query_start_loc expected"):
        run_scan(x, dt, B, C, params, [4], pool, [0], [False])
    with pytest.raises(ValueError, match="distinct"):
        run_scan(x, dt, B, C, params, [2, 3], pool, [1, 1], [False, False])
    with pytest.raises(ValueError, match=r"state_slots expected values in \[0, 10\)"):
        run_scan(x, dt, B, C, params, [5], pool, [10], [False])
    with pytest.raises(ValueError, match=r"ssm_state expected shape \[S, H, P, N\]"):
        run_scan(x, dt, B, C, params, [5], pool[:, :, :4], [0], [False])
    with pytest.raises(ValueError, match=r"B expected shape \[B, G, N\]"):
        selective_state_update(pool, x, dt, params["A"], B[:, :, :3], C, params["D"], params["dt_bias"],
                               torch.arange(5), DT_MIN)
