"""Triton chunked selective scan ("SSD") over varlen prefill rows against its torch reference
`mamba_chunk_scan_varlen`.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET must be set before
`baton.engine.ops.chunk_scan.kernel` is imported, so it is set at the very top of this module. The `gpu` tests run
the compiled kernels at the size of an 8B-like layer, and `bench_ssd` times them (a benchmark script
calls it).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.chunk_scan import kernel as triton_ssd  # noqa: E402
from baton.engine.ops.chunk_scan.kernel import build_chunk_meta, mamba_chunk_scan_varlen_triton  # noqa: E402
from baton.engine.ops.chunk_scan.reference import mamba_chunk_scan_varlen  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402

H, P, N, G = 4, 8, 16, 2
CHUNK = 16
NUM_SLOTS = 12
DT_MIN = 1e-3

# Rows of length < chunk, == chunk, chunk+1, 0, several chunks with a partial last one, and 1.
LENGTHS = [5, CHUNK, CHUNK + 1, 0, 2 * CHUNK + 7, 1]
SLOTS = [9, 2, 11, 5, 0, 7]
HAS_INIT = [True, False, True, False, True, True]

# (activation dtype, pool dtype, atol, rtol). fp32 differs from the reference by a few ulps (the in-chunk
# decays are differences of running sums here); 16-bit activations also round the dot operands.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 5e-2, 2e-2, id="bf16-fp32pool"),
    pytest.param(torch.bfloat16, torch.bfloat16, 5e-2, 2e-2, id="bf16-bf16pool"),
    pytest.param(torch.float16, torch.float32, 1e-2, 5e-3, id="fp16-fp32pool"),
    pytest.param(torch.float32, torch.bfloat16, 2e-2, 1e-2, id="fp32-bf16pool"),
    pytest.param(torch.float16, torch.float16, 1e-2, 5e-3, id="fp16-fp16pool"),
]
# C·B^T once per (chunk, group) in its own launch (the default), or recomputed per head (the old path).
SHARE_CB = [pytest.param(True, id="shared-cb"), pytest.param(False, id="per-head-cb")]


def make_params(heads: int = H, seed: int = 0, device: str = "cpu") -> dict[str, Tensor]:
    """Like a trained Mamba2 layer: dt around 1e-3 .. 1e-1 after softplus, A in [-16, -1]."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(heads, generator=g) * math.log(16.0))  # [H]
    dt0 = torch.exp(torch.empty(heads).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # [H], inverse softplus of dt0
    D = torch.randn(heads, generator=g)  # [H]
    return {k: v.to(device) for k, v in dict(A=A, D=D, dt_bias=dt_bias).items()}


def make_tokens(T: int, dtype: torch.dtype, heads: int = H, head_dim: int = P, state: int = N,
                groups: int = G, seed: int = 1, device: str = "cpu") -> dict[str, Tensor]:  # fmt: skip
    """x [T, H, P], dt [T, H] raw, B and C [T, G, N]."""
    g = torch.Generator().manual_seed(seed)
    out = dict(
        x=torch.randn(T, heads, head_dim, generator=g),
        dt=torch.randn(T, heads, generator=g),
        B=torch.randn(T, groups, state, generator=g),
        C=torch.randn(T, groups, state, generator=g),
    )
    return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}


def make_pool(dtype: torch.dtype, slots: int = NUM_SLOTS, heads: int = H, head_dim: int = P, state: int = N,
              seed: int = 2, device: str = "cpu") -> Tensor:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return torch.randn(slots, heads, head_dim, state, generator=g).to(device=device, dtype=dtype)


def make_rows(lengths, slots, has_init, device="cpu") -> dict[str, Tensor]:
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return dict(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        has_initial_state=torch.tensor(has_init, dtype=torch.bool, device=device),
    )


def call(fn, tok, params, pool, meta, chunk_size=CHUNK, dt_min=DT_MIN, **kwargs) -> Tensor:
    return fn(tok["x"], tok["dt"], params["A"], tok["B"], tok["C"], params["D"], params["dt_bias"],
              meta["query_start_loc"], pool, meta["state_slots"], meta["has_initial_state"], chunk_size,
              dt_min, **kwargs)  # fmt: skip


def run_both(tok, params, pool, meta, chunk_size=CHUNK, dt_min=DT_MIN, **kwargs):
    """Reference on a copy of the pool, kernel on the pool itself; returns (y, y_ref, ref_pool)."""
    ref_pool = pool.clone()
    y_ref = call(mamba_chunk_scan_varlen, tok, params, ref_pool, meta, chunk_size, dt_min)
    y = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, chunk_size, dt_min, **kwargs)
    return y, y_ref, ref_pool


