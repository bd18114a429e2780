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
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.config import ModelConfig  # noqa: E402
from baton.engine.make_model import build_config  # noqa: E402
from baton.engine.ops.conv.kernel import (  # noqa: E402
    causal_conv1d_update_triton,
    causal_conv1d_update_verify_triton,
)
from baton.engine.ops.conv.reference import (  # noqa: E402
    causal_conv1d_update,
    causal_conv1d_update_verify,
)
from tests.cuda_timing import time_call_ms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, CHANNELS, NUM_SLOTS = 3, 24, 16
PENDING = 5  # L: recorded verify inputs per slot (>= the largest T here)
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


# ---- speculative verify (by replay) --------------------------------------------------------------


# (x dtype, pool dtype) where the verify and decode kernels agree bit for bit.
BIT_EXACT_DTYPES = [
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32),
]


def make_pending(dtype, num_slots=NUM_SLOTS, length=PENDING, channels=CHANNELS, seed=3, device=DEVICE):
    """Each slot's recorded conv inputs [S, L, C], in the activation dtype (as the engine keeps them)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_slots, length, channels, generator=g).to(device, dtype)


def verify_rows(T, short):
    """slots [B], replay [B] (0 .. L) and num_tokens [B] or None (with `short`, rows stop early)."""
    slots, replay = [13, 5, 0], [T, 0, PENDING]
    return slots, replay, ([T, 1, max(1, T - 1)] if short else None)


@pytest.mark.parametrize("dtype,pool_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("short", [False, True], ids=["full", "short"])
def test_verify_matches_reference(dtype, pool_dtype, atol, rtol, width, T, short):
    with_bias = (T + width) % 2 == 0  # half the cases without bias
    weight, bias = make_layer(width, dtype, with_bias)
    x = make_x((BATCH, T, CHANNELS), dtype, seed=T)
    pool, pending = make_pool(width, pool_dtype), make_pending(dtype)
    ref_pool, ref_pending = pool.clone(), pending.clone()
    slots, replay, num_tokens = verify_rows(T, short)
    args = (idx(slots), idx(replay), None if num_tokens is None else idx(num_tokens))

    y_ref = causal_conv1d_update_verify(x, weight, bias, ref_pool, ref_pending, *args)
    y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, *args)

    assert y.shape == (BATCH, T, CHANNELS) and y.dtype == dtype
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol)
    if num_tokens is not None:
        for b, n in enumerate(num_tokens):
            assert (y[b, n:] == 0).all()
    # Equal pools: the replayed windows stored once, all other slots untouched; equal recorded inputs.
    assert_same(pool, ref_pool)
    assert_same(pending, ref_pending)


@pytest.mark.parametrize("width", WIDTHS)
def test_verify_unnamed_slots_untouched(width):
    T = 3
    weight, bias = make_layer(width, torch.float32)
    x = make_x((BATCH, T, CHANNELS), torch.float32)
    slots, replay, num_tokens = verify_rows(T, short=True)
    pool = torch.full((NUM_SLOTS, CHANNELS, width - 1), float("nan"), device=DEVICE)
    pending = torch.full((NUM_SLOTS, PENDING, CHANNELS), float("nan"), device=DEVICE)
    pool[slots], pending[slots] = make_pool(width, torch.float32)[slots], make_pending(torch.float32)[slots]
    args = (idx(slots), idx(replay), idx(num_tokens))
    y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, *args)
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        for v in (pool[s], pending[s]):
            assert torch.isfinite(v).all() if s in slots else torch.isnan(v).all(), s


@pytest.mark.parametrize("dtype,pool_dtype", BIT_EXACT_DTYPES[::3])
def test_verify_single_token_equals_update(dtype, pool_dtype):
    """replay 0, T = 1: the decode kernel's y, nothing stored; a replay of 1 next step commits the decode
    kernel's window, bit for bit."""
    weight, bias = make_layer(4, dtype)
    x = make_x((BATCH, 1, CHANNELS), dtype)
    pool, pending = make_pool(4, pool_dtype), make_pending(dtype)
    before, pool_update = pool.clone(), pool.clone()
    slots = idx([6, 0, 12])
    y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, slots, idx([0, 0, 0]))
    y_update = causal_conv1d_update_triton(x[:, 0], weight, bias, pool_update, slots)
    assert_same(y[:, 0], y_update)
    assert_same(pool, before)
    assert_same(pending[slots, 0], x[:, 0])
    x_next = make_x((BATCH, 1, CHANNELS), dtype, seed=9)
    causal_conv1d_update_verify_triton(x_next, weight, bias, pool, pending, slots, idx([1, 1, 1]))
    assert_same(pool, pool_update)


