"""Triton causal conv1d update kernels (decode and speculative verify) against their torch references.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors; the `gpu` tests run them compiled
at the full size of a Nemotron-H-8B layer. `bench_conv` is the timing helper of the benchmark script.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (and of the kernels' module).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")

from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.make_model import build_config  # noqa: E402
from baton.engine.ops.causal_conv1d import causal_conv1d_update  # noqa: E402
from baton.engine.ops.spec_state_update import causal_conv1d_update_multi  # noqa: E402
from baton.engine.ops.triton_conv import (  # noqa: E402
    causal_conv1d_update_multi_triton,
    causal_conv1d_update_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, CHANNELS, NUM_SLOTS = 3, 24, 16
WIDTHS = [2, 3, 4]

# (x and weight dtype, pool dtype, atol, rtol). The pool holds raw inputs rounded to its dtype, so it is
# compared bit for bit; the output may differ from the reference by the fp32 summation order (FMA on
# GPU), i.e. by one rounding of the output dtype.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, 1e-2, 1e-2, id="bf16"),
    pytest.param(torch.float16, torch.float16, 2e-3, 2e-3, id="fp16"),
    pytest.param(torch.bfloat16, torch.float32, 1e-2, 1e-2, id="bf16-fp32pool"),
    pytest.param(torch.float32, torch.bfloat16, 1e-5, 1e-5, id="fp32-bf16pool"),
]


def make_layer(width, dtype, with_bias=True, channels=CHANNELS, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(channels, width, generator=g) / width**0.5).to(device, dtype)  # [C, K]
    bias = torch.randn(channels, generator=g).to(device, dtype) if with_bias else None  # [C]
    return weight, bias


def make_pool(width, dtype, num_slots=NUM_SLOTS, channels=CHANNELS, seed=1, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, channels, width - 1, generator=g).to(device, dtype)  # [S, C, K-1]


def make_x(shape, dtype, seed=2, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


def idx(values, device=DEVICE):
    return torch.tensor(values, dtype=torch.int64, device=device)


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


# ---- decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_update_matches_reference(dtype, pool_dtype, atol, rtol, width, with_bias):
    weight, bias = make_layer(width, dtype, with_bias)
    x = make_x((BATCH, CHANNELS), dtype)
    pool = make_pool(width, pool_dtype)
    ref_pool = pool.clone()
    slots = idx([11, 2, 7])

    y_ref = causal_conv1d_update(x, weight, bias, ref_pool, slots)
    y = causal_conv1d_update_triton(x, weight, bias, pool, slots)

    assert y.shape == (BATCH, CHANNELS) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    # Equal pools: the rows' slots hold the same windows and every other slot is untouched.
    assert_same(pool, ref_pool)


def test_update_strided_views_and_int32_slots():
    """x sliced out of a wider projection, a transposed weight and int32 slots need no copies."""
    width = 4
    weight_t, bias = make_layer(width, torch.float32)
    weight = weight_t.T.contiguous().T  # [C, K] with strides (1, C)
    proj = make_x((BATCH, 3 * CHANNELS), torch.float32)
    x = proj[:, CHANNELS : 2 * CHANNELS]
    pool = make_pool(width, torch.float32)
    ref_pool = pool.clone()
    slots = torch.tensor([4, 0, 15], dtype=torch.int32, device=DEVICE)

    y_ref = causal_conv1d_update(x, weight, bias, ref_pool, slots)
    y = causal_conv1d_update_triton(x, weight, bias, pool, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_same(pool, ref_pool)


def test_update_steps_continue_from_pool():
    """Several decode steps in a row equal the reference's steps (each reads what the last one stored)."""
    weight, bias = make_layer(4, torch.bfloat16)
    pool = make_pool(4, torch.bfloat16)
    ref_pool = pool.clone()
    slots = idx([3, 9, 1])
    for step in range(5):
        x = make_x((BATCH, CHANNELS), torch.float32, seed=10 + step)
        y_ref = causal_conv1d_update(x, weight, bias, ref_pool, slots)
        y = causal_conv1d_update_triton(x, weight, bias, pool, slots)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
        assert_same(pool, ref_pool)


# ---- speculative verify --------------------------------------------------------------------------


