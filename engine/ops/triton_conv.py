"""Triton kernels of the Mamba2 causal conv1d update: decode (one token per row) and speculative verify.

Same semantics and returns as the torch references `causal_conv1d.causal_conv1d_update` and
`spec_state_update.causal_conv1d_update_multi` (see those for the math and the pool layout): fp32
accumulation, silu, output in x.dtype, the K-1 input window stored in the pool's dtype, and in the
verify op each position continuing from the window as the pool would hold it (rounded to its dtype).

Kernel: one program per (row, block of BLOCK_C channels). The K-1 stored inputs of the block are loaded
once into registers (one vector per window column; K is a `tl.constexpr`, 2..4), then for each of the
T positions the new input is shifted in, the output computed, and the window stored to that position's
dst slot. Weight and bias are loaded once per program. All tensors are addressed through their strides,
so views (e.g. x sliced out of an in_proj output) need no copy.

No host reads of device tensors: the wrappers check shapes and dtypes only. Slot validity is the
caller's contract and is NOT checked (the references check it, on the host):
  - every slot index used is in [0, S) (an out-of-range index reads/writes out of bounds);
  - decode: state_slots are distinct;
  - verify: num_tokens[b] is in 1..T; dst slots of valid positions (t < num_tokens[b]) are distinct,
    and no row's dst slot is another row's src slot. A row's src slot may be one of its own dst slots
    (it is read before any write). dst entries at positions >= num_tokens[b] are never read or written
    (padding such as -1 is fine), and y there is zero.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape

MIN_WIDTH, MAX_WIDTH = 2, 4
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _cast(v, dtype: tl.constexpr):
    """fp32 -> dtype, rounding to nearest even. bfloat16 is rounded by hand: the GPU's cast does the same,
    but TRITON_INTERPRET truncates, and the pool must hold exactly what the torch reference stores."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + ((bits >> 16) & 1) + 0x7FFF
        rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return tl.where(v != v, v.to(tl.bfloat16), rounded)  # NaN stays NaN
    else:
        return v.to(dtype)


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [B, T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (unused without HAS_BIAS)
    state_ptr,  # [S, C, K-1]
    src_ptr,  # [B]
    dst_ptr,  # [B, T]
    ntok_ptr,  # [B] (unused without HAS_NUM_TOKENS)
    y_ptr,  # [B, T, C]
    T,
    C,
    stride_xb,
    stride_xt,
    stride_xc,
    stride_wc,
    stride_wk,
    stride_bias,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_src,
    stride_db,
    stride_dt,
    stride_ntok,
    stride_yb,
    stride_yt,
    stride_yc,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C

    # Weights, oldest tap first: out = sum_k w[k] * u[t - (K-1) + k].
    w_row = w_ptr + cols * stride_wc
    w0 = tl.load(w_row, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_row + stride_wk, mask=cmask, other=0.0).to(tl.float32)
    if KW >= 3:
        w2 = tl.load(w_row + 2 * stride_wk, mask=cmask, other=0.0).to(tl.float32)
    if KW >= 4:
        w3 = tl.load(w_row + 3 * stride_wk, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + cols * stride_bias, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.full([BLOCK_C], 0.0, tl.float32)

    # The window (the K-1 inputs before the next token, oldest first), in fp32 registers; columns past
    # K-1 stay zero and unused. Everything is read before the first write (src may be a dst slot).
    src = tl.load(src_ptr + row * stride_src).to(tl.int64)
    s_row = state_ptr + src * stride_ss + cols * stride_sc
    s0 = tl.load(s_row, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.full([BLOCK_C], 0.0, tl.float32)
    s2 = tl.full([BLOCK_C], 0.0, tl.float32)
    if KW >= 3:
        s1 = tl.load(s_row + stride_sk, mask=cmask, other=0.0).to(tl.float32)
    if KW >= 4:
        s2 = tl.load(s_row + 2 * stride_sk, mask=cmask, other=0.0).to(tl.float32)

    if HAS_NUM_TOKENS:  # noqa: SIM108 (a constexpr branch)
        n = tl.load(ntok_ptr + row * stride_ntok)
    else:
        n = T
    for t in range(T):
        # A [BLOCK_C] mask rather than a scalar (the interpreter wants tensor masks).
        valid = (tl.full([BLOCK_C], 0, tl.int32) + t) < n
        xt = tl.load(x_ptr + row * stride_xb + t * stride_xt + cols * stride_xc, mask=cmask, other=0.0)
        u = xt.to(tl.float32)
        acc = acc0
        if KW == 2:
            acc += w0 * s0
            acc += w1 * u
        elif KW == 3:
            acc += w0 * s0
            acc += w1 * s1
            acc += w2 * u
        else:
            acc += w0 * s0
            acc += w1 * s1
            acc += w2 * s2
            acc += w3 * u
        out = acc / (1.0 + tl.exp(-acc))  # silu
        y_off = y_ptr + row * stride_yb + t * stride_yt + cols * stride_yc
        tl.store(y_off, _cast(tl.where(valid, out, 0.0), y_ptr.dtype.element_ty), mask=cmask)

        # Shift: drop the oldest input; the new one enters rounded to the pool dtype, as the next
        # position (and whoever resumes from this slot) reads it.
        u = _cast(u, state_ptr.dtype.element_ty).to(tl.float32)
        if KW == 2:
            s0 = u
        elif KW == 3:
            s0 = s1
            s1 = u
        else:
            s0 = s1
            s1 = s2
            s2 = u
        # dst_slots is [B, T], so the load is in bounds; an invalid position's entry (padding) only
        # forms addresses that the masked stores below never touch.
        dst = tl.load(dst_ptr + row * stride_db + t * stride_dt).to(tl.int64)
        d_row = state_ptr + dst * stride_ss + cols * stride_sc
        smask = cmask & valid
        tl.store(d_row, s0.to(state_ptr.dtype.element_ty), mask=smask)
        if KW >= 3:
            tl.store(d_row + stride_sk, s1.to(state_ptr.dtype.element_ty), mask=smask)
        if KW >= 4:
            tl.store(d_row + 2 * stride_sk, s2.to(state_ptr.dtype.element_ty), mask=smask)


def _check_args(fn: str, x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor) -> int:
    """Shape/dtype checks shared by both ops (x already [B, T, C]); returns the kernel width K."""
    batch, T, channels = x.shape
    if weight.dim() != 2 or conv_state.dim() != 3:
        raise ValueError(
            f"{fn}: expected weight [C, K], conv_state [S, C, K-1], got weight {tuple(weight.shape)}, "
            f"conv_state {tuple(conv_state.shape)}"
        )
    width = weight.shape[1]
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
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    return width


def _check_index(fn: str, name: str, t: Tensor, dims: str, expected: tuple[int, ...], device) -> None:
    check_shape(fn, name, t, dims, expected)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{fn}: {name} expected an integer tensor, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{fn}: {name} expected on {device}, got {t.device}")


def _default_block_c(batch: int, channels: int) -> int:
    # Few rows: smaller blocks so that enough programs fill the GPU; many rows: wider blocks.
    block = 64 if batch <= 8 else 256
    return max(16, min(block, triton.next_power_of_2(channels)))


def _launch(x3, weight, bias, conv_state, src, dst, num_tokens, y3, width, block_c):
    batch, T, channels = x3.shape
    block_c = block_c or _default_block_c(batch, channels)
    if block_c & (block_c - 1):
        raise ValueError(f"block_c expected a power of two, got {block_c}")
    has_bias = bias is not None
    has_ntok = num_tokens is not None
    bias_arg = bias if has_bias else weight  # never read without HAS_BIAS
    ntok_arg = num_tokens if has_ntok else src  # never read without HAS_NUM_TOKENS
    if batch == 0:
        return
    grid = (batch, triton.cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x3, weight, bias_arg, conv_state, src, dst, ntok_arg, y3,
        T, channels,
        x3.stride(0), x3.stride(1), x3.stride(2),
        weight.stride(0), weight.stride(1),
        bias.stride(0) if has_bias else 0,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        src.stride(0),
        dst.stride(0), dst.stride(1),
        num_tokens.stride(0) if has_ntok else 0,
        y3.stride(0), y3.stride(1), y3.stride(2),
        KW=width, HAS_BIAS=has_bias, HAS_NUM_TOKENS=has_ntok, BLOCK_C=block_c,
        num_warps=max(1, min(4, block_c // 64)),
    )  # fmt: skip


def causal_conv1d_update_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_slots: Tensor,
    *,
    block_c: int | None = None,
) -> Tensor:
    """Triton `causal_conv1d_update`: one token per row; shifts x into each row's slot.

    x [B, C]; weight [C, K] (K in 2..4); bias [C] or None; conv_state [S, C, K-1] pool, updated in
    place; state_slots [B] integer, distinct and in [0, S) (not checked: the caller's contract).
    Returns [B, C] in x.dtype.
    """
    fn = "causal_conv1d_update_triton"
    if x.dim() != 2:
        raise ValueError(f"{fn}: expected x [B, C], got {tuple(x.shape)}")
    width = _check_args(fn, x[:, None], weight, bias, conv_state)
    _check_index(fn, "state_slots", state_slots, "[B]", (x.shape[0],), x.device)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    # The slot is both source and destination: the kernel reads the window before writing it.
    _launch(x[:, None], weight, bias, conv_state, state_slots, state_slots[:, None], None, y[:, None],
            width, block_c)
    return y


def causal_conv1d_update_multi_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    src_slots: Tensor,
    dst_slots: Tensor,
    num_tokens: Tensor | None = None,
    *,
    block_c: int | None = None,
) -> Tensor:
    """Triton `causal_conv1d_update_multi`: T verify tokens per row, the window after each position
    stored in its dst slot.

    x [B, T, C]; weight [C, K] (K in 2..4); bias [C] or None; conv_state [S, C, K-1] pool, written only
    at the valid dst slots; src_slots [B]; dst_slots [B, T]; num_tokens [B] in 1..T (None: all T).
    Slot validity is the caller's contract (module docstring). Returns [B, T, C] in x.dtype, zero past
    num_tokens.
    """
    fn = "causal_conv1d_update_multi_triton"
    if x.dim() != 3:
        raise ValueError(f"{fn}: expected x [B, T, C], got {tuple(x.shape)}")
    width = _check_args(fn, x, weight, bias, conv_state)
    batch, T, _ = x.shape
    _check_index(fn, "src_slots", src_slots, "[B]", (batch,), x.device)
    _check_index(fn, "dst_slots", dst_slots, "[B, T]", (batch, T), x.device)
    if num_tokens is not None:
        _check_index(fn, "num_tokens", num_tokens, "[B]", (batch,), x.device)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, weight, bias, conv_state, src_slots, dst_slots, num_tokens, y, width, block_c)
    return y