@pytest.mark.parametrize("dtype,pool_dtype", BIT_EXACT_DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_verify_chain_equals_kernel_decode(dtype, pool_dtype, width):
    """R4 on the kernels: step n+1 replays the a+1 inputs step n accepted, for every a in 0..K, and commits
    bit for bit the decode kernel's window over the same tokens; accepted positions' y are the decode
    kernel's."""
    K = 3
    T = 1 + K
    weight, bias = make_layer(width, dtype)
    pool, pending = make_pool(width, pool_dtype), make_pending(dtype, length=T)
    slots, plain, scratch = [6, 0, 12], [13, 14, 15], [8, 9, 10]
    pool[plain] = pool[slots]
    replay = [0] * BATCH
    for n in range(T + 1):
        x = make_x((BATCH, T, CHANNELS), dtype, seed=100 + n)
        y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, idx(slots), idx(replay))
        for b in range(BATCH):
            assert_same(pool[slots[b]], pool[plain[b]])
        accepted = [(n + b) % T for b in range(BATCH)]
        for t in range(T):
            rows = idx([plain[b] if t <= accepted[b] else scratch[b] for b in range(BATCH)])
            y_plain = causal_conv1d_update_triton(x[:, t], weight, bias, pool, rows)
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(y[b, t], y_plain[b])
        replay = [a + 1 for a in accepted]


def test_verify_strided_views():
    """x sliced out of a wider projection, a transposed weight, int32 indices and a pending tensor that is a
    per-layer view of one [S, layers, L, C] allocation (as the engine's pools hand it out)."""
    width, T = 4, 3
    weight_t, bias = make_layer(width, torch.float32)
    weight = weight_t.T.contiguous().T
    x = make_x((BATCH, T, 3 * CHANNELS), torch.float32)[:, :, CHANNELS : 2 * CHANNELS]
    pool = make_pool(width, torch.float32)
    layers = make_x((NUM_SLOTS, 2, PENDING, CHANNELS), torch.float32, seed=4)
    other_layer = layers[:, 0].clone()
    pending = layers[:, 1]
    ref_pool, ref_pending = pool.clone(), pending.clone()
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=DEVICE)  # noqa: E731
    args = (i32([4, 0, 15]), i32([2, 0, PENDING]), i32([3, 1, 2]))
    y_ref = causal_conv1d_update_verify(x, weight, bias, ref_pool, ref_pending, *args)
    y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, *args)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert_same(pool, ref_pool)
    assert_same(pending, ref_pending)
    assert_same(layers[:, 0], other_layer)


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


V = "causal_conv1d_update_verify_triton"


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(x=(BATCH, CHANNELS)), rf"{V}: expected x \[B, T, C\], got \(3, 24\)"),
        (dict(x=(BATCH, 0, CHANNELS)), rf"{V}: x expected at least one token per row \(T >= 1\)"),
        (dict(pending=(NUM_SLOTS, PENDING, CHANNELS + 1)),
         rf"{V}: pending expected shape \[S, L, C\] = \(16, L, 24\), got \(16, 5, 25\)"),
        (dict(pending=(NUM_SLOTS - 1, PENDING, CHANNELS)), rf"{V}: pending expected shape \[S, L, C\]"),
        (dict(pending=(NUM_SLOTS, 1, CHANNELS)),
         rf"{V}: pending expected a pending length L >= T = 2, got L = 1"),
        (dict(slots=idx([0, 1])), rf"{V}: slots expected shape \[B\] = \(3,\), got \(2,\)"),
        (dict(replay=idx([[0], [1], [2]])), rf"{V}: replay expected shape \[B\] = \(3,\), got \(3, 1\)"),
        (dict(replay=idx([0, 1, 2]).float()), rf"{V}: replay expected an integer tensor"),
        (dict(num_tokens=idx([1])), rf"{V}: num_tokens expected shape \[B\] = \(3,\), got \(1,\)"),
        (dict(conv_state=(NUM_SLOTS, CHANNELS, 2)), rf"{V}: conv_state expected shape \[S, C, K-1\]"),
    ],
)
def test_verify_shape_errors(change, match):
    weight, bias = make_layer(4, torch.float32)
    args = dict(
        x=make_x((BATCH, 2, CHANNELS), torch.float32), weight=weight, bias=bias,
        conv_state=make_pool(4, torch.float32), pending=make_pending(torch.float32),
        slots=idx([0, 1, 2]), replay=idx([0, 1, 2]), num_tokens=None,
    )  # fmt: skip
    for key, value in change.items():
        args[key] = torch.zeros(value, device=DEVICE) if isinstance(value, tuple) else value
    with pytest.raises(ValueError, match=match):
        causal_conv1d_update_verify_triton(**args)


# ---- full size on GPU ----------------------------------------------------------------------------

_8B = ModelConfig.from_hf_dict(build_config("8b-like"))
CONV_DIM, CONV_WIDTH = _8B.conv_dim, _8B.conv_kernel  # 10240, 4