def close(actual: Tensor, expected: Tensor, atol: float, rtol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def assert_untouched(pool: Tensor, before: Tensor, slots) -> None:
    untouched = [s for s in range(pool.shape[0]) if s not in set(slots)]
    assert torch.equal(pool[untouched], before[untouched])


# ---- against the reference ---------------------------------------------------------------------------


@pytest.mark.parametrize("share_cb", SHARE_CB)
@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", DTYPES)
def test_matches_reference_and_leaves_other_slots(dtype, pool_dtype, atol, rtol, share_cb):
    params, tok = make_params(), make_tokens(sum(LENGTHS), dtype)
    pool = make_pool(pool_dtype)
    # Rows without initial state never read their slot: garbage there must not leak into y or the state.
    pool[[s for s, init in zip(SLOTS, HAS_INIT, strict=True) if not init]] = float("nan")
    before = pool.clone()
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)

    y, y_ref, ref_pool = run_both(tok, params, pool, meta, share_cb=share_cb)
    assert not pool.isnan().any()

    assert y.dtype == dtype
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    assert_untouched(pool, before, SLOTS)


def test_empty_row_writes_its_initial_state_or_zeros():
    """As the reference: an empty row's slot ends up holding its initial state (or zeros without one)."""
    params, tok = make_params(), make_tokens(3, torch.float32)
    pool = make_pool(torch.bfloat16)
    before = pool.clone()
    meta = make_rows([0, 3, 0], [4, 1, 8], [True, False, False])
    y, y_ref, ref_pool = run_both(tok, params, pool, meta)
    close(y, y_ref, 1e-4, 1e-4)
    assert torch.equal(pool[4], before[4]) and torch.equal(ref_pool[4], before[4])
    assert (pool[8] == 0).all() and (ref_pool[8] == 0).all()
    assert_untouched(pool, before, [4, 1, 8])


def test_only_empty_rows_and_no_rows():
    params, pool = make_params(), make_pool(torch.float32)
    before = pool.clone()
    tok = make_tokens(0, torch.float32)
    y, y_ref, ref_pool = run_both(tok, params, pool, make_rows([0, 0], [3, 6], [True, False]))
    assert y.shape == (0, H, P)
    assert torch.equal(pool, ref_pool)
    assert torch.equal(pool[3], before[3]) and (pool[6] == 0).all()

    pool = before.clone()
    y = call(mamba_chunk_scan_varlen_triton, tok, params, pool, make_rows([], [], []))
    assert y.shape == (0, H, P)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("share_cb", SHARE_CB)
@pytest.mark.parametrize("num_groups", [1, 4])
def test_group_counts(num_groups, share_cb):
    params, tok = make_params(), make_tokens(sum(LENGTHS), torch.float32, groups=num_groups)
    pool = make_pool(torch.float32)
    y, y_ref, ref_pool = run_both(tok, params, pool, make_rows(LENGTHS, SLOTS, HAS_INIT), share_cb=share_cb)
    close(y, y_ref, 1e-4, 1e-4)
    close(pool, ref_pool, 1e-4, 1e-4)


@pytest.mark.parametrize("share_cb", SHARE_CB)
def test_chunk_meta_given_equals_built_and_does_not_sync(monkeypatch, share_cb):
    params, tok = make_params(), make_tokens(sum(LENGTHS), torch.bfloat16)
    pool = make_pool(torch.float32)
    pool_given = pool.clone()
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)
    y_built = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, share_cb=share_cb)

    chunk_meta = build_chunk_meta(meta["query_start_loc"].tolist(), CHUNK, "cpu")

    def no_sync(*args, **kwargs):
        raise AssertionError("a device read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", no_sync)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    monkeypatch.setattr(torch.Tensor, "nonzero", no_sync)
    y_given = call(
        mamba_chunk_scan_varlen_triton,
        tok,
        params,
        pool_given,
        meta,
        chunk_meta=chunk_meta,
        share_cb=share_cb,
    )
    monkeypatch.undo()

    assert torch.equal(y_given, y_built)
    assert torch.equal(pool_given, pool)


def test_build_chunk_meta_layout():
    m = build_chunk_meta([0, 5, 5, 25], 8, "cpu")
    assert (m.num_tokens, m.num_rows, m.chunk_size, m.num_chunks) == (25, 3, 8, 4)
    assert m.chunk_start.tolist() == [0, 5, 13, 21]
    assert m.chunk_len.tolist() == [5, 8, 8, 4]
    assert m.row_chunk.tolist() == [0, 1, 1, 4]
    assert m.chunk_start.dtype == torch.int32
    with pytest.raises(ValueError, match="non-decreasing from 0"):
        build_chunk_meta([0, 5, 3], 8, "cpu")
    with pytest.raises(ValueError, match="chunk_size > 0"):
        build_chunk_meta([0, 5], 0, "cpu")


