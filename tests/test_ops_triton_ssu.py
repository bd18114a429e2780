"""Triton selective state update kernels (decode and speculative verify) against their torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET must be set before
`baton.engine.ops.ssm_update.kernel` is imported (its `@triton.jit` reads it at decoration time), so it is set at
the very top of this module. The `gpu` tests run the compiled kernels at the full model size, and
`bench_ssu` times them (a benchmark script calls it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.ssm_update.kernel import (  # noqa: E402
    ONE_WARP_ROWS,
    _launch_config,
    selective_state_update_triton,
    selective_state_update_verify_triton,
)
from baton.engine.ops.ssm_update.reference import (  # noqa: E402
    selective_state_update,
    selective_state_update_verify,
)
from tests.cuda_timing import time_call_ms  # noqa: E402

H, P, N, G = 4, 8, 16, 2
NUM_SLOTS = 24
PENDING = 5  # L: recorded positions per slot (>= the largest T here)
DT_MIN = 1e-3
BATCH = 3

# (input dtype, pool dtype, atol, rtol). The kernel's fp32 math differs from torch's by a few ulps (exp,
# the order of the sum over N), so a rounding to bf16/fp16 can land one ulp apart.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 1e-2, id="bf16-fp32state"),
    pytest.param(torch.float32, torch.bfloat16, 2e-2, 1e-2, id="fp32-bf16state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 2e-2, 1e-2, id="bf16-bf16state"),
    pytest.param(torch.float32, torch.float16, 2e-3, 2e-3, id="fp32-fp16state"),
]


def make_params(heads: int = H, seed: int = 0, device: str = "cpu") -> dict[str, Tensor]:
    """Like a trained Mamba2 layer: dt around 1e-3 .. 1e-1 after softplus, A in [-16, -1]."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(heads, generator=g) * math.log(16.0))  # [H]
    dt0 = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # [H], inverse softplus of dt0
    D = torch.randn(heads, generator=g)  # [H]
    return {k: v.to(device) for k, v in dict(A=A, D=D, dt_bias=dt_bias).items()}