def verify_slots(T, short):
    """src [B], dst [B, T], num_tokens [B] or None: scattered slots; row 1 resumes from one of its own dst
    slots; with `short`, rows stop early and their dst rows are padded with -1 past num_tokens."""
    src = [13, 5, 0]
    dst = [[2, 3, 6, 7][:T], [5, 8, 12, 15][:T], [1, 4, 10, 14][:T]]
    if T > 1:
        dst[1][0], dst[1][T - 1] = dst[1][T - 1], 5  # the source is overwritten by the last position
    if not short:
        return src, dst, None
    num_tokens = [T, 1, max(1, T - 1)]
    dst = [[s if t < n else -1 for t, s in enumerate(row)] for row, n in zip(dst, num_tokens, strict=True)]
    return src, dst, num_tokens


@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("short", [False, True], ids=["full", "short"])
def test_multi_matches_reference(dtype, pool_dtype, atol, rtol, width, T, short):
    with_bias = (T + width) % 2 == 0  # half the cases without bias
    weight, bias = make_layer(width, dtype, with_bias)
    x = make_x((BATCH, T, CHANNELS), dtype, seed=T)
    pool = make_pool(width, pool_dtype)
    ref_pool = pool.clone()
    src, dst, num_tokens = verify_slots(T, short)
    args = (idx(src), idx(dst), None if num_tokens is None else idx(num_tokens))

    y_ref = causal_conv1d_update_multi(x, weight, bias, ref_pool, *args)
    y = causal_conv1d_update_multi_triton(x, weight, bias, pool, *args)

    assert y.shape == (BATCH, T, CHANNELS) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    if num_tokens is not None:
        for b, n in enumerate(num_tokens):
            assert (y[b, n:] == 0).all()
    # Equal pools: every valid position's dst slot holds the same window, all other slots untouched.
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("width", WIDTHS)
def test_multi_unnamed_slots_untouched(width):
    T = 3
    weight, bias = make_layer(width, torch.float32)
    x = make_x((BATCH, T, CHANNELS), torch.float32)
    src, dst, num_tokens = verify_slots(T, short=True)
    pool = torch.full((NUM_SLOTS, CHANNELS, width - 1), float("nan"), device=DEVICE)
    pool[src] = make_pool(width, torch.float32)[src]
    y = causal_conv1d_update_multi_triton(x, weight, bias, pool, idx(src), idx(dst), idx(num_tokens))
    named = {s for row in dst for s in row if s >= 0} | set(src)
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        assert torch.isfinite(pool[s]).all() if s in named else torch.isnan(pool[s]).all(), s


def test_multi_single_token_equals_update():
    weight, bias = make_layer(4, torch.bfloat16)
    x = make_x((BATCH, 1, CHANNELS), torch.bfloat16)
    pool_multi = make_pool(4, torch.bfloat16)
    pool_update = pool_multi.clone()
    slots = idx([6, 0, 12])
    y_multi = causal_conv1d_update_multi_triton(x, weight, bias, pool_multi, slots, slots[:, None])
    y_update = causal_conv1d_update_triton(x[:, 0], weight, bias, pool_update, slots)
    assert_same(y_multi[:, 0], y_update)
    assert_same(pool_multi, pool_update)


# ---- argument checks -----------------------------------------------------------------------------


def test_shape_and_dtype_errors():
    weight, bias = make_layer(4, torch.float32)
    x = make_x((BATCH, CHANNELS), torch.float32)
    pool = make_pool(4, torch.float32)
    slots = idx([0, 1, 2])
    with pytest.raises(ValueError, match=r"kernel width K in \[2, 4\]"):
        causal_conv1d_update_triton(x, make_layer(5, torch.float32)[0], bias, make_pool(5, torch.float32), slots)
    with pytest.raises(ValueError, match=r"weight expected shape \[C, K\]"):
        causal_conv1d_update_triton(x, weight[:4], bias, pool, slots)
    with pytest.raises(ValueError, match=r"conv_state expected shape \[S, C, K-1\]"):
        causal_conv1d_update_triton(x, weight, bias, pool[:, :, :2], slots)
    with pytest.raises(ValueError, match=r"bias expected shape \[C\]"):
        causal_conv1d_update_triton(x, weight, bias[:3], pool, slots)
    with pytest.raises(ValueError, match=r"state_slots expected shape \[B\]"):
        causal_conv1d_update_triton(x, weight, bias, pool, slots[:2])
    with pytest.raises(ValueError, match="state_slots expected an integer tensor"):
        causal_conv1d_update_triton(x, weight, bias, pool, slots.float())
    with pytest.raises(ValueError, match=r"expected x \[B, C\]"):
        causal_conv1d_update_triton(x[:, None], weight, bias, pool, slots)
    x3 = x[:, None]
    with pytest.raises(ValueError, match=r"dst_slots expected shape \[B, T\]"):
        causal_conv1d_update_multi_triton(x3, weight, bias, pool, slots, slots)
    with pytest.raises(ValueError, match=r"num_tokens expected shape \[B\]"):
        causal_conv1d_update_multi_triton(x3, weight, bias, pool, slots, slots[:, None], slots[:1])
    with pytest.raises(ValueError, match=r"T >= 1"):
        causal_conv1d_update_multi_triton(x3[:, :0], weight, bias, pool, slots, slots[:, None][:, :0])