def full_size_case(batch, T, dtype, pool_dtype, seed=0):
    """Inputs of one 8B-like layer on CUDA: a pool (and recorded inputs, L = T) of 2 * batch slots, the rows
    on distinct random slots, random replays of 0..T."""
    g = torch.Generator().manual_seed(seed)
    weight, bias = make_layer(CONV_WIDTH, dtype, channels=CONV_DIM, device="cuda")
    num_slots = 2 * batch
    pool = make_pool(CONV_WIDTH, pool_dtype, num_slots=num_slots, channels=CONV_DIM, device="cuda")
    pending = make_pending(dtype, num_slots=num_slots, length=T, channels=CONV_DIM, device="cuda")
    slots = torch.randperm(num_slots, generator=g)[:batch]
    replay = torch.randint(0, T + 1, (batch,), generator=g)
    x = make_x((batch, T, CONV_DIM), dtype, device="cuda")
    return x, weight, bias, pool, pending, slots.cuda(), replay.cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16pool", "fp32pool"])
def test_gpu_full_size_update(batch, pool_dtype):
    x, weight, bias, pool, _, slots, _ = full_size_case(batch, 1, torch.bfloat16, pool_dtype)
    ref_pool = pool.clone()
    y_ref = causal_conv1d_update(x[:, 0], weight, bias, ref_pool, slots)
    y = causal_conv1d_update_triton(x[:, 0], weight, bias, pool, slots)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
@pytest.mark.parametrize("T", [2, 5])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16pool", "fp32pool"])
def test_gpu_full_size_verify(batch, T, pool_dtype):
    x, weight, bias, pool, pending, slots, replay = full_size_case(batch, T, torch.bfloat16, pool_dtype)
    g = torch.Generator().manual_seed(1)
    num_tokens = torch.randint(1, T + 1, (batch,), generator=g).cuda()
    ref_pool, ref_pending = pool.clone(), pending.clone()
    y_ref = causal_conv1d_update_verify(x, weight, bias, ref_pool, ref_pending, slots, replay, num_tokens)
    y = causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, slots, replay, num_tokens)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert_same(pool, ref_pool)
    assert_same(pending, ref_pending)


def bench_conv(batch, T=1, dtype=torch.bfloat16, pool_dtype=torch.bfloat16, channels=CONV_DIM,
               width=CONV_WIDTH, iters=100, warmup=10, graph_launches=0):
    """Time one Triton conv update of `batch` rows on CUDA. T=1: the decode op. T>1: the verify op in its
    worst steady state, every row replaying replay = T recorded inputs (L = T) before its T tokens.
    Returns (ms per call, GB/s of compulsory traffic: x in, y out, weight, bias, each row's window read
    once and written once, and for verify the T replayed inputs read and the T new ones recorded).
    graph_launches > 0 times the op inside a CUDA graph of that many back-to-back launches, replayed `iters`
    times (`tests/cuda_timing.py`); 0 times eager launches."""
    g = torch.Generator().manual_seed(0)
    weight, bias = make_layer(width, dtype, channels=channels, device="cuda")
    num_slots = 2 * batch
    pool = make_pool(width, pool_dtype, num_slots=num_slots, channels=channels, device="cuda")
    slots = torch.randperm(num_slots, generator=g)[:batch].cuda()
    x = make_x((batch, T, channels), dtype, device="cuda")
    if T == 1:
        x1 = x[:, 0]
        pending_bytes = 0

        def call():
            causal_conv1d_update_triton(x1, weight, bias, pool, slots)
    else:
        pending = make_pending(dtype, num_slots=num_slots, length=T, channels=channels, device="cuda")
        replay = torch.full((batch,), T, dtype=torch.int64, device="cuda")
        pending_bytes = 2 * batch * T * channels * pending.element_size()

        def call():
            causal_conv1d_update_verify_triton(x, weight, bias, pool, pending, slots, replay)

    ms = time_call_ms(call, warmup=warmup, iters=iters, graph_launches=graph_launches)
    xs, ps = x.element_size(), pool.element_size()
    nbytes = (
        2 * batch * T * channels * xs  # x in, y out
        + channels * (width + 1) * weight.element_size()  # weight, bias
        + 2 * batch * channels * (width - 1) * ps  # window read once, written once
        + pending_bytes  # verify: T replayed inputs read, T new ones recorded
    )
    return ms, nbytes / (ms * 1e-3) / 1e9


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5])
def test_gpu_bench_conv_runs(T):
    ms, gbps = bench_conv(32, T=T, iters=5, warmup=2)
    assert ms > 0 and gbps > 0
    ms, gbps = bench_conv(32, T=T, iters=2, warmup=1, graph_launches=3)
    assert ms > 0 and gbps > 0
