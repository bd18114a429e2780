"""Triton selective state update kernels (decode and speculative verify) against their torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET must be set before
`baton.engine.ops.triton_ssu` is imported (its `@triton.jit` reads it at decoration time), so it is set at
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

from baton.engine.ops.selective_state_update import selective_state_update  # noqa: E402
from baton.engine.ops.spec_state_update import selective_state_update_multi  # noqa: E402
from baton.engine.ops.triton_ssu import (  # noqa: E402
    selective_state_update_multi_triton,
    selective_state_update_triton,
)

H, P, N, G = 4, 8, 16, 2
NUM_SLOTS = 24
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


def call_multi(fn, pool, tok, params, src, dst, num_tokens=None, dt_min=DT_MIN) -> Tensor:
    return fn(pool, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"], params["D"], params["dt_bias"],
              src, dst, dt_min, num_tokens)  # fmt: skip


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


def test_single_empty_batch():
    params, tok = make_params(), make_tokens((0,), torch.float32)
    pool = make_pool(torch.float32)
    before = pool.clone()
    y = call_single(selective_state_update_triton, pool, tok, params, torch.zeros(0, dtype=torch.int64))
    assert y.shape == (0, H, P)
    assert torch.equal(pool, before)


# ---- verify: T = 1+K tokens per row ---------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
def test_multi_matches_reference(T, dtype, state_dtype, atol, rtol):
    """Scattered slots, row 0's src among its own dst slots, short rows with -1 padding."""
    params, tok = make_params(), make_tokens((BATCH, T), dtype, seed=T)
    pool = make_pool(state_dtype)
    before, ref_pool = pool.clone(), pool.clone()
    dst = [[2 + 3 * t for t in range(T)], [19 - t for t in range(T)], [7 + 3 * t for t in range(T)]]
    src = [2, 21, 1]  # row 0 starts from its own first dst slot
    num_tokens = [T, max(1, T - 1), max(1, T - 2)]
    for b, n in enumerate(num_tokens):
        dst[b][n:] = [-1] * (T - n)
    src_t, dst_t, nt = torch.tensor(src), torch.tensor(dst), torch.tensor(num_tokens)

    y = call_multi(selective_state_update_multi_triton, pool, tok, params, src_t, dst_t, nt)
    y_ref = call_multi(selective_state_update_multi, ref_pool, tok, params, src_t, dst_t, nt)

    close(y, y_ref, atol, rtol)
    for b, n in enumerate(num_tokens):
        assert (y[b, n:] == 0).all()
    close(pool, ref_pool, atol, rtol)
    written = {s for row, n in zip(dst, num_tokens, strict=True) for s in row[:n]}
    untouched = [s for s in range(NUM_SLOTS) if s not in written]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES[:2])
def test_multi_all_tokens_by_default(dtype, state_dtype, atol, rtol):
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), dtype)
    pool = make_pool(state_dtype)
    ref_pool = pool.clone()
    src, dst = torch.tensor([20, 21, 22]), torch.arange(BATCH * T).view(BATCH, T)
    y = call_multi(selective_state_update_multi_triton, pool, tok, params, src, dst)
    y_ref = call_multi(selective_state_update_multi, ref_pool, tok, params, src, dst)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)


def test_multi_softplus_and_dt_min_clamp():
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), torch.bfloat16)
    params["dt_bias"] = torch.tensor([-20.0, 25.0, 0.0, -3.0])
    pool = make_pool(torch.float32)
    ref_pool = pool.clone()
    src, dst = torch.tensor([20, 21, 22]), torch.arange(BATCH * T).view(BATCH, T)
    y = call_multi(selective_state_update_multi_triton, pool, tok, params, src, dst, dt_min=0.05)
    y_ref = call_multi(selective_state_update_multi, ref_pool, tok, params, src, dst, dt_min=0.05)
    close(y, y_ref, 2e-2, 1e-2)
    close(pool, ref_pool, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.float16)])  # fmt: skip