def make_tokens(lead: tuple[int, ...], dtype: torch.dtype, heads: int = H, head_dim: int = P, state: int = N,
                groups: int = G, seed: int = 1, device: str = "cpu") -> dict[str, Tensor]:  # fmt: skip
    """x [*lead, H, P], dt [*lead, H], B and C [*lead, G, N]; lead is (B,) or (B, T)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(
        x=torch.randn(*lead, heads, head_dim, generator=g),
        dt=torch.randn(*lead, heads, generator=g),
        B=torch.randn(*lead, groups, state, generator=g),
        C=torch.randn(*lead, groups, state, generator=g),
    )
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def make_pool(dtype: torch.dtype, slots: int = NUM_SLOTS, seed: int = 2, **shape) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    dims = (shape.get("heads", H), shape.get("head_dim", P), shape.get("state", N))
    return torch.randn(slots, *dims, generator=g).to(dtype)  # [S, H, P, N]


def call_single(fn, pool, tok, params, slots, dt_min=DT_MIN) -> Tensor:
    return fn(pool, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"], params["D"], params["dt_bias"],
              slots, dt_min)  # fmt: skip


def call_verify(fn, pool, pend, tok, params, slots, replay, num_tokens=None, dt_min=DT_MIN) -> Tensor:
    return fn(pool, pend["x"], pend["B"], pend["dt"], tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
              params["D"], params["dt_bias"], slots, replay, dt_min, num_tokens)  # fmt: skip


def close(actual: Tensor, expected: Tensor, atol: float, rtol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# ---- decode: one token per row --------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_single_matches_reference_and_leaves_other_slots(dtype, state_dtype, atol, rtol):
    params, tok = make_params(), make_tokens((BATCH,), dtype)
    pool = make_pool(state_dtype)
    before, ref_pool = pool.clone(), pool.clone()
    slots = torch.tensor([17, 2, 9])

    y = call_single(selective_state_update_triton, pool, tok, params, slots)
    y_ref = call_single(selective_state_update, ref_pool, tok, params, slots)

    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("num_groups", [1, 4])
def test_single_group_counts(num_groups):
    params, tok = make_params(), make_tokens((BATCH,), torch.float32, groups=num_groups)
    pool = make_pool(torch.float32)
    ref_pool = pool.clone()
    slots = torch.tensor([3, 0, 23])
    y = call_single(selective_state_update_triton, pool, tok, params, slots)
    y_ref = call_single(selective_state_update, ref_pool, tok, params, slots)
    close(y, y_ref, 1e-5, 1e-5)
    close(pool, ref_pool, 1e-5, 1e-5)


@pytest.mark.parametrize("dt_bias,dt_min", [(-20.0, 0.05), (25.0, DT_MIN), (0.0, 0.0)])
def test_single_softplus_and_dt_min_clamp(dt_bias, dt_min):
    """dt_bias -20: softplus ~1e-9, every step is the clamped dt_min; 25: past softplus's threshold of 20
    (dt is the input itself); 0: no clamp, softplus around 0."""
    params, tok = make_params(), make_tokens((BATCH,), torch.float32)
    params["dt_bias"] = torch.full((H,), dt_bias)
    pool = make_pool(torch.float32)
    ref_pool = pool.clone()
    slots = torch.tensor([1, 5, 8])
    y = call_single(selective_state_update_triton, pool, tok, params, slots, dt_min)
    y_ref = call_single(selective_state_update, ref_pool, tok, params, slots, dt_min)
    close(y, y_ref, 1e-5, 1e-5)
    close(pool, ref_pool, 1e-5, 1e-5)


def test_single_odd_sizes_and_strided_inputs():
    """P and N not powers of two (masked tile edges); x, B, C views with non-unit strides."""
    heads, head_dim, state = 6, 5, 12
    params = make_params(heads)
    wide = make_tokens((BATCH,), torch.float32, heads=heads, head_dim=2 * head_dim, state=2 * state, groups=3)
    tok = dict(x=wide["x"][..., ::2], dt=wide["dt"], B=wide["B"][..., ::2], C=wide["C"][..., state:])
    pool = make_pool(torch.float32, heads=heads, head_dim=head_dim, state=state)
    ref_pool = pool.clone()
    slots = torch.tensor([4, 11, 0])
    y = call_single(selective_state_update_triton, pool, tok, params, slots)
    y_ref = call_single(selective_state_update, ref_pool, tok, params, slots)
    close(y, y_ref, 1e-5, 1e-5)
    close(pool, ref_pool, 1e-5, 1e-5)


def test_decode_batches_from_one_warp_rows_take_one_warp():
    """Decode batches of ONE_WARP_ROWS rows or more run one warp per program, fewer rows keep two; the tile is the
    same. Verify runs one warp at every batch (no shared-memory layout changes per position), on twice the decode
    tile."""
    small = _launch_config(64, 128, batch=ONE_WARP_ROWS - 1)
    large = _launch_config(64, 128, batch=ONE_WARP_ROWS)
    assert small == (8, 128, 2) and large == (8, 128, 1)
    assert _launch_config(64, 128, verify=True, batch=1) == _launch_config(64, 128, verify=True) == (16, 128, 1)


def test_single_empty_batch():
    params, tok = make_params(), make_tokens((0,), torch.float32)
    pool = make_pool(torch.float32)
    before = pool.clone()
    y = call_single(selective_state_update_triton, pool, tok, params, torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, H, P)
    assert torch.equal(pool, before)


# ---- verify: replay the accepted positions, then T = 1+K tokens per row -------------------------


TRITON_VERIFY, REF_VERIFY = selective_state_update_verify_triton, selective_state_update_verify
# (input dtype, pool dtype) where the kernels are compared with each other bit for bit.
BIT_EXACT_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float16, torch.float32),
]


def make_pending(dtype: torch.dtype, slots: int = NUM_SLOTS, length: int = PENDING, heads: int = H,
                 head_dim: int = P, state: int = N, groups: int = G, seed: int = 3,
                 device: str = "cpu") -> dict[str, Tensor]:  # fmt: skip
    """Each slot's recorded inputs: x [S, L, H, P], B [S, L, G, N], raw dt [S, L, H], in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    out = dict(
        x=torch.randn(slots, length, heads, head_dim, generator=g),
        B=torch.randn(slots, length, groups, state, generator=g),
        dt=torch.randn(slots, length, heads, generator=g),
    )
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def clone_all(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in d.items()}