# ---- full size on GPU ----------------------------------------------------------------------------

_8B = ModelConfig.from_hf_dict(build_config("8b-like"))
CONV_DIM, CONV_WIDTH = _8B.conv_dim, _8B.conv_kernel  # 10240, 4


def full_size_case(batch, T, dtype, pool_dtype, seed=0):
    """Inputs of one 8B-like layer on CUDA: src slots in the first half of the pool, dst slots (T per row)
    scattered over the second half."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = make_layer(CONV_WIDTH, dtype, channels=CONV_DIM, device="cuda")
    num_slots = 2 * batch * (T + 1)
    pool = make_pool(CONV_WIDTH, pool_dtype, num_slots=num_slots, channels=CONV_DIM, device="cuda")
    half = num_slots // 2
    src = torch.randperm(half, generator=g)[:batch]
    dst = (half + torch.randperm(half, generator=g)[: batch * T]).reshape(batch, T)
    x = make_x((batch, T, CONV_DIM), dtype, device="cuda")
    return x, weight, bias, pool, src.cuda(), dst.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16pool", "fp32pool"])
def test_gpu_full_size_update(batch, pool_dtype):
    x, weight, bias, pool, src, _ = full_size_case(batch, 1, torch.bfloat16, pool_dtype)
    ref_pool = pool.clone()
    y_ref = causal_conv1d_update(x[:, 0], weight, bias, ref_pool, src)
    y = causal_conv1d_update_triton(x[:, 0], weight, bias, pool, src)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("T", [2, 4])
def test_gpu_full_size_multi(batch, T):
    x, weight, bias, pool, src, dst = full_size_case(batch, T, torch.bfloat16, torch.bfloat16)
    dst[0, 0] = src[0]  # a row resuming from one of its own dst slots
    g = torch.Generator().manual_seed(1)
    num_tokens = torch.randint(1, T + 1, (batch,), generator=g).cuda()
    ref_pool = pool.clone()
    y_ref = causal_conv1d_update_multi(x, weight, bias, ref_pool, src, dst, num_tokens)
    y = causal_conv1d_update_multi_triton(x, weight, bias, pool, src, dst, num_tokens)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)


def bench_conv(batch, T=1, dtype=torch.bfloat16, pool_dtype=torch.bfloat16, channels=CONV_DIM,
               width=CONV_WIDTH, iters=100, warmup=10):
    """Time one Triton conv update of `batch` rows (T=1: decode op; T>1: verify op) on CUDA; returns
    (ms per call, GB/s of compulsory traffic: x, y, weight, bias, the source windows and T stored windows
    per row)."""
    g = torch.Generator().manual_seed(0)
    weight, bias = make_layer(width, dtype, channels=channels, device="cuda")
    num_slots = batch * (T + 1)
    pool = make_pool(width, pool_dtype, num_slots=num_slots, channels=channels, device="cuda")
    perm = torch.randperm(num_slots, generator=g).cuda()
    src, dst = perm[:batch], perm[batch:].reshape(batch, T)
    x = make_x((batch, T, channels), dtype, device="cuda")
    if T == 1:
        x1 = x[:, 0]

        def call():
            causal_conv1d_update_triton(x1, weight, bias, pool, src)
    else:

        def call():
            causal_conv1d_update_multi_triton(x, weight, bias, pool, src, dst)

    for _ in range(warmup):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        call()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    xs, ps = x.element_size(), pool.element_size()
    nbytes = (
        2 * batch * T * channels * xs  # x in, y out
        + channels * (width + 1) * weight.element_size()  # weight, bias
        + batch * (1 + T) * channels * (width - 1) * ps  # source window in, T windows out
    )
    return ms, nbytes / (ms * 1e-3) / 1e9


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_bench_conv_runs(T):
    ms, gbps = bench_conv(32, T=T, iters=5, warmup=2)
    assert ms > 0 and gbps > 0