@pytest.mark.parametrize("share_cb", SHARE_CB)
def test_small_tiles_odd_sizes_and_strided_inputs(share_cb):
    """P and N not powers of two and split over several blocks; chunk positions over several m/k blocks;
    x, dt, B, C as views with non-unit strides (as sliced out of the in_proj / conv outputs)."""
    heads, head_dim, state, groups, chunk = 6, 20, 24, 3, 40
    lengths, slots, has_init = [39, 40, 41, 95], [3, 0, 10, 6], [True, False, True, False]
    T = sum(lengths)
    params = make_params(heads)
    wide = make_tokens(T, torch.float32, heads=heads, head_dim=2 * head_dim, state=2 * state, groups=groups)
    dt_wide = torch.randn(T, 2 * heads, generator=torch.Generator().manual_seed(3))
    tok = dict(x=wide["x"][..., ::2], dt=dt_wide[:, heads:], B=wide["B"][..., ::2], C=wide["C"][..., state:])
    pool = make_pool(torch.float32, heads=heads, head_dim=head_dim, state=state)
    before = pool.clone()
    meta = make_rows(lengths, slots, has_init)
    y, y_ref, ref_pool = run_both(
        tok, params, pool, meta, chunk, block_p=16, block_n=16, block_m=16, block_k=16, share_cb=share_cb
    )
    close(y, y_ref, 1e-4, 1e-4)
    close(pool, ref_pool, 1e-4, 1e-4)
    assert_untouched(pool, before, slots)


@pytest.mark.parametrize("share_cb", SHARE_CB)
def test_native_dot_path_with_fp16(monkeypatch, share_cb):
    """The GPU's code path (16-bit tl.dot operands, no fp32 emulation) under the interpreter, where numpy
    has fp16 (not bf16): same results within fp16 tolerances."""
    monkeypatch.setattr(triton_ssd, "_interpreted", lambda: False)
    params, tok = make_params(), make_tokens(sum(LENGTHS), torch.float16)
    pool = make_pool(torch.float32)
    y, y_ref, ref_pool = run_both(tok, params, pool, make_rows(LENGTHS, SLOTS, HAS_INIT), share_cb=share_cb)
    close(y, y_ref, 1e-2, 5e-3)
    close(pool, ref_pool, 1e-2, 5e-3)


@pytest.mark.parametrize(
    "dtype,chunk,blocks",
    [
        (torch.float32, CHUNK, {}),
        (torch.bfloat16, CHUNK, {}),
        (torch.float16, 40, dict(block_p=16, block_n=16, block_m=16, block_k=16)),
        (torch.bfloat16, 40, dict(block_m=32, block_k=16)),
    ],
)
def test_shared_cb_equals_per_head_cb(dtype, chunk, blocks):
    """With an fp32 CB buffer the shared path multiplies the very products the per-head path computes
    (same tiles, same operand rounding): y and the states agree bit for bit in the interpreter."""
    params, tok = make_params(), make_tokens(sum(LENGTHS), dtype)
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)
    pool_shared, pool_per_head = make_pool(torch.float32), make_pool(torch.float32)
    y_shared = call(
        mamba_chunk_scan_varlen_triton, tok, params, pool_shared, meta, chunk, share_cb=True, **blocks
    )
    y_per_head = call(
        mamba_chunk_scan_varlen_triton, tok, params, pool_per_head, meta, chunk, share_cb=False, **blocks
    )
    assert torch.equal(y_shared, y_per_head)
    assert torch.equal(pool_shared, pool_per_head)


