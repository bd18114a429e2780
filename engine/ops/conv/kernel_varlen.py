"""Triton kernel of the Mamba2 causal conv1d over a varlen prefill batch (rows concatenated along tokens).

Same semantics and return as the torch reference `causal_conv1d.causal_conv1d_varlen` (see it for the
math and the pool layout): fp32 accumulation, silu, output in x.dtype; the inputs before a row's first
token come from its slot of the pool when has_initial_state (zeros otherwise, and the slot is then never
read); afterwards the slot holds the row's last K-1 inputs in the pool's dtype (a row shorter than K-1
keeps the newest part of its preceding window, and an empty row keeps the window itself, or zeros).

Two launches on the stream:
  1. outputs: one program per (block of BLOCK_T tokens, block of BLOCK_C channels) convolves x as if it were
     one row: its K taps (K is a `tl.constexpr`, 2..4) are plain shifted loads of x, with no metadata read.
     That is right for every token but a row's first K-1, whose taps reach into the row before (or before
     x). Finding each token's row and gathering from the pool in every tile instead is several times slower
     than this split.
  2. rows: one program per (row, block of channels) computes the row's first min(K-1, L) outputs again,
     their taps before the row from its initial window in the pool when has_initial_state (zero otherwise),
     overwriting launch 1's; then loads the row's last K-1 inputs (from x, or for a short row partly from
     its initial window) and, all loaded, stores them into the row's slot. Only this program reads or
     writes the row's slot at its channels, so the initial window is read before it is overwritten.
All tensors are addressed through their strides, so views (e.g. x sliced out of an in_proj output) need
no copy.

No host reads of device tensors: the wrapper checks shapes and dtypes only. The metadata is the caller's
contract and is NOT checked (the reference checks it, on the host):
  - query_start_loc is non-decreasing from 0 to T (empty rows are allowed);
  - state_slots are distinct and in [0, S) (an out-of-range slot reads/writes out of bounds).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.conv.kernel import _check_index
from baton.engine.ops.triton_common import cdiv, next_power_of_2, round_to

MIN_WIDTH, MAX_WIDTH = 2, 4
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _conv_varlen_out_kernel(
    x_ptr,  # [T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (unused without HAS_BIAS)
    y_ptr,  # [T, C]
    T,
    C,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_yt,
    stride_yc,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    mask = (toks < T)[:, None] & cmask[None, :]
    x_rows = x_ptr + toks.to(tl.int64)[:, None] * stride_xt + cols[None, :] * stride_xc  # [BLOCK_T, BLOCK_C]
    acc = tl.full([BLOCK_T, BLOCK_C], 0.0, tl.float32)
    # Tap k (oldest first) reads the input d = K-1-k tokens back: out_t = sum_k w[k] * x[t - (K-1) + k], rows
    # ignored (a row's first K-1 tokens are rewritten by the rows kernel).
    for k in tl.static_range(KW):
        d = KW - 1 - k  # a constexpr: KW and the static_range index are
        w = tl.load(w_ptr + cols * stride_wc + k * stride_wk, mask=cmask, other=0.0).to(tl.float32)
        u = tl.load(x_rows - d * stride_xt, mask=mask & (toks >= d)[:, None], other=0.0).to(tl.float32)
        acc += w[None, :] * u
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_bias, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # silu
    y_off = y_ptr + toks.to(tl.int64)[:, None] * stride_yt + cols[None, :] * stride_yc
    tl.store(y_off, round_to(out, y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_final_input(
    x_ptr,
    s_row,
    cols,
    cmask,
    start,
    L,
    init,
    j,
    stride_xt,
    stride_xc,
    stride_sk,
    KW: tl.constexpr,
    POOL_DTYPE: tl.constexpr,
):
    """Column j of the row's final window: the input at row position q = L - (K-1) + j, from x (rounded to
    the pool dtype) when q >= 0, else from the initial window at index K-1 + q = L + j (or zero)."""
    # Per-channel vectors rather than scalars (the interpreter wants tensor masks).
    q = cols.to(tl.int64) * 0 + (L - (KW - 1) + j)
    from_x = q >= 0
    from_state = (~from_x) & ((cols * 0 + init) != 0)
    xv = tl.load(x_ptr + (start + q) * stride_xt + cols * stride_xc, mask=cmask & from_x, other=0.0)
    sv = tl.load(s_row + (L + j) * stride_sk, mask=cmask & from_state, other=0.0)
    return tl.where(from_x, round_to(xv.to(tl.float32), POOL_DTYPE), sv.to(POOL_DTYPE))


@triton.jit
def _initial_input(s_row, cols, cmask, init, j, stride_sk, KW: tl.constexpr):
    """Entry j of the row's initial window (oldest first) in fp32: the input K-1-j tokens before its first one,
    or zero without initial state (the slot is then not read)."""
    if j < KW - 1:
        v = tl.load(s_row + j * stride_sk, mask=cmask & ((cols * 0 + init) != 0), other=0.0).to(tl.float32)
    else:
        v = tl.full(cols.shape, 0.0, tl.float32)  # no such entry at this K
    return v


@triton.jit
def _conv_varlen_rows_kernel(
    x_ptr,  # [T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (unused without HAS_BIAS)
    state_ptr,  # [S, C, K-1]
    qsl_ptr,  # [R+1]
    slots_ptr,  # [R]
    init_ptr,  # [R]
    y_ptr,  # [T, C]
    C,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_qsl,
    stride_slots,
    stride_init,
    stride_yt,
    stride_yc,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    start = tl.load(qsl_ptr + r * stride_qsl).to(tl.int64)
    L = tl.load(qsl_ptr + (r + 1) * stride_qsl).to(tl.int64) - start
    slot = tl.load(slots_ptr + r * stride_slots).to(tl.int64)
    init = tl.load(init_ptr + r * stride_init).to(tl.int32)
    s_row = state_ptr + slot * stride_ss + cols * stride_sc
    pool_dtype = state_ptr.dtype.element_ty

    # The row's first min(K-1, L) outputs, whose taps reach before the row: from its initial window.
    win0 = _initial_input(s_row, cols, cmask, init, 0, stride_sk, KW)
    win1 = _initial_input(s_row, cols, cmask, init, 1, stride_sk, KW)
    win2 = _initial_input(s_row, cols, cmask, init, 2, stride_sk, KW)
    x_row = x_ptr + start * stride_xt + cols * stride_xc
    for p in tl.static_range(KW - 1):
        keep = cmask & ((cols * 0 + p) < L)
        acc = tl.full([BLOCK_C], 0.0, tl.float32)
        for k in tl.static_range(KW):
            d = KW - 1 - k  # p and d are constexprs: whether the tap is in the row or the window is too
            w = tl.load(w_ptr + cols * stride_wc + k * stride_wk, mask=cmask, other=0.0).to(tl.float32)
            if p >= d:
                u = tl.load(x_row + (p - d) * stride_xt, mask=keep, other=0.0).to(tl.float32)
            elif KW - 1 + p - d == 0:
                u = win0
            elif KW - 1 + p - d == 1:
                u = win1
            else:
                u = win2
            acc += w * u
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols * stride_bias, mask=cmask, other=0.0).to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))  # silu
        tl.store(y_ptr + (start + p) * stride_yt + cols * stride_yc, round_to(out, y_ptr.dtype.element_ty), mask=keep)

    # The final window. Every column is loaded before the first store: a short row's window reads the slot it
    # overwrites (this program is the only one reading or writing the row's slot at these channels).
    v0 = _load_final_input(
        x_ptr, s_row, cols, cmask, start, L, init, 0, stride_xt, stride_xc, stride_sk, KW, pool_dtype
    )
    if KW >= 3:
        v1 = _load_final_input(
            x_ptr, s_row, cols, cmask, start, L, init, 1, stride_xt, stride_xc, stride_sk, KW, pool_dtype
        )
    if KW >= 4:
        v2 = _load_final_input(
            x_ptr, s_row, cols, cmask, start, L, init, 2, stride_xt, stride_xc, stride_sk, KW, pool_dtype
        )
    tl.store(s_row, v0, mask=cmask)
    if KW >= 3:
        tl.store(s_row + stride_sk, v1, mask=cmask)
    if KW >= 4:
        tl.store(s_row + 2 * stride_sk, v2, mask=cmask)


def _check_varlen_args(
    fn, x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state
) -> int:
    """Shape/dtype/device checks from shapes only; returns the kernel width K."""
    if x.dim() != 2 or weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [T, C], weight [C, K], conv_state [S, C, K-1], got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, conv_state {tuple(conv_state.shape)}"
        )
    channels, width = x.shape[1], weight.shape[1]
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ValueError(f"{fn}: weight expected kernel width K in [{MIN_WIDTH}, {MAX_WIDTH}], got {width}")
    check_shape(fn, "weight", weight, "[C, K]", (channels, width))
    check_shape(fn, "conv_state", conv_state, "[S, C, K-1]", (conv_state.shape[0], channels, width - 1))
    if bias is not None:
        check_shape(fn, "bias", bias, "[C]", (channels,))
    for name, t in (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state)):
        if t is not None and t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{fn}: {name} expected float32, float16 or bfloat16, got {t.dtype}")
        if t is not None and t.device != x.device:
            raise ValueError(f"{fn}: {name} expected on {x.device}, got {t.device}")
    if state_slots.dim() != 1:
        raise ValueError(f"{fn}: state_slots expected shape [R], got {tuple(state_slots.shape)}")
    rows = state_slots.shape[0]
    _check_index(fn, "state_slots", state_slots, "[R]", (rows,), x.device)
    _check_index(fn, "query_start_loc", query_start_loc, "[R+1]", (rows + 1,), x.device)
    check_shape(fn, "has_initial_state", has_initial_state, "[R]", (rows,))
    if has_initial_state.dtype.is_floating_point or has_initial_state.dtype.is_complex:
        raise ValueError(
            f"{fn}: has_initial_state expected a bool or integer tensor, got {has_initial_state.dtype}"
        )
    if has_initial_state.device != x.device:
        raise ValueError(f"{fn}: has_initial_state expected on {x.device}, got {has_initial_state.device}")
    return width


def causal_conv1d_varlen_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    *,
    block_t: int | None = None,
    block_c: int | None = None,
) -> Tensor:
    """Triton `causal_conv1d_varlen`: silu(causal conv) of every prefill row; each row's slot gets its last
    K-1 inputs.

    x [T, C]; weight [C, K] (K in 2..4); bias [C] or None; conv_state [S, C, K-1] pool, updated in place at
    the rows' slots only; query_start_loc [R+1] integer, non-decreasing from 0 to T; state_slots [R]
    integer, distinct and in [0, S); has_initial_state [R] bool (False: zeros precede the row and its
    slot is never read). The metadata is the caller's contract, not checked (module docstring).
    block_t / block_c (powers of two) override the output kernel's tile. Returns [T, C] in x.dtype.
    """
    fn = "causal_conv1d_varlen_triton"
    width = _check_varlen_args(
        fn, x, weight, bias, conv_state, query_start_loc, state_slots, has_initial_state
    )
    T, channels = x.shape
    rows = state_slots.shape[0]
    block_t = block_t or 32
    block_c = block_c or max(16, min(128, next_power_of_2(channels)))
    for name, b in (("block_t", block_t), ("block_c", block_c)):
        if b & (b - 1):
            raise ValueError(f"{fn}: {name} expected a power of two, got {b}")
    y = torch.empty((T, channels), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y  # then T == 0 too (query_start_loc is [0])
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # never read without HAS_BIAS
    # bool tensors load as int1, which the kernels compare with 0 like any integer.
    init = has_initial_state
    meta = (query_start_loc.stride(0), state_slots.stride(0), init.stride(0))

    if T > 0:
        grid = (cdiv(T, block_t), cdiv(channels, block_c))
        _conv_varlen_out_kernel[grid](
            x, weight, bias_arg, y,
            T, channels,
            x.stride(0), x.stride(1),
            weight.stride(0), weight.stride(1),
            bias.stride(0) if has_bias else 0,
            y.stride(0), y.stride(1),
            KW=width, HAS_BIAS=has_bias, BLOCK_T=block_t, BLOCK_C=block_c,
            num_warps=4 if block_t * block_c >= 2048 else 2,
        )  # fmt: skip

    # Second launch (stream-ordered after the first): each row's first K-1 outputs again, from its initial
    # window, then its final window into the slot.
    rows_block = max(16, min(256, next_power_of_2(channels)))
    _conv_varlen_rows_kernel[(rows, cdiv(channels, rows_block))](
        x, weight, bias_arg, conv_state, query_start_loc, state_slots, init, y,
        channels,
        x.stride(0), x.stride(1),
        weight.stride(0), weight.stride(1),
        bias.stride(0) if has_bias else 0,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        *meta,
        y.stride(0), y.stride(1),
        KW=width, HAS_BIAS=has_bias, BLOCK_C=rows_block,
        num_warps=max(1, min(4, rows_block // 64)),
    )  # fmt: skip
    return y
