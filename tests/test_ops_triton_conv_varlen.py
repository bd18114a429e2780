"""Triton varlen (prefill) causal conv1d kernel against its torch reference `causal_conv1d_varlen`.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; the `gpu` tests run it compiled at
the full size of an 8B-like layer. `bench_conv_varlen` is the timing helper for a benchmark script.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the first import of triton (and of the kernel's module).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.make_model import build_config  # noqa: E402
from baton.engine.ops.conv.kernel_varlen import causal_conv1d_varlen_triton  # noqa: E402
from baton.engine.ops.conv.reference import causal_conv1d_varlen  # noqa: E402
from tests.test_ops_triton_conv import DTYPES, WIDTHS, make_layer, make_x  # noqa: E402, F401
from tests.test_ops_triton_conv import make_pool as make_pool_of  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHANNELS, NUM_SLOTS = 24, 12
def make_pool(width, dtype, num_slots=NUM_SLOTS, **kwargs):
    return make_pool_of(width, dtype, num_slots=num_slots, **kwargs)


def idx(values, dtype=torch.int64, device=DEVICE):
    return torch.tensor(values, dtype=dtype, device=device)


def qsl(lengths, dtype=torch.int64, device=DEVICE):
    return idx([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype, device)


def assert_same(actual, expected):
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


def batch_case(width):
    """Rows of length 1, 2, K-1, K and 17, mixed, with and without initial state, on scattered slots."""
    lengths = [1, 17, width - 1, 2, width, 1, 3]
    slots = [7, 2, 11, 0, 4, 9, 5]
    has_init = [True, False, True, False, True, False, True]
    return lengths, slots, has_init


def run_both(x, weight, bias, pool, lengths, slots, has_init, **blocks):
    """Reference on a copy of the pool, kernel on the pool itself; returns (y_ref, ref_pool, y)."""
    ref_pool = pool.clone()
    args = (qsl(lengths), idx(slots), idx(has_init, torch.bool))
    y_ref = causal_conv1d_varlen(x, weight, bias, ref_pool, *args)
    y = causal_conv1d_varlen_triton(x, weight, bias, pool, *args, **blocks)
    return y_ref, ref_pool, y


@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_varlen_matches_reference(dtype, pool_dtype, atol, rtol, width, with_bias):
    weight, bias = make_layer(width, dtype, with_bias)
    lengths, slots, has_init = batch_case(width)
    x = make_x((sum(lengths), CHANNELS), dtype)
    pool = make_pool(width, pool_dtype)
    # Small tiles: rows straddle token blocks, and the channels span two blocks (the last one partial).
    y_ref, ref_pool, y = run_both(x, weight, bias, pool, lengths, slots, has_init, block_t=8, block_c=16)

    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    # Equal pools: the rows' slots hold the same final windows and every other slot is untouched.
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("width", WIDTHS)
def test_default_tiles_and_untouched_slots(width):
    weight, bias = make_layer(width, torch.bfloat16)
    lengths, slots, has_init = batch_case(width)
    x = make_x((sum(lengths), CHANNELS), torch.bfloat16)
    pool = make_pool(width, torch.bfloat16)
    before = pool.clone()
    y_ref, ref_pool, y = run_both(x, weight, bias, pool, lengths, slots, has_init)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots]
    assert_same(pool[untouched], before[untouched])


@pytest.mark.parametrize("width", WIDTHS)
def test_rows_without_initial_state_never_read_their_slot(width):
    """Slots of rows without initial state hold NaN: the outputs stay finite and equal a zero-state run."""
    weight, bias = make_layer(width, torch.float32)
    lengths, slots, has_init = batch_case(width)
    x = make_x((sum(lengths), CHANNELS), torch.float32)
    pool_nan = make_pool(width, torch.float32)
    pool_zero = pool_nan.clone()
    fresh = [s for s, init in zip(slots, has_init, strict=True) if not init]
    pool_nan[fresh] = float("nan")
    pool_zero[fresh] = 0.0
    args = (qsl(lengths), idx(slots))
    y_nan = causal_conv1d_varlen_triton(
        x, weight, bias, pool_nan, *args, idx(has_init, torch.bool), block_t=8
    )
    y_zero = causal_conv1d_varlen_triton(
        x, weight, bias, pool_zero, *args, idx([True] * len(slots), torch.bool), block_t=8
    )
    assert torch.isfinite(y_nan).all()
    assert_same(y_nan, y_zero)
    assert_same(pool_nan, pool_zero)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("split", [1, 2, 3, 9])
def test_chunked_prefill_continuity(width, split):
    """A row convolved in two calls (the second resuming from the pool) equals one call bit for bit (bf16
    inputs and pool, so the stored window is exact); the other row's slot gets the same window."""
    weight, bias = make_layer(width, torch.bfloat16)
    total = 13
    x = make_x((total + 5, CHANNELS), torch.bfloat16)
    pool_one = make_pool(width, torch.bfloat16)
    pool_two = pool_one.clone()
    y_one = causal_conv1d_varlen_triton(
        x, weight, bias, pool_one, qsl([total, 5]), idx([3, 8]), idx([False, True], torch.bool)
    )

    first = torch.cat([torch.arange(split), torch.arange(total, total + 5)]).to(DEVICE)
    y_a = causal_conv1d_varlen_triton(
        x[first], weight, bias, pool_two, qsl([split, 5]), idx([3, 8]), idx([False, True], torch.bool)
    )
    y_b = causal_conv1d_varlen_triton(
        x[split:total], weight, bias, pool_two, qsl([total - split]), idx([3]), idx([True], torch.bool)
    )
    assert_same(y_a[:split], y_one[:split])
    assert_same(y_b, y_one[split:total])
    assert_same(pool_two, pool_one)