@pytest.mark.parametrize("dtype,cb_dtype,atol,rtol", [
    pytest.param(torch.bfloat16, torch.bfloat16, 5e-2, 2e-2, id="bf16-bf16cb"),
    pytest.param(torch.float16, torch.float16, 1e-2, 5e-3, id="fp16-fp16cb"),
    pytest.param(torch.float32, torch.bfloat16, 5e-2, 2e-2, id="fp32-bf16cb"),
])  # fmt: skip
def test_16bit_cb_buffer(dtype, cb_dtype, atol, rtol):
    """A 16-bit CB buffer (half the bytes) rounds C·B^T once more before the decay; still within the
    activation dtype's tolerances."""
    params, tok = make_params(), make_tokens(sum(LENGTHS), dtype)
    pool = make_pool(torch.float32)
    y, y_ref, ref_pool = run_both(tok, params, pool, make_rows(LENGTHS, SLOTS, HAS_INIT), cb_dtype=cb_dtype)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol,share_cb", [
    pytest.param(torch.float32, 1e-4, 1e-4, True, id="fp32-shared-cb"),
    pytest.param(torch.bfloat16, 5e-2, 2e-2, True, id="bf16-shared-cb"),
    pytest.param(torch.bfloat16, 5e-2, 2e-2, False, id="bf16-per-head-cb"),
])  # fmt: skip
def test_factored_in_chunk_decay_against_the_exact_path(monkeypatch, dtype, atol, rtol, share_cb):
    """The output kernel's factored decay (row and column scales around the block's middle running sum) against
    its exact per-entry exp (FACTOR_RANGE < 0) and the reference. Slow decays (|dt * A| small): every block takes
    the factored path, so the bits differ from the exact path's, both within tolerance of the reference. Fast
    decays (A = -1e3: every block spans more than FACTOR_RANGE) and A > 0 (the sums rise along the chunk) take the
    exact path: the same bits as with it forced."""
    tok = make_tokens(sum(LENGTHS), dtype)
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)

    def run(params, factor_range):
        monkeypatch.setattr(triton_ssd, "FACTOR_RANGE", factor_range)
        pool = make_pool(torch.float32)
        y = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, share_cb=share_cb)
        return y, pool

    slow = make_params()
    slow["A"] = -torch.linspace(0.01, 0.5, H)
    y_f, pool_f = run(slow, triton_ssd.FACTOR_RANGE)
    y_e, pool_e = run(slow, -1.0)
    assert not torch.equal(y_f, y_e)  # the factored path ran
    assert torch.equal(pool_f, pool_e)  # (the states never go through the output kernel)
    ref_pool = make_pool(torch.float32)
    y_ref = call(mamba_chunk_scan_varlen, tok, slow, ref_pool, meta)
    close(y_f, y_ref, atol, rtol)
    close(y_e, y_ref, atol, rtol)
    for A in (torch.full((H,), -1e3), torch.linspace(0.01, 0.2, H)):
        params = dict(make_params(), A=A)
        y_d, _ = run(params, triton_ssd.FACTOR_RANGE)
        y_x, _ = run(params, -1.0)
        assert torch.equal(y_d, y_x)
        assert torch.isfinite(y_d.float()).all()


@pytest.mark.parametrize("dt_bias,dt_min", [(-20.0, 0.05), (25.0, DT_MIN), (0.0, 0.0)])
def test_softplus_and_dt_min_clamp(dt_bias, dt_min):
    """dt_bias -20: every step is the clamped dt_min; 25: past softplus's threshold; 0: no clamp."""
    params, tok = make_params(), make_tokens(sum(LENGTHS), torch.float32)
    params["dt_bias"] = torch.full((H,), dt_bias)
    pool = make_pool(torch.float32)
    y, y_ref, ref_pool = run_both(tok, params, pool, make_rows(LENGTHS, SLOTS, HAS_INIT), dt_min=dt_min)
    close(y, y_ref, 1e-4, 1e-4)
    close(pool, ref_pool, 1e-4, 1e-4)