def test_multi_resume_equals_single_kernel_decode(dtype, state_dtype):
    """R4 on the kernels themselves: resuming from the dst slot of the last accepted position is bit for
    bit the Triton decode kernel run over the same tokens (both read the pool-rounded state)."""
    K, rounds = 3, 3
    T = 1 + K
    params, pool = make_params(), make_pool(state_dtype)
    owned = [[b * T + t for t in range(T)] for b in range(BATCH)]
    plain, scratch = [20, 21, 22], [16, 17, 18]
    pool[plain] = pool[[row[0] for row in owned]]
    src = [row[0] for row in owned]
    g = torch.Generator().manual_seed(7)
    for r in range(rounds):
        tok = make_tokens((BATCH, T), dtype, seed=100 + r)
        y = call_multi(selective_state_update_multi_triton, pool, tok, params, torch.tensor(src),
                       torch.tensor(owned))  # fmt: skip
        accepted = torch.randint(0, T, (BATCH,), generator=g).tolist()
        for t in range(T):
            slots = torch.tensor([plain[b] if t <= accepted[b] else scratch[b] for b in range(BATCH)])
            step = {k: v[:, t] for k, v in tok.items()}
            y_plain = call_single(selective_state_update_triton, pool, step, params, slots)
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert torch.equal(y[b, t], y_plain[b])
        for b in range(BATCH):
            src[b] = owned[b][accepted[b]]
            assert torch.equal(pool[src[b]], pool[plain[b]])


# ---- argument checks (shapes only; slot values are the caller's contract) ------------------------


def test_bad_shapes_raise():
    params = make_params()
    tok1, tok2 = make_tokens((BATCH,), torch.float32), make_tokens((BATCH, 2), torch.float32)
    pool = make_pool(torch.float32)
    slots, dst = torch.tensor([0, 1, 2]), torch.arange(6).view(BATCH, 2)
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
    with pytest.raises(ValueError, match=r"selective_state_update_multi_triton: dst_slots expected shape"):
        call_multi(selective_state_update_multi_triton, pool, tok2, params, slots, dst[:, :1])
    with pytest.raises(ValueError, match=r"selective_state_update_multi_triton: num_tokens expected shape"):
        call_multi(selective_state_update_multi_triton, pool, tok2, params, slots, dst, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"selective_state_update_multi_triton: C expected shape"):
        call_multi(
            selective_state_update_multi_triton, pool, dict(tok2, C=tok2["C"][:, :1]), params, slots, dst
        )
    with pytest.raises(ValueError, match=r"selective_state_update_multi_triton: expected x \[B, T, H, P\]"):
        call_multi(selective_state_update_multi_triton, pool, tok1, params, slots, dst)


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_gpu_multi_full_size(batch, dtype, state_dtype, atol, rtol):
    T = 4
    params, tok, pool = _full_case(batch, T, dtype, state_dtype, 1 + T)
    ref_pool = pool.clone()
    src = torch.arange(batch, device="cuda")
    dst = (
        (batch + torch.randperm(batch * T, generator=torch.Generator().manual_seed(batch)))
        .view(batch, T)
        .cuda()
    )
    num_tokens = (torch.arange(batch, device="cuda") % T) + 1
    y = call_multi(selective_state_update_multi_triton, pool, tok, params, src, dst, num_tokens)
    y_ref = call_multi(selective_state_update_multi, ref_pool, tok, params, src, dst, num_tokens)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)


def bench_ssu(batch: int, T: int = 1, dtype: torch.dtype = torch.bfloat16,
              state_dtype: torch.dtype = torch.float32, warmup: int = 10, iters: int = 100) -> tuple[float, float]:  # fmt: skip
    """Time one launch of the Triton kernel at the full model size (H=128, P=64, N=128, G=8) on CUDA.

    T=1 times `selective_state_update_triton` (read + write of each row's state), T>1 times
    `selective_state_update_multi_triton` with all T tokens valid (one read, T writes per row).
    Returns (ms per call, GB/s of the bytes it must move: state, x, dt, B, C, y, slots) from CUDA events.
    """
    params, tok, pool = _full_case(batch, None if T == 1 else T, dtype, state_dtype, 1 + T)
    src = torch.arange(batch, device="cuda")
    if T == 1:
        run = lambda: call_single(selective_state_update_triton, pool, tok, params, src)  # noqa: E731
    else:
        dst = batch + torch.arange(batch * T, device="cuda").view(batch, T)
        run = lambda: call_multi(selective_state_update_multi_triton, pool, tok, params, src, dst)  # noqa: E731
    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    state_bytes = FULL["heads"] * FULL["head_dim"] * FULL["state"] * pool.element_size()
    token_bytes = (
        sum(t.numel() * t.element_size() for t in tok.values()) + tok["x"].numel() * tok["x"].element_size()
    )
    moved = batch * (1 + T) * state_bytes + token_bytes + batch * (1 + T) * 8
    return ms, moved / (ms * 1e-3) / 1e9


@pytest.mark.gpu
def test_gpu_bench_ssu_runs():
    ms, gbps = bench_ssu(8, T=1, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
    ms, gbps = bench_ssu(8, T=4, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