@pytest.mark.parametrize("seed", [0, 1])
def test_many_random_rows(seed):
    """20 rows of random lengths (a deeper binary search of query_start_loc), random initial state."""
    g = torch.Generator().manual_seed(seed)
    rows, num_slots = 20, 32
    lengths = torch.randint(1, 10, (rows,), generator=g).tolist()
    slots = torch.randperm(num_slots, generator=g)[:rows].tolist()
    has_init = (torch.rand(rows, generator=g) < 0.5).tolist()
    weight, bias = make_layer(3, torch.bfloat16, seed=seed)
    x = make_x((sum(lengths), CHANNELS), torch.bfloat16, seed=seed)
    pool = make_pool(3, torch.bfloat16, num_slots=num_slots, seed=seed)
    y_ref, ref_pool, y = run_both(x, weight, bias, pool, lengths, slots, has_init, block_t=16)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)


def test_strided_views_int32_metadata():
    """x sliced out of a wider projection, a transposed weight, int32 metadata and an integer
    has_initial_state need no copies."""
    width = 4
    weight_t, bias = make_layer(width, torch.float32)
    weight = weight_t.T.contiguous().T  # [C, K] with strides (1, C)
    lengths, slots, has_init = batch_case(width)
    proj = make_x((sum(lengths), 3 * CHANNELS), torch.float32)
    x = proj[:, CHANNELS : 2 * CHANNELS]
    pool = make_pool(width, torch.float32)
    ref_pool = pool.clone()
    y_ref = causal_conv1d_varlen(
        x, weight, bias, ref_pool, qsl(lengths), idx(slots), idx(has_init, torch.bool)
    )
    y = causal_conv1d_varlen_triton(
        x, weight, bias, pool, qsl(lengths, torch.int32), idx(slots, torch.int32), idx(has_init, torch.int32)
    )
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("width", WIDTHS)
def test_empty_rows(width):
    """An empty row (which the reference does not accept) writes its initial window back, or zeros."""
    weight, bias = make_layer(width, torch.float32)
    pool = make_pool(width, torch.float32)
    pool_ref = pool.clone()
    x = make_x((7, CHANNELS), torch.float32)
    pool[6] = float("nan")  # the fresh empty row's slot: never read, zeroed
    y = causal_conv1d_varlen_triton(
        x,
        weight,
        bias,
        pool,
        qsl([0, 3, 0, 4, 0]),
        idx([1, 2, 6, 3, 5]),
        idx([True, True, False, False, True], torch.bool),
        block_t=4,
    )
    y_ref = causal_conv1d_varlen(
        x, weight, bias, pool_ref, qsl([3, 4]), idx([2, 3]), idx([True, False], torch.bool)
    )
    pool_ref[6] = 0.0
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_same(pool, pool_ref)


def test_single_long_row_and_no_rows():
    weight, bias = make_layer(4, torch.float16)
    x = make_x((70, CHANNELS), torch.float16)
    pool = make_pool(4, torch.float16)
    y_ref, ref_pool, y = run_both(x, weight, bias, pool, [70], [10], [True])
    torch.testing.assert_close(y, y_ref, atol=2e-3, rtol=2e-3)
    assert_same(pool, ref_pool)

    before = pool.clone()
    empty = causal_conv1d_varlen_triton(x[:0], weight, bias, pool, qsl([]), idx([]), idx([], torch.bool))
    assert empty.shape == (0, CHANNELS)
    assert_same(pool, before)