def assert_same(actual: Tensor, expected: Tensor) -> None:
    diff = (actual.float() - expected.float()).abs().max()
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), diff


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_verify_matches_reference(T, dtype, state_dtype, atol, rtol):
    """Scattered slots, replays of 0 .. L positions, short rows."""
    params, tok = make_params(), make_tokens((BATCH, T), dtype, seed=T)
    pool, pend = make_pool(state_dtype), make_pending(dtype)
    before, ref_pool, ref_pend = pool.clone(), pool.clone(), clone_all(pend)
    slots = torch.tensor([17, 2, 9])
    replay = torch.tensor([T, 0, PENDING])
    num_tokens = torch.tensor([T, max(1, T - 1), max(1, T - 2)])

    y = call_verify(TRITON_VERIFY, pool, pend, tok, params, slots, replay, num_tokens)
    y_ref = call_verify(REF_VERIFY, ref_pool, ref_pend, tok, params, slots, replay, num_tokens)

    close(y, y_ref, atol, rtol)
    for b, n in enumerate(num_tokens.tolist()):
        assert (y[b, n:] == 0).all()
    close(pool, ref_pool, atol, rtol)
    # Row 1 replays nothing: its slot is not written; nor is any slot outside `slots`.
    untouched = [s for s in range(NUM_SLOTS) if s not in (17, 9)]
    assert torch.equal(pool[untouched], before[untouched])
    for k in pend:
        assert_same(pend[k], ref_pend[k])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES[:3])
def test_verify_all_tokens_by_default(dtype, state_dtype, atol, rtol):
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), dtype)
    pool, pend = make_pool(state_dtype), make_pending(dtype)
    ref_pool, ref_pend = pool.clone(), clone_all(pend)
    slots, replay = torch.tensor([20, 21, 22]), torch.tensor([1, 3, 2])
    y = call_verify(selective_state_update_verify_triton, pool, pend, tok, params, slots, replay)
    y_ref = call_verify(selective_state_update_verify, ref_pool, ref_pend, tok, params, slots, replay)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    for k in pend:
        assert_same(pend[k], ref_pend[k])


def test_verify_softplus_and_dt_min_clamp():
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), torch.bfloat16)
    params["dt_bias"] = torch.tensor([-20.0, 25.0, 0.0, -3.0])
    pool, pend = make_pool(torch.float32), make_pending(torch.bfloat16)
    ref_pool, ref_pend = pool.clone(), clone_all(pend)
    slots, replay = torch.tensor([20, 21, 22]), torch.tensor([2, 2, 2])
    y = call_verify(TRITON_VERIFY, pool, pend, tok, params, slots, replay, dt_min=0.05)
    y_ref = call_verify(REF_VERIFY, ref_pool, ref_pend, tok, params, slots, replay, dt_min=0.05)
    close(y, y_ref, 2e-2, 1e-2)
    close(pool, ref_pool, 1e-5, 1e-5)


def test_verify_odd_sizes_strided_inputs_and_pending_views():
    """P and N not powers of two; x, B, C views with non-unit strides; pending tensors that are per-layer
    views of one [S, layers, L, ...] allocation, as the engine's pools hand them out."""
    heads, head_dim, state, groups, T = 6, 5, 12, 3, 3
    params = make_params(heads)
    wide = make_tokens((BATCH, T), torch.float32, heads=heads, head_dim=2 * head_dim, state=2 * state,
                       groups=groups)  # fmt: skip
    tok = dict(x=wide["x"][..., ::2], dt=wide["dt"], B=wide["B"][..., ::2], C=wide["C"][..., state:])
    pool = make_pool(torch.float32, heads=heads, head_dim=head_dim, state=state)
    g = torch.Generator().manual_seed(5)
    layers = dict(
        x=torch.randn(NUM_SLOTS, 2, PENDING, heads, head_dim, generator=g),
        B=torch.randn(NUM_SLOTS, 2, PENDING, groups, state, generator=g),
        dt=torch.randn(NUM_SLOTS, 2, PENDING, heads, generator=g),
    )
    pend = {k: v[:, 1] for k, v in layers.items()}
    ref_pool, ref_pend = pool.clone(), {k: v.clone() for k, v in pend.items()}
    slots, replay = torch.tensor([4, 11, 0]), torch.tensor([2, 0, 5])
    y = call_verify(selective_state_update_verify_triton, pool, pend, tok, params, slots, replay)
    y_ref = call_verify(selective_state_update_verify, ref_pool, ref_pend, tok, params, slots, replay)
    close(y, y_ref, 1e-5, 1e-5)
    close(pool, ref_pool, 1e-5, 1e-5)
    for k in pend:
        assert_same(pend[k], ref_pend[k])


