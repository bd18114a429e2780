"""Causal conv1d ops against a naive fp64 loop and HF NemotronH's torch implementation."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.nemotron_h.modeling_nemotron_h import causal_conv1d_fn
from transformers.models.nemotron_h.modeling_nemotron_h import causal_conv1d_update as hf_update

from baton.engine.ops.conv.reference import causal_conv1d_update, causal_conv1d_varlen

CHANNELS, K = 24, 4
NUM_SLOTS = 10
# Row lengths around the state width K-1 = 3 and one long row.
LENGTHS = [1, 2, K - 1, K, K + 1, 17]
SLOTS = [7, 2, 9, 0, 4, 5]
HAS_INIT = [True, False, True, False, False, True]

# (dtype of inputs, weights and pool, atol, rtol)
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
]


def make_layer(dtype, width=K, with_bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(CHANNELS, width, generator=g) / width**0.5).to(dtype)  # [C, K]
    bias = torch.randn(CHANNELS, generator=g).to(dtype) if with_bias else None  # [C]
    return weight, bias


def make_inputs(T, dtype, width=K, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, CHANNELS, generator=g).to(dtype)  # [T, C]
    pool = torch.randn(NUM_SLOTS, CHANNELS, width - 1, generator=g).to(dtype)  # [S, C, K-1]
    return x, pool


def qsl(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)


def naive_conv(x, weight, bias, preceding):
    """fp64 loop for one row: x [L, C], preceding [C, K-1] -> (silu(conv) [L, C], new state [C, K-1])."""
    width = weight.shape[1]
    inputs = torch.cat([preceding.double().T, x.double()])  # [K-1 + L, C]
    out = torch.zeros(x.shape[0], CHANNELS, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(width):
            out[t] += weight[:, k].double() * inputs[t + k]
    if bias is not None:
        out += bias.double()
    return F.silu(out), inputs[inputs.shape[0] - (width - 1):].T


def run_varlen(x, weight, bias, pool, lengths, slots, has_init):
    return causal_conv1d_varlen(x, weight, bias, pool, qsl(lengths), torch.tensor(slots), torch.tensor(has_init))


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_varlen_matches_naive_and_hf(dtype, atol, rtol, with_bias):
    weight, bias = make_layer(dtype, with_bias=with_bias)
    x, pool = make_inputs(sum(LENGTHS), dtype)
    # A row without initial state must not read its slot: fill those with garbage.
    for slot, init in zip(SLOTS, HAS_INIT, strict=True):
        if not init:
            pool[slot] = float("nan")
    before = pool.clone()

    out = run_varlen(x, weight, bias, pool, LENGTHS, SLOTS, HAS_INIT)

    assert out.dtype == dtype and out.shape == x.shape
    bounds = qsl(LENGTHS).tolist()
    for r, (slot, init) in enumerate(zip(SLOTS, HAS_INIT, strict=True)):
        lo, hi = bounds[r], bounds[r + 1]
        preceding = before[slot] if init else torch.zeros(CHANNELS, K - 1, dtype=dtype)
        ref, state_ref = naive_conv(x[lo:hi], weight, bias, preceding)
        torch.testing.assert_close(out[lo:hi].double(), ref, atol=atol, rtol=rtol)
        # The state holds raw inputs, so it is exact in any dtype.
        torch.testing.assert_close(pool[slot].double(), state_ref, atol=0, rtol=0)

        # HF convolves [preceding inputs, row] with zero left padding; the row's outputs are the last L.
        hf_in = torch.cat([preceding.float(), x[lo:hi].float().T], dim=1)[None]  # [1, C, K-1 + L]
        hf = causal_conv1d_fn(hf_in, weight.float(), None if bias is None else bias.float(), activation="silu")
        torch.testing.assert_close(out[lo:hi].float(), hf[0, :, -(hi - lo):].T, atol=atol, rtol=rtol)
    untouched = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("split", [1, 2, K - 1, K, 9])
def test_chunked_prefill_continuity(dtype, atol, rtol, split):
    """Convolving a sequence in two calls (the second with initial state) equals one call."""
    weight, bias = make_layer(dtype)
    total = 13
    x, pool_one = make_inputs(total + 5, dtype)
    pool_two = pool_one.clone()

    out_one = run_varlen(x, weight, bias, pool_one, [total, 5], [3, 8], [False, True])

    first = torch.cat([torch.arange(split), torch.arange(total, total + 5)])
    out_a = run_varlen(x[first], weight, bias, pool_two, [split, 5], [3, 8], [False, True])
    out_b = run_varlen(x[split:total], weight, bias, pool_two, [total - split], [3], [True])

    torch.testing.assert_close(out_a[:split], out_one[:split], atol=atol, rtol=rtol)
    torch.testing.assert_close(out_b, out_one[split:total], atol=atol, rtol=rtol)
    assert torch.equal(pool_two, pool_one)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_update_matches_hf_and_untouched_slots(dtype, atol, rtol):
    weight, bias = make_layer(dtype)
    x, pool = make_inputs(4, dtype)
    slots = torch.tensor([6, 1, 9, 3])
    before = pool.clone()
    hf_state = pool[slots].float()

    out = causal_conv1d_update(x, weight, bias, pool, slots)

    hf = hf_update(x.float()[:, :, None], hf_state, weight.float(), bias.float(), activation="silu")
    torch.testing.assert_close(out.float(), hf[:, :, 0], atol=atol, rtol=rtol)
    torch.testing.assert_close(pool[slots].float(), hf_state, atol=0, rtol=0)
    untouched = [s for s in range(NUM_SLOTS) if s not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_equals_varlen_on_length_one_rows(dtype):
    weight, bias = make_layer(dtype)
    x, pool_varlen = make_inputs(5, dtype)
    pool_update = pool_varlen.clone()
    slots = [6, 0, 2, 9, 4]

    out_varlen = run_varlen(x, weight, bias, pool_varlen, [1] * 5, slots, [True] * 5)
    out_update = causal_conv1d_update(x, weight, bias, pool_update, torch.tensor(slots))

    torch.testing.assert_close(out_update, out_varlen, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool_update, pool_varlen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_then_decode_steps_equal_one_call(dtype):
    weight, bias = make_layer(dtype)
    total, prompt = 11, 5
    x, pool_one = make_inputs(total, dtype)
    pool_steps = pool_one.clone()

    out_one = run_varlen(x, weight, bias, pool_one, [total], [2], [False])

    outs = [run_varlen(x[:prompt], weight, bias, pool_steps, [prompt], [2], [False])]
    outs += [causal_conv1d_update(x[t:t + 1], weight, bias, pool_steps, torch.tensor([2])) for t in range(prompt, total)]
    torch.testing.assert_close(torch.cat(outs), out_one, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool_steps, pool_one)


def test_new_row_ignores_garbage_slot():
    """R2: a row without initial state gives the zero-state result whatever its slot holds."""
    weight, bias = make_layer(torch.float32)
    x, pool_nan = make_inputs(6, torch.float32)
    pool_zero = pool_nan.clone()
    pool_nan[4] = float("nan")
    pool_zero[4] = 0.0

    out_nan = run_varlen(x, weight, bias, pool_nan, [2, 4], [4, 1], [False, True])
    out_zero = run_varlen(x, weight, bias, pool_zero, [2, 4], [4, 1], [True, True])

    assert torch.isfinite(out_nan).all()
    assert torch.equal(out_nan, out_zero)
    assert torch.equal(pool_nan, pool_zero)


def test_kernel_width_one_has_empty_state():
    weight, bias = make_layer(torch.float32, width=1)
    x, pool = make_inputs(3, torch.float32, width=1)
    out = run_varlen(x, weight, bias, pool, [1, 2], [0, 1], [False, True])
    torch.testing.assert_close(out, F.silu(x * weight[:, 0] + bias))
    torch.testing.assert_close(causal_conv1d_update(x[:1], weight, bias, pool, torch.tensor([0])), out[:1])


def test_shape_and_metadata_errors():
    weight, bias = make_layer(torch.float32)
    x, pool = make_inputs(5, torch.float32)
    with pytest.raises(ValueError, match=r"weight expected shape \[C, K\]"):
        run_varlen(x, weight[:4], bias, pool, [5], [0], [False])
    with pytest.raises(ValueError, match=r"conv_state expected shape \[S, C, K-1\]"):
        run_varlen(x, weight, bias, pool[:, :, :2], [5], [0], [False])
    with pytest.raises(ValueError, match=r"bias expected shape \[C\]"):
        causal_conv1d_update(x, weight, bias[:3], pool, torch.arange(5))
    with pytest.raises(ValueError, match="query_start_loc expected"):
        run_varlen(x, weight, bias, pool, [2, 2], [0, 1], [False, False])
    with pytest.raises(ValueError, match="distinct"):
        causal_conv1d_update(x[:2], weight, bias, pool, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match=r"has_initial_state expected shape \[R\]"):
        run_varlen(x, weight, bias, pool, [5], [0], [False, True])