@pytest.mark.parametrize("dt_dtype", [torch.float32, torch.bfloat16])
def test_chunk_dt_cumsum_against_torch(dt_dtype):
    """Launch 0 (the dt and running-sum buffers the state walk and the output kernel read) against torch: dt as
    `discretize_dt`, and the running sums restart at every chunk's first token (rows' partial last chunks included),
    over more heads than one block of DT_BLOCK_H and a strided dt."""
    from baton.engine.ops.ssm_update.reference import discretize_dt

    heads = triton_ssd.DT_BLOCK_H + 3
    params = make_params(heads)
    T = sum(LENGTHS)
    g = torch.Generator().manual_seed(3)
    dt = (torch.randn(T, 2 * heads, generator=g)[:, ::2] - 1.0).to(dt_dtype)  # strided, as a view into in_proj's
    starts = [0]
    for n in LENGTHS:
        starts.append(starts[-1] + n)
    meta = build_chunk_meta(starts, CHUNK, "cpu")
    dt_buf, cs_buf = triton_ssd.chunk_dt_cumsum_triton(dt, params["A"], params["dt_bias"], DT_MIN, meta)
    want_dt = discretize_dt(dt, params["dt_bias"], DT_MIN)  # [T, H]
    want_cs = torch.empty_like(want_dt)
    for c0, n in zip(meta.chunk_start.tolist(), meta.chunk_len.tolist(), strict=True):
        want_cs[c0 : c0 + n] = torch.cumsum(want_dt[c0 : c0 + n] * params["A"], dim=0)
    torch.testing.assert_close(dt_buf, want_dt.T, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cs_buf, want_cs.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lengths", [[5], [1, 2], [70, 3, 9], [64, 64, 1, 0, 17]])
def test_launch_arguments_specialize_alike_for_every_batch(lengths):
    """The chunk arrays start 16-byte aligned and the per-chunk buffers' head stride is divisible by 16 whatever
    the batch: Triton specializes pointers on alignment and integers on divisibility, so a batch of other lengths
    would otherwise meet another compile of the same kernel."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = build_chunk_meta(starts, CHUNK, "cpu")
    for t in (meta.chunk_start, meta.chunk_len, meta.row_chunk):
        assert t.data_ptr() % 16 == 0
    T, H = starts[-1], 3
    dt = torch.randn(T, H)
    dt_buf, cs_buf = triton_ssd.chunk_dt_cumsum_triton(dt, -torch.rand(H), torch.zeros(H), DT_MIN, meta)
    assert dt_buf.shape == cs_buf.shape == (H, max(T, 1))
    assert dt_buf.stride(0) % 16 == 0 and cs_buf.stride(0) % 16 == 0


def test_dispatch_picks_the_kernel_when_forced():
    x = torch.zeros(1)
    assert resolve_kernels("auto", x.device).chunk_scan is mamba_chunk_scan_varlen  # CPU tensor: the reference
    assert resolve_kernels("triton", x.device).chunk_scan is mamba_chunk_scan_varlen_triton


# ---- argument checks (shapes only; no device reads when chunk_meta is given) ---------------------------


def test_bad_args_raise():
    fn = "mamba_chunk_scan_varlen_triton"
    params, tok = make_params(), make_tokens(sum(LENGTHS), torch.float32)
    pool, meta = make_pool(torch.float32), make_rows(LENGTHS, SLOTS, HAS_INIT)
    kernel = mamba_chunk_scan_varlen_triton
    with pytest.raises(ValueError, match=rf"{fn}: B expected shape \[T, G, N\] = \(\d+, 2, 16\), got"):
        call(kernel, dict(tok, B=tok["B"][..., :3]), params, pool, meta)
    with pytest.raises(ValueError, match=rf"{fn}: dt expected shape \[T, H\]"):
        call(kernel, dict(tok, dt=tok["dt"][:-1]), params, pool, meta)
    with pytest.raises(ValueError, match=rf"{fn}: ssm_state expected shape"):
        call(kernel, tok, params, pool[:, :, :4], meta)
    with pytest.raises(ValueError, match=rf"{fn}: A expected shape \[H\] = \(4,\), got \(2,\)"):
        call(kernel, tok, dict(params, A=params["A"][:2]), pool, meta)
    with pytest.raises(ValueError, match=rf"{fn}: has_initial_state expected shape \[R\]"):
        call(kernel, tok, params, pool, dict(meta, has_initial_state=meta["has_initial_state"][:2]))
    with pytest.raises(ValueError, match=rf"{fn}: query_start_loc expected shape \[R\+1\]"):
        call(kernel, tok, params, pool, dict(meta, query_start_loc=meta["query_start_loc"][:-1]))
    with pytest.raises(ValueError, match="multiple of G"):
        call(kernel, make_tokens(sum(LENGTHS), torch.float32, groups=3), params, pool, meta)
    with pytest.raises(ValueError, match=rf"{fn}: expected chunk_size > 0, got 0"):
        call(kernel, tok, params, pool, meta, chunk_size=0)
    with pytest.raises(ValueError, match=rf"{fn}: state_slots expected an integer tensor"):
        call(kernel, tok, params, pool, dict(meta, state_slots=meta["state_slots"].float()))
    with pytest.raises(ValueError, match=rf"{fn}: query_start_loc expected non-decreasing from 0 to T"):
        call(kernel, tok, params, pool, dict(meta, query_start_loc=meta["query_start_loc"] // 2))
    with pytest.raises(ValueError, match=rf"{fn}: query_start_loc expected non-decreasing from 0 to T"):
        call(kernel, tok, params, pool, dict(meta, query_start_loc=meta["query_start_loc"].flip(0)))
    with pytest.raises(ValueError, match=rf"{fn}: block_m expected a power of two >= 16, got 24"):
        call(kernel, tok, params, pool, meta, block_m=24)
    with pytest.raises(ValueError, match=rf"{fn}: cb_dtype expected float32, float16 or bfloat16"):
        call(kernel, tok, params, pool, meta, cb_dtype=torch.int32)
    wrong = build_chunk_meta(meta["query_start_loc"].tolist(), 2 * CHUNK, "cpu")
    expected = rf"\(num_tokens, num_rows, chunk_size\) = \({sum(LENGTHS)}, 6, {CHUNK}\), got .*{2 * CHUNK}\)"
    with pytest.raises(ValueError, match=rf"{fn}: chunk_meta expected {expected}"):
        call(kernel, tok, params, pool, meta, chunk_meta=wrong)


# ---- GPU: 8B-like layer size, compiled kernels -----------------------------------------------------------

FULL = dict(heads=128, head_dim=64, state=128, groups=8)
FULL_CHUNK = 128  # the 8b-like preset's chunk_size (engine/make_model.py)
GPU_DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-3, 1e-3, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 1e-1, 5e-2, id="bf16-fp32pool"),
    pytest.param(torch.bfloat16, torch.bfloat16, 1e-1, 5e-2, id="bf16-bf16pool"),
]


def _full_case(lengths, dtype, pool_dtype, seed=0, device="cuda"):
    """Params, tokens, a pool of 2R slots and row metadata (every other row with initial state) on CUDA
    (or `device`)."""
    R = len(lengths)
    dims = dict(heads=FULL["heads"], head_dim=FULL["head_dim"], state=FULL["state"])
    params = make_params(FULL["heads"], seed=seed, device=device)
    tok = make_tokens(sum(lengths), dtype, groups=FULL["groups"], seed=seed + 1, device=device, **dims)
    pool = make_pool(pool_dtype, slots=2 * R, seed=seed + 2, device=device, **dims)
    slots = torch.randperm(2 * R, generator=torch.Generator().manual_seed(seed))[:R].tolist()
    meta = make_rows(lengths, slots, [r % 2 == 0 for r in range(R)], device=device)
    return params, tok, pool, meta


@pytest.mark.gpu
@pytest.mark.parametrize("share_cb", SHARE_CB)
@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize(
    "lengths", [[8192], [3000, 1, 4000, 0, 1191], [FULL_CHUNK - 1, FULL_CHUNK, FULL_CHUNK + 1]]
)
def test_gpu_full_size(lengths, dtype, pool_dtype, atol, rtol, share_cb):
    params, tok, pool, meta = _full_case(lengths, dtype, pool_dtype)
    before = pool.clone()
    y, y_ref, ref_pool = run_both(tok, params, pool, meta, FULL_CHUNK, share_cb=share_cb)
    close(y, y_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    assert_untouched(pool, before, meta["state_slots"].tolist())


@pytest.mark.gpu
@pytest.mark.parametrize("share_cb", SHARE_CB)
def test_gpu_chunk_256_and_layer_like_views(share_cb):
    """Chunks of 256 tokens; x, B, C sliced out of one [T, conv_dim] tensor and dt out of a wider one, as
    the Mamba2 layer passes them."""
    lengths = [3000, 255, 4937]
    T, heads, head_dim, state, groups = (
        sum(lengths),
        FULL["heads"],
        FULL["head_dim"],
        FULL["state"],
        FULL["groups"],
    )
    params, _, pool, meta = _full_case(lengths, torch.bfloat16, torch.float32)
    g = torch.Generator(device="cuda").manual_seed(5)
    xbc = torch.randn(T, heads * head_dim + 2 * groups * state, generator=g, device="cuda").bfloat16()
    wide_dt = torch.randn(T, 3 * heads, generator=g, device="cuda").bfloat16()
    x, B, C = xbc.split([heads * head_dim, groups * state, groups * state], dim=-1)
    tok = dict(x=x.view(T, heads, head_dim), dt=wide_dt[:, heads : 2 * heads], B=B.view(T, groups, state),
               C=C.view(T, groups, state))  # fmt: skip
    y, y_ref, ref_pool = run_both(tok, params, pool, meta, 256, share_cb=share_cb)
    close(y, y_ref, 1e-1, 5e-2)
    close(pool, ref_pool, 1e-1, 5e-2)


@pytest.mark.gpu
def test_gpu_shared_cb_matches_per_head_cb():
    """The compiled shared-CB path against the per-head one at full size: the same products up to the
    tensor cores' accumulation order (exact equality is not promised across two kernels, and one ulp of
    C·B can flip the 16-bit rounding of a decayed term, so the reference's tolerances)."""
    params, tok, pool, meta = _full_case([3000, 1, 4000, 0, 1191], torch.bfloat16, torch.float32)
    pool_per_head = pool.clone()
    y = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, FULL_CHUNK, share_cb=True)
    y_per_head = call(
        mamba_chunk_scan_varlen_triton, tok, params, pool_per_head, meta, FULL_CHUNK, share_cb=False
    )
    close(y, y_per_head, 1e-1, 5e-2)
    assert torch.equal(pool, pool_per_head)  # the state launch is the same in both