@pytest.mark.parametrize("dtype,state_dtype", BIT_EXACT_DTYPES[:3])
def test_verify_single_token_equals_decode_kernel(dtype, state_dtype):
    """replay 0, T = 1: the decode kernel's y bit for bit, nothing stored; a replay of 1 next step commits
    the decode kernel's state bit for bit."""
    params, tok = make_params(), make_tokens((BATCH, 1), dtype)
    pool, pend = make_pool(state_dtype), make_pending(dtype)
    before, dec_pool = pool.clone(), pool.clone()
    slots = torch.tensor([6, 0, 12])
    y = call_verify(TRITON_VERIFY, pool, pend, tok, params, slots, torch.zeros(3, dtype=torch.int64))
    step = {k: v[:, 0] for k, v in tok.items()}
    y_dec = call_single(selective_state_update_triton, dec_pool, step, params, slots)
    assert torch.equal(y[:, 0], y_dec)
    assert torch.equal(pool, before)
    tok_next = make_tokens((BATCH, 1), dtype, seed=9)
    call_verify(TRITON_VERIFY, pool, pend, tok_next, params, slots, torch.ones(3, dtype=torch.int64))
    assert torch.equal(pool, dec_pool)


@pytest.mark.parametrize("dtype,state_dtype", BIT_EXACT_DTYPES)
def test_verify_chain_equals_single_kernel_decode(dtype, state_dtype):
    """R4 on the kernels themselves: step n+1 replays the a+1 positions step n accepted, for every a in
    0..K, and commits bit for bit the Triton decode kernel's state over the same tokens (both read the
    pool-rounded state); each accepted position's y is the decode kernel's, bit for bit."""
    K = 3
    T = 1 + K
    params, pool, pend = make_params(), make_pool(state_dtype), make_pending(dtype, length=T)
    slots, plain, scratch = [6, 0, 12], [20, 21, 22], [16, 17, 18]
    pool[plain] = pool[slots]
    replay = [0] * BATCH
    for n in range(T + 1):
        tok = make_tokens((BATCH, T), dtype, seed=100 + n)
        y = call_verify(selective_state_update_verify_triton, pool, pend, tok, params, torch.tensor(slots),
                        torch.tensor(replay))  # fmt: skip
        for b in range(BATCH):
            assert torch.equal(pool[slots[b]], pool[plain[b]]), (n, b)
        accepted = [(n + b) % T for b in range(BATCH)]
        for t in range(T):
            rows = torch.tensor([plain[b] if t <= accepted[b] else scratch[b] for b in range(BATCH)])
            step = {k: v[:, t] for k, v in tok.items()}
            y_plain = call_single(selective_state_update_triton, pool, step, params, rows)
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert torch.equal(y[b, t], y_plain[b])
        replay = [a + 1 for a in accepted]


def test_verify_unnamed_slots_untouched():
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), torch.float32)
    real_pool, real_pend = make_pool(torch.float32), make_pending(torch.float32)
    slots = [1, 6, 12]
    pool = torch.full_like(real_pool, float("nan"))
    pend = {k: torch.full_like(v, float("nan")) for k, v in real_pend.items()}
    pool[slots] = real_pool[slots]
    for k in pend:
        pend[k][slots] = real_pend[k][slots]
    y = call_verify(selective_state_update_verify_triton, pool, pend, tok, params, torch.tensor(slots),
                    torch.tensor([3, 0, PENDING]), torch.tensor([2, 3, 1]))  # fmt: skip
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        tensors = [pool[s]] + [v[s] for v in pend.values()]
        assert all(torch.isfinite(v).all() if s in slots else torch.isnan(v).all() for v in tensors), s


def test_verify_empty_batch():
    params, tok = make_params(), make_tokens((0, 2), torch.float32)
    pool, pend = make_pool(torch.float32), make_pending(torch.float32)
    before, pend_before = pool.clone(), clone_all(pend)
    none = torch.zeros(0, dtype=torch.int64)
    y = call_verify(selective_state_update_verify_triton, pool, pend, tok, params, none, none)
    assert y.shape == (0, 2, H, P)
    assert torch.equal(pool, before) and all(torch.equal(pend[k], pend_before[k]) for k in pend)


# ---- argument checks (shapes only; slot values are the caller's contract) ------------------------