def test_shape_and_dtype_errors():
    weight, bias = make_layer(4, torch.float32)
    x = make_x((5, CHANNELS), torch.float32)
    pool = make_pool(4, torch.float32)
    meta = (qsl([2, 3]), idx([0, 1]), idx([False, True], torch.bool))
    fn = causal_conv1d_varlen_triton
    with pytest.raises(ValueError, match=r"kernel width K in \[2, 4\]"):
        fn(x, make_layer(5, torch.float32)[0], bias, make_pool(5, torch.float32), *meta)
    with pytest.raises(ValueError, match=r"kernel width K in \[2, 4\]"):
        fn(x, make_layer(1, torch.float32)[0], bias, make_pool(1, torch.float32), *meta)
    with pytest.raises(ValueError, match=r"weight expected shape \[C, K\]"):
        fn(x, weight[:4], bias, pool, *meta)
    with pytest.raises(ValueError, match=r"conv_state expected shape \[S, C, K-1\]"):
        fn(x, weight, bias, pool[:, :, :2], *meta)
    with pytest.raises(ValueError, match=r"bias expected shape \[C\]"):
        fn(x, weight, bias[:3], pool, *meta)
    with pytest.raises(ValueError, match=r"expected x \[T, C\]"):
        fn(x[None], weight, bias, pool, *meta)
    with pytest.raises(ValueError, match=r"query_start_loc expected shape \[R\+1\]"):
        fn(x, weight, bias, pool, qsl([5]), *meta[1:])
    with pytest.raises(ValueError, match=r"has_initial_state expected shape \[R\]"):
        fn(x, weight, bias, pool, *meta[:2], idx([True], torch.bool))
    with pytest.raises(ValueError, match="state_slots expected an integer tensor"):
        fn(x, weight, bias, pool, meta[0], meta[1].float(), meta[2])
    with pytest.raises(ValueError, match="has_initial_state expected a bool or integer tensor"):
        fn(x, weight, bias, pool, *meta[:2], meta[2].float())
    with pytest.raises(ValueError, match="x expected float32"):
        fn(x.long(), weight, bias, pool, *meta)
    with pytest.raises(ValueError, match="block_t expected a power of two"):
        fn(x, weight, bias, pool, *meta, block_t=24)


# ---- full size on GPU ----------------------------------------------------------------------------

_8B = ModelConfig.from_hf_dict(build_config("8b-like"))
CONV_DIM, CONV_WIDTH = _8B.conv_dim, _8B.conv_kernel  # 10240, 4
FULL_LENGTHS = [3000, 1, 2048, 3, 3140]  # 8192 tokens


def full_size_case(lengths, dtype, pool_dtype, seed=0):
    """Inputs of one 8B-like layer on CUDA: rows on scattered slots, every other one with initial state."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = make_layer(CONV_WIDTH, dtype, channels=CONV_DIM, device="cuda")
    num_slots = 4 * len(lengths)
    pool = make_pool(CONV_WIDTH, pool_dtype, num_slots=num_slots, channels=CONV_DIM, device="cuda")
    slots = torch.randperm(num_slots, generator=g)[: len(lengths)].cuda()
    has_init = (torch.arange(len(lengths)) % 2 == 0).cuda()
    x = make_x((sum(lengths), CONV_DIM), dtype, device="cuda")
    return x, weight, bias, pool, qsl(lengths, device="cuda"), slots, has_init


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16pool", "fp32pool"])
def test_gpu_full_size_varlen(pool_dtype):
    x, weight, bias, pool, starts, slots, has_init = full_size_case(FULL_LENGTHS, torch.bfloat16, pool_dtype)
    ref_pool = pool.clone()
    y_ref = causal_conv1d_varlen(x, weight, bias, ref_pool, starts, slots, has_init)
    y = causal_conv1d_varlen_triton(x, weight, bias, pool, starts, slots, has_init)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)


def bench_conv_varlen(
    tokens,
    rows=4,
    dtype=torch.bfloat16,
    pool_dtype=torch.bfloat16,
    channels=CONV_DIM,
    width=CONV_WIDTH,
    iters=50,
    warmup=5,
    block_t=None,
    block_c=None,
):
    """Time one Triton varlen conv of `tokens` tokens split into `rows` equal-ish rows (all with initial
    state) on CUDA; returns (ms per call, GB/s of compulsory traffic: x, y, weight, bias, the initial
    windows read and the final windows stored)."""
    lengths = [tokens // rows + (r < tokens % rows) for r in range(rows)]
    weight, bias = make_layer(width, dtype, channels=channels, device="cuda")
    num_slots = 2 * rows
    pool = make_pool(width, pool_dtype, num_slots=num_slots, channels=channels, device="cuda")
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_slots, generator=g)[:rows].cuda()
    has_init = torch.ones(rows, dtype=torch.bool, device="cuda")
    starts = qsl(lengths, device="cuda")
    x = make_x((tokens, channels), dtype, device="cuda")

    def call():
        causal_conv1d_varlen_triton(
            x, weight, bias, pool, starts, slots, has_init, block_t=block_t, block_c=block_c
        )

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
    nbytes = (
        2 * tokens * channels * x.element_size()  # x in, y out
        + channels * (width + 1) * weight.element_size()  # weight, bias
        + 2 * rows * channels * (width - 1) * pool.element_size()  # initial windows in, final windows out
    )
    return ms, nbytes / (ms * 1e-3) / 1e9


@pytest.mark.gpu
def test_gpu_bench_conv_varlen_runs():
    ms, gbps = bench_conv_varlen(8192, iters=5, warmup=2)
    assert ms > 0 and gbps > 0
