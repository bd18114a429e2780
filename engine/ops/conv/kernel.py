"""Triton kernels of the Mamba2 causal conv1d update: decode (one token per row) and speculative verify.

Same semantics and returns as the torch references `causal_conv1d.causal_conv1d_update` and
`reference.causal_conv1d_update_verify` (see those for the math, the pool layout and the replay):
fp32 accumulation, silu, output in x.dtype, the K-1 input window stored in the pool's dtype, each
position continuing from the window as the pool would hold it (rounded to its dtype).

Kernel: one program per (row, block of BLOCK_C channels). The K-1 stored inputs of the block are loaded
once into registers (one vector per window column; K is a `tl.constexpr`, 2..4). Decode shifts the
token in and stores the window back. Verify first shifts in the slot's `replay[b]` pending inputs and
stores that committed window once, then runs the T positions in registers only (no per-position
window is stored) and records their inputs as the slot's new pending ones; the same program reads and
then writes those pending entries, so no other program races with it. Weight and bias are loaded once
per program. Inputs are addressed through their strides, so views need no copy.

No host reads of device tensors: the wrappers check shapes and dtypes only. Index validity is the
caller's contract and is NOT checked (the references check it, on the host): slots are distinct and in
[0, S); verify: num_tokens[b] in 1..T and replay[b] in 0..L.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.triton_common import cdiv, next_power_of_2, pdl, pdl_wait, round_to

MIN_WIDTH, MAX_WIDTH = 2, 4
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _shift_in(s0, s1, s2, u, KW: tl.constexpr):
    """The window (oldest first) after input `u` enters and the oldest input drops out."""
    if KW == 2:
        return u, s1, s2
    elif KW == 3:
        return s1, u, s2
    else:
        return s1, s2, u


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [B, T, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (unused without HAS_BIAS)
    state_ptr,  # [S, C, K-1]
    slot_ptr,  # [B]
    pend_ptr,  # [S, L, C] (VERIFY only)
    replay_ptr,  # [B] (VERIFY only)
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
    stride_ps,
    stride_pt,
    stride_pc,
    KW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_NUM_TOKENS: tl.constexpr,
    VERIFY: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C

    # Weights, oldest tap first: out = sum_k w[k] * u[t - (K-1) + k].
    w_row = w_ptr + cols * stride_wc
    w0 = tl.load(w_row, mask=cmask, other=0.0).to(tl.float32)
    w1 = tl.load(w_row + stride_wk, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.full([BLOCK_C], 0.0, tl.float32)
    w3 = tl.full([BLOCK_C], 0.0, tl.float32)
    if KW >= 3:
        w2 = tl.load(w_row + 2 * stride_wk, mask=cmask, other=0.0).to(tl.float32)
    if KW >= 4:
        w3 = tl.load(w_row + 3 * stride_wk, mask=cmask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc0 = tl.load(bias_ptr + cols * stride_bias, mask=cmask, other=0.0).to(tl.float32)
    else:
        acc0 = tl.full([BLOCK_C], 0.0, tl.float32)
    pdl_wait(PDL)  # (the weights and bias above are constants)

    # The window (the K-1 inputs before the next token, oldest first), in fp32 registers; columns past
    # K-1 stay zero and unused.
    slot = tl.load(slot_ptr + row).to(tl.int64)
    s_row = state_ptr + slot * stride_ss + cols * stride_sc
    s0 = tl.load(s_row, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.full([BLOCK_C], 0.0, tl.float32)
    s2 = tl.full([BLOCK_C], 0.0, tl.float32)
    if KW >= 3:
        s1 = tl.load(s_row + stride_sk, mask=cmask, other=0.0).to(tl.float32)
    if KW >= 4:
        s2 = tl.load(s_row + 2 * stride_sk, mask=cmask, other=0.0).to(tl.float32)

    if VERIFY:
        # Replay the accepted inputs of the slot's last verify, then store the committed window once.
        p_row = pend_ptr + slot * stride_ps + cols * stride_pc
        n_rep = tl.load(replay_ptr + row).to(tl.int32)
        for j in range(n_rep):
            u = tl.load(p_row + j * stride_pt, mask=cmask, other=0.0).to(tl.float32)
            u = round_to(u, state_ptr.dtype.element_ty).to(tl.float32)
            s0, s1, s2 = _shift_in(s0, s1, s2, u, KW)
        rep_mask = cmask & ((tl.full([BLOCK_C], 0, tl.int32) + n_rep) > 0)
        tl.store(s_row, s0.to(state_ptr.dtype.element_ty), mask=rep_mask)
        if KW >= 3:
            tl.store(s_row + stride_sk, s1.to(state_ptr.dtype.element_ty), mask=rep_mask)
        if KW >= 4:
            tl.store(s_row + 2 * stride_sk, s2.to(state_ptr.dtype.element_ty), mask=rep_mask)

    if HAS_NUM_TOKENS:  # noqa: SIM108 (a constexpr branch)
        n = tl.load(ntok_ptr + row)
    else:
        n = T
    for t in range(T):
        # A [BLOCK_C] mask rather than a scalar (the interpreter wants tensor masks).
        valid = (tl.full([BLOCK_C], 0, tl.int32) + t) < n
        xt = tl.load(x_ptr + row * stride_xb + t * stride_xt + cols * stride_xc, mask=cmask, other=0.0)
        u = xt.to(tl.float32)
        u_in = u
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
        y_off = y_ptr + (row * T + t) * C + cols  # y is a fresh contiguous [B, T, C]
        tl.store(y_off, round_to(tl.where(valid, out, 0.0), y_ptr.dtype.element_ty), mask=cmask)
        # Shift: the new input enters rounded to the pool dtype, as the pool (and a replay) holds it.
        u = round_to(u, state_ptr.dtype.element_ty).to(tl.float32)
        s0, s1, s2 = _shift_in(s0, s1, s2, u, KW)
        if VERIFY:
            # This step's inputs become the slot's pending ones (read above by this same program).
            tl.store(pend_ptr + slot * stride_ps + t * stride_pt + cols * stride_pc,
                     round_to(u_in, pend_ptr.dtype.element_ty), mask=cmask)

    if not VERIFY:
        # Decode (T = 1): the window after the token goes back to the row's slot.
        tl.store(s_row, s0.to(state_ptr.dtype.element_ty), mask=cmask)
        if KW >= 3:
            tl.store(s_row + stride_sk, s1.to(state_ptr.dtype.element_ty), mask=cmask)
        if KW >= 4:
            tl.store(s_row + 2 * stride_sk, s2.to(state_ptr.dtype.element_ty), mask=cmask)


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
    return max(16, min(block, next_power_of_2(channels)))


def _num_warps(block_c: int) -> int:
    # One channel per thread at 256-channel blocks (many rows), the fastest for large batches; narrower blocks keep
    # 64 channels per warp.
    return 8 if block_c >= 256 else max(1, block_c // 64)


def _launch(x3, weight, bias, conv_state, slots, pending, replay, num_tokens, y3, width, block_c):
    batch, T, channels = x3.shape
    block_c = block_c or _default_block_c(batch, channels)
    if block_c & (block_c - 1):
        raise ValueError(f"block_c expected a power of two, got {block_c}")
    if batch == 0:
        return
    verify = pending is not None
    has_bias = bias is not None
    has_ntok = num_tokens is not None
    grid = (batch, cdiv(channels, block_c))
    _conv_update_kernel[grid](
        x3, weight, bias if has_bias else weight, conv_state, slots,
        pending if verify else conv_state, replay if verify else slots, num_tokens if has_ntok else slots, y3,
        T, channels,
        x3.stride(0), x3.stride(1), x3.stride(2),
        weight.stride(0), weight.stride(1),
        bias.stride(0) if has_bias else 0,
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        *(pending.stride() if verify else (0, 0, 0)),
        KW=width, HAS_BIAS=has_bias, HAS_NUM_TOKENS=has_ntok, VERIFY=verify, BLOCK_C=block_c,
        num_warps=_num_warps(block_c), **pdl(x3),
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
    _launch(x[:, None], weight, bias, conv_state, state_slots, None, None, None, y[:, None], width, block_c)
    return y


def causal_conv1d_update_verify_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    pending: Tensor,
    slots: Tensor,
    replay: Tensor,
    num_tokens: Tensor | None = None,
    *,
    block_c: int | None = None,
) -> Tensor:
    """Triton `causal_conv1d_update_verify`: replay each row's `replay[b]` pending inputs into its window
    (stored once), then its T verify tokens; this step's inputs become the slot's pending ones.

    x [B, T, C]; weight [C, K] (K in 2..4); bias [C] or None; conv_state [S, C, K-1] pool; pending [S, L, C]
    with L >= T; slots [B]; replay [B] in 0..L; num_tokens [B] in 1..T (None: all T). Index validity is the
    caller's contract (module docstring). Returns [B, T, C] in x.dtype, zero past num_tokens.
    """
    fn = "causal_conv1d_update_verify_triton"
    if x.dim() != 3:
        raise ValueError(f"{fn}: expected x [B, T, C], got {tuple(x.shape)}")
    width = _check_args(fn, x, weight, bias, conv_state)
    batch, T, channels = x.shape
    if pending.dim() != 3 or pending.shape[0] != conv_state.shape[0] or pending.shape[2] != channels:
        raise ValueError(f"{fn}: pending expected shape [S, L, C] = ({conv_state.shape[0]}, L, {channels}), "
                         f"got {tuple(pending.shape)}")
    if pending.shape[1] < T:
        raise ValueError(f"{fn}: pending expected a pending length L >= T = {T}, got L = {pending.shape[1]}")
    _check_index(fn, "slots", slots, "[B]", (batch,), x.device)
    _check_index(fn, "replay", replay, "[B]", (batch,), x.device)
    if num_tokens is not None:
        _check_index(fn, "num_tokens", num_tokens, "[B]", (batch,), x.device)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, weight, bias, conv_state, slots, pending, replay, num_tokens, y, width, block_c)
    return y