def test_single_bad_shapes_raise():
    params = make_params()
    tok1 = make_tokens((BATCH,), torch.float32)
    pool = make_pool(torch.float32)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"selective_state_update_triton: B expected shape \[B, G, N\]"):
        call_single(selective_state_update_triton, pool, dict(tok1, B=tok1["B"][..., :3]), params, slots)
    with pytest.raises(ValueError, match=r"selective_state_update_triton: ssm_state expected"):
        call_single(selective_state_update_triton, pool[:, :, :4], tok1, params, slots)
    with pytest.raises(ValueError, match=r"selective_state_update_triton: state_slots expected shape"):
        call_single(selective_state_update_triton, pool, tok1, params, slots[:2])
    with pytest.raises(ValueError, match=r"selective_state_update_triton: A expected shape"):
        call_single(selective_state_update_triton, pool, tok1, dict(params, A=params["A"][:2]), slots)
    with pytest.raises(ValueError, match="multiple of G"):
        call_single(selective_state_update_triton, pool, make_tokens((BATCH,), torch.float32, groups=3),
                    params, slots)  # fmt: skip


VERIFY_FN = "selective_state_update_verify_triton"


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(replay=torch.tensor([0, 1])), r"replay expected shape \[B\] = \(3,\), got \(2,\)"),
        (dict(num_tokens=torch.tensor([1, 2])), r"num_tokens expected shape \[B\] = \(3,\), got \(2,\)"),
        (dict(slots=torch.tensor([[0], [1], [2]])), r"slots expected shape \[B\] = \(3,\), got \(3, 1\)"),
        (dict(C=(BATCH, 1, G, N)), r"C expected shape \[B, T, G, N\] = \(3, 2, 2, 16\), got \(3, 1, 2, 16\)"),
        (dict(x=(BATCH, H, P)), r"expected x \[B, T, H, P\].*got x \(3, 4, 8\)"),
        (dict(px=(NUM_SLOTS, PENDING, H, P + 1)), r"pending_x expected shape \[S, L, H, P\]"),
        (dict(pB=(NUM_SLOTS, PENDING, G + 1, N)), r"pending_B expected shape \[S, L, G, N\]"),
        (dict(pdt=(NUM_SLOTS - 1, PENDING, H)), r"pending_dt expected shape \[S, L, H\]"),
        (dict(L=1), r"pending_x expected a pending length L >= T = 2, got L = 1"),
    ],
)
def test_verify_bad_shapes_raise(change, match):
    params, tok = make_params(), make_tokens((BATCH, 2), torch.float32)
    pool, pend = make_pool(torch.float32), make_pending(torch.float32)
    slots, replay, num_tokens = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), None
    for key, value in change.items():
        if key == "L":
            pend = {k: v[:, :value] for k, v in pend.items()}
        elif key in ("px", "pB", "pdt"):
            pend = dict(pend, **{key[1:]: torch.zeros(value)})
        elif key in ("C", "x"):
            tok = dict(tok, **{key: torch.zeros(value)})
        else:
            slots, replay = change.get("slots", slots), change.get("replay", replay)
            num_tokens = change.get("num_tokens")
    with pytest.raises(ValueError, match=rf"{VERIFY_FN}: .*{match}"):
        call_verify(selective_state_update_verify_triton, pool, pend, tok, params, slots, replay, num_tokens)


# ---- GPU: full model size, compiled kernels --------------------------------------------------------

FULL = dict(heads=128, head_dim=64, state=128, groups=8)
GPU_DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 5e-2, 1e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 5e-2, 1e-2, id="bf16-bf16state"),
]


def _full_case(batch: int, T: int | None, dtype: torch.dtype, state_dtype: torch.dtype, slots_per_row: int):
    """Params, tokens ([B] or [B, T] leading) and a pool of batch * slots_per_row slots on the GPU."""
    dims = dict(heads=FULL["heads"], head_dim=FULL["head_dim"], state=FULL["state"])
    params = make_params(FULL["heads"], device="cuda")
    lead = (batch,) if T is None else (batch, T)
    tok = make_tokens(lead, dtype, groups=FULL["groups"], device="cuda", **dims)
    pool = make_pool(state_dtype, slots=batch * slots_per_row, **dims).cuda()
    return params, tok, pool


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_gpu_single_full_size(batch, dtype, state_dtype, atol, rtol):
    params, tok, pool = _full_case(batch, None, dtype, state_dtype, 2)
    ref_pool, before = pool.clone(), pool.clone()
    slots = torch.randperm(2 * batch, generator=torch.Generator().manual_seed(batch))[:batch].cuda()
    y = call_single(selective_state_update_triton, pool, tok, params, slots)
    y_ref = call_single(selective_state_update, ref_pool, tok, params, slots)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    untouched = torch.ones(2 * batch, dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])