@pytest.mark.gpu
def test_gpu_chunk_meta_given_equals_built():
    params, tok, pool, meta = _full_case([2000, 6192], torch.bfloat16, torch.float32)
    pool_given = pool.clone()
    y_built = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, FULL_CHUNK)
    chunk_meta = build_chunk_meta(meta["query_start_loc"].tolist(), FULL_CHUNK, "cuda")
    y_given = call(
        mamba_chunk_scan_varlen_triton, tok, params, pool_given, meta, FULL_CHUNK, chunk_meta=chunk_meta
    )
    assert torch.equal(y_given, y_built)
    assert torch.equal(pool_given, pool)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(state_block_p=32), dict(state_block_p=16, block_n=64)])
def test_gpu_loaded_chunks_and_state_blocks_equal_the_defaults(monkeypatch, options):
    """The state kernel's knobs, compiled and checked at full size on varlen rows with an empty one: chunk starts
    loaded from the metadata (STATE_AFFINE off) give the default's (affine) bits; a smaller state_block_p / block_n
    agrees to a few ulps."""
    params, tok, pool, meta = _full_case([3000, 1, 4000, 0, 1191], torch.bfloat16, torch.float32)
    pools = {k: pool.clone() for k in ("default", "loaded", "blocks")}
    y = call(mamba_chunk_scan_varlen_triton, tok, params, pools["default"], meta, FULL_CHUNK)
    y_blocks = call(mamba_chunk_scan_varlen_triton, tok, params, pools["blocks"], meta, FULL_CHUNK, **options)
    monkeypatch.setattr(triton_ssd, "STATE_AFFINE", not triton_ssd.STATE_AFFINE)
    y_loaded = call(mamba_chunk_scan_varlen_triton, tok, params, pools["loaded"], meta, FULL_CHUNK)
    assert torch.equal(y_loaded, y) and torch.equal(pools["loaded"], pools["default"])
    close(y_blocks, y, 2e-2, 2e-2)
    close(pools["blocks"], pools["default"], 1e-4, 1e-4)