def _full_pending(batch: int, T: int, dtype: torch.dtype, slots_per_row: int) -> dict[str, Tensor]:
    dims = dict(heads=FULL["heads"], head_dim=FULL["head_dim"], state=FULL["state"], groups=FULL["groups"])
    return make_pending(dtype, slots=batch * slots_per_row, length=T, device="cuda", **dims)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_gpu_verify_full_size(batch, dtype, state_dtype, atol, rtol):
    """T = 5 verify rows on random distinct slots of a 2 * batch pool, replays of 0..T, short rows."""
    T = 5
    params, tok, pool = _full_case(batch, T, dtype, state_dtype, 2)
    pend = _full_pending(batch, T, dtype, 2)
    ref_pool, ref_pend, before = pool.clone(), clone_all(pend), pool.clone()
    g = torch.Generator().manual_seed(batch)
    slots = torch.randperm(2 * batch, generator=g)[:batch].cuda()
    replay = torch.randint(0, T + 1, (batch,), generator=g).cuda()
    num_tokens = (torch.arange(batch, device="cuda") % T) + 1
    y = call_verify(TRITON_VERIFY, pool, pend, tok, params, slots, replay, num_tokens)
    y_ref = call_verify(REF_VERIFY, ref_pool, ref_pend, tok, params, slots, replay, num_tokens)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    for k in pend:
        assert_same(pend[k], ref_pend[k])
    untouched = torch.ones(2 * batch, dtype=torch.bool, device="cuda")
    untouched[slots[replay > 0]] = False
    assert torch.equal(pool[untouched], before[untouched])


def bench_ssu(batch: int, T: int = 1, dtype: torch.dtype = torch.bfloat16,
              state_dtype: torch.dtype = torch.float32, warmup: int = 10, iters: int = 100,
              graph_launches: int = 0) -> tuple[float, float]:  # fmt: skip
    """Time one launch of the Triton kernel at the full model size (H=128, P=64, N=128, G=8) on CUDA.

    T=1 times `selective_state_update_triton` (read + write of each row's state). T>1 times
    `selective_state_update_verify_triton` in its worst steady state: every row replays replay = T recorded
    positions (pending length L = T) then runs its T tokens, all valid. Returns (ms per call, GB/s of the
    bytes it must move) from CUDA events. Bytes: each row's state read once and written once, x, dt, B, C
    in and y out, slots (and for verify: replay, the T replayed positions' recorded x, B, dt read and this
    step's T positions written back). graph_launches > 0 times the kernel inside a CUDA graph of that many
    back-to-back launches, replayed `iters` times (`tests/cuda_timing.py`); 0 times eager launches.
    """
    params, tok, pool = _full_case(batch, None if T == 1 else T, dtype, state_dtype, 2)
    slots = torch.arange(batch, device="cuda")
    if T == 1:
        run = lambda: call_single(selective_state_update_triton, pool, tok, params, slots)  # noqa: E731
        pending_bytes = 0
    else:
        pend = _full_pending(batch, T, dtype, 2)
        replay = torch.full((batch,), T, dtype=torch.int64, device="cuda")
        run = lambda: call_verify(TRITON_VERIFY, pool, pend, tok, params, slots, replay)  # noqa: E731
        per_position = sum(v[0, 0].numel() * v.element_size() for v in pend.values())  # x, B, dt
        pending_bytes = 2 * batch * T * per_position  # T read for the replay, T written
    ms = time_call_ms(run, warmup=warmup, iters=iters, graph_launches=graph_launches)
    state_bytes = FULL["heads"] * FULL["head_dim"] * FULL["state"] * pool.element_size()
    token_bytes = (
        sum(t.numel() * t.element_size() for t in tok.values()) + tok["x"].numel() * tok["x"].element_size()
    )  # x, dt, B, C in; y out
    index_bytes = batch * 8 * (1 if T == 1 else 2)  # slots (and replay)
    moved = 2 * batch * state_bytes + token_bytes + pending_bytes + index_bytes
    return ms, moved / (ms * 1e-3) / 1e9


@pytest.mark.gpu
def test_gpu_bench_ssu_runs():
    ms, gbps = bench_ssu(8, T=1, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
    ms, gbps = bench_ssu(8, T=5, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
    for T in (1, 5):
        ms, gbps = bench_ssu(8, T=T, warmup=1, iters=2, graph_launches=3)
        assert ms > 0 and gbps > 0