def bench_ssd(tokens: int = 8192, rows: int = 4, dtype: torch.dtype = torch.bfloat16,
              pool_dtype: torch.dtype = torch.float32, chunk_size: int = FULL_CHUNK, warmup: int = 5,
              iters: int = 50, **options) -> float:  # fmt: skip
    """Time one Triton chunked scan of `tokens` tokens in `rows` equal-ish rows (all with initial state)
    at the 8B-like layer size (H=128, P=64, N=128, G=8) on CUDA, chunk_meta built beforehand as the runner
    does. `options` go to the op (block_p, block_n, block_m, block_k, share_cb, cb_dtype): e.g.
    bench_ssd(share_cb=False) times the per-head C·B path against the default shared one. Returns
    microseconds per call, from CUDA events."""
    lengths = [tokens // rows + (r < tokens % rows) for r in range(rows)]
    params, tok, pool, meta = _full_case(lengths, dtype, pool_dtype)
    meta["has_initial_state"].fill_(True)
    chunk_meta = build_chunk_meta(meta["query_start_loc"].tolist(), chunk_size, "cuda")

    def run():
        call(
            mamba_chunk_scan_varlen_triton,
            tok,
            params,
            pool,
            meta,
            chunk_size,
            chunk_meta=chunk_meta,
            **options,
        )

    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


@pytest.mark.gpu
@pytest.mark.parametrize("share_cb", SHARE_CB)
def test_gpu_bench_ssd_runs(share_cb):
    assert bench_ssd(tokens=1024, rows=2, warmup=1, iters=3, share_cb=share_cb) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_kernel_block_of_p_apart_from_the_output_kernels(dtype):
    """state_block_p tiles only the state kernel's [P, N] state (P = 64 here: 4 programs per head at 16, 1 at
    64), block_p only the output kernel's. Each element sums the same terms whatever the block (a dot's summation
    order may follow the tile's shape): y and the final states agree to a few ulps; a bad value is refused."""
    dims = dict(heads=2, head_dim=64, state=16)
    params, tok = make_params(2), make_tokens(sum(LENGTHS), dtype, groups=1, **dims)
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)
    runs = [(32, {}), (32, dict(state_block_p=16)), (32, dict(state_block_p=64)), (64, dict(state_block_p=16))]
    out = []
    for bp, kw in runs:
        pool = make_pool(torch.float32, **dims)
        y = call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta, block_p=bp, block_n=16, block_m=16,
                 block_k=16, **kw)
        out.append((y, pool))
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 y: one rounding step either way
    for y, pool in out[1:]:
        close(y, out[0][0], tol, tol)
        close(pool, out[0][1], 1e-5, 1e-5)
    with pytest.raises(ValueError, match="state_block_p expected a power of two >= 16, got 24"):
        call(mamba_chunk_scan_varlen_triton, tok, params, make_pool(torch.float32, **dims), meta, state_block_p=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_affine_chunk_addresses_equal_the_loaded_ones(monkeypatch, dtype):
    """STATE_AFFINE (chunk starts computed from the row's first, not loaded per chunk) walks the same chunks: over
    rows shorter than, equal to and longer than a chunk, an empty row and a partial last chunk, y and the pool come
    out bit-identical, and both match the reference."""
    params, tok = make_params(), make_tokens(sum(LENGTHS), dtype)
    meta = make_rows(LENGTHS, SLOTS, HAS_INIT)
    out = {}
    for affine in (False, True):
        monkeypatch.setattr(triton_ssd, "STATE_AFFINE", affine)
        pool = make_pool(torch.float32)
        out[affine] = (call(mamba_chunk_scan_varlen_triton, tok, params, pool, meta), pool)
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    pool = make_pool(torch.float32)
    y_ref = call(mamba_chunk_scan_varlen, tok, params, pool, meta)
    atol, rtol = (1e-4, 1e-4) if dtype == torch.float32 else (5e-2, 2e-2)  # DTYPES' tolerances
    close(out[True][0], y_ref, atol, rtol)
    close(out[True][1], pool, atol, rtol)


def test_state_launch_by_how_many_programs_the_gpu_holds_at_once():
    """The state kernel's default launch (8b-like layer: H 128, P 64, N 128, block_n 128). On a 132-SM GPU one row's
    128 wide programs fit one per SM: the wide block with the one-wave warps and stages. Two rows' 256 do not, while
    their 512 narrow ones do not fit two per SM either: the wide block at the default warps and stages. The narrow
    block where its programs fit two per SM but not one per SM (P of at most one narrow block), or where the device's
    shared memory per program cannot hold the one-wave pipeline. No GPU (sms None): the narrow block. The tiles passed to the kernels follow it; a state_block_p given runs at the
    default warps and stages."""
    pick = triton_ssd.default_state_launch
    narrow = triton_ssd.StateLaunch(triton_ssd.STATE_BLOCK_P, triton_ssd.STATE_WARPS, triton_ssd.STATE_STAGES)
    wide = triton_ssd.StateLaunch(triton_ssd.STATE_BLOCK_P_WIDE, triton_ssd.STATE_WARPS, triton_ssd.STATE_STAGES)
    one_wave = triton_ssd.StateLaunch(triton_ssd.STATE_BLOCK_P_WIDE, triton_ssd.STATE_ONE_WAVE_WARPS,
                                      triton_ssd.STATE_ONE_WAVE_STAGES)
    assert narrow.block_p < wide.block_p and one_wave != wide
    assert pick(1, 128, 64, 128, 128, 132) == one_wave
    assert pick(2, 128, 64, 128, 128, 132) == wide
    assert pick(16, 128, 64, 128, 128, 132) == wide
    assert pick(2, 128, 64, 128, 128, 264) == one_wave  # twice the SMs: 256 wide programs fit
    assert pick(2, 128, 32, 128, 128, 132) == narrow  # P 32, one block either way: 256 programs, two per SM
    assert pick(2, 128, 64, 128, 64, 132) == wide  # two blocks of N: 512 wide programs
    assert pick(16, 128, 64, 128, 128, None) == narrow
    # The one-wave pipeline (~150 KB) needs a device that gives a program that much shared memory: an H100 / H200
    # gives 227 KB, an Ada card 99 KB (there one row keeps the narrow block).
    assert pick(1, 128, 64, 128, 128, 132, 128, 232_448) == one_wave
    assert pick(1, 128, 64, 128, 128, 128, 128, 101_376) == narrow
    assert pick(1, 128, 64, 128, 128, 132, 256, 232_448) == narrow  # chunks of 256: twice the tiles
    tiles = triton_ssd._tiles(False, 64, 128, 128, None, None, None, None, None, rows=1, H=128, sms=132)
    assert (tiles.state_block_p, tiles.state_warps, tiles.state_stages) == (one_wave.block_p, one_wave.warps,
                                                                            one_wave.stages)
    assert triton_ssd._tiles(False, 64, 128, 128, None, None, None, None, None, rows=2, H=128, sms=132).state_block_p == wide.block_p
    given = triton_ssd._tiles(False, 64, 128, 128, None, None, None, None, 16, rows=1, H=128, sms=132)
    assert (given.state_block_p, given.state_warps, given.state_stages) == (16, narrow.warps, narrow.stages)
    assert triton_ssd._tiles(True, 64, 128, 128, None, None, None, None, None, rows=2, H=128, sms=132).state_block_p == narrow.block_p
    assert triton_ssd._tiles(False, 16, 128, 128, None, None, None, None, None, rows=2, H=128, sms=132).state_block_p == 16


def test_shared_memory_per_block_reads_the_opt_in_limit(monkeypatch):
    """The state launch's shared-memory check reads torch's opt-in limit per program (227 KB on an H100 / H200); a
    build without the property reads 0, so the one-wave launch is never taken there."""
    from types import SimpleNamespace

    from baton.engine.ops import triton_common

    props = {0: SimpleNamespace(shared_memory_per_block_optin=232_448), 1: SimpleNamespace()}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props[index])
    triton_common._shared_memory_of.cache_clear()
    try:
        assert triton_common.shared_memory_per_block(torch.device("cuda", 0)) == 232_448
        assert triton_common.shared_memory_per_block(torch.device("cuda", 1)) == 0
        assert triton_ssd.default_state_launch(1, 128, 64, 128, 128, 132, 128, 0).block_p == triton_ssd.STATE_BLOCK_P
    finally:
        triton_common._shared_memory_of.cache_clear()
