"""Triton kernels for the Mamba2 selective state update: decode (one token per row) and speculative verify
(T = 1+K tokens per row), beside their torch references.

Same signatures, semantics and return values as `selective_state_update` (selective_state_update.py) and
`selective_state_update_multi` (spec_state_update.py); see those for the math. Both wrappers launch one
kernel: one program per (row, head, block of BLOCK_P head-dim rows), which holds its [BLOCK_P, N] state
tile in fp32 registers, reads it from `src` once, steps over the row's T positions (T = 1 for decode) and
stores it after each valid position into that position's dst slot, rounded to the pool dtype. The next
position continues from the rounded value, as the reference does, so resuming from any dst slot is what a
plain decode over the same tokens would hold. Each position's output y reads the fp32 state before that
rounding, as the references do. Head h reads the B/C group h // (H // G).

No host reads of device tensors: only shapes are checked here; the slot values are the caller's contract,
unchecked (an out-of-range slot is an out-of-bounds access on the GPU):

- decode: `state_slots` are distinct values in [0, S) (two rows on one slot race);
- verify: `num_tokens[b]` in 1..T; `src_slots` in [0, S); the dst slots of all valid positions
  (t < num_tokens[b]) are distinct values in [0, S) and none is another row's src slot. A row's src slot
  may be one of its own dst slots (its program reads the state before it writes). dst entries of padding
  positions are never used for addressing (-1 is fine).

The references check all of this with host reads; run them when in doubt.

Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported) runs both on CPU tensors.
On the GPU, `tl.exp` lowers to the fast ex2.approx path, so results agree with the torch reference to
a few fp32 ulps, not bit for bit.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape


@triton.jit
def _softplus(v):
    # torch's softplus (beta 1, threshold 20): v above 20, else log1p(exp(v)), written as
    # max(v, 0) + log1p(exp(-|v|)). log1p(u) for u in (0, 1] uses Kahan's log(w) * u / (w - 1), w = 1 + u,
    # exact to a few ulps without libdevice (which the interpreter lacks).
    u = tl.exp(-tl.abs(v))
    w = 1.0 + u
    exact = w == 1.0
    log1p_u = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
    return tl.where(v > 20.0, v, tl.maximum(v, 0.0) + log1p_u)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 `v` cast to `dtype`, round to nearest even. Triton's interpreter truncates fp32 -> bf16 in
    `.to()`, so bf16 rounds here by hand (exact; the cast that follows only drops zero bits); on the GPU this
    is what the cast does anyway. fp16 and fp32 casts round correctly in both modes."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        v = tl.where(v != v, v, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    return v.to(dtype)


@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
    src_ptr, dst_ptr, num_tokens_ptr, y_ptr,
    T, P, N, heads_per_group, dt_min,
    s_state_slot, s_state_h, s_state_p, s_state_n,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_dst_b, s_dst_t,
    s_y_b, s_y_t, s_y_h, s_y_p,
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    g = h // heads_per_group

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    tile = offs_p[:, None] * s_state_p + offs_n[None, :] * s_state_n  # [BLOCK_P, BLOCK_N]

    if HAS_NUM_TOKENS:  # noqa: SIM108 (a compile-time branch: the other one is never built)
        n_valid = tl.load(num_tokens_ptr + b).to(tl.int32)
    else:
        n_valid = T

    A = tl.load(A_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    # 64-bit slot offsets: a pool can hold more than 2**31 elements.
    src = tl.load(src_ptr + b).to(tl.int64)
    head_base = state_ptr + h.to(tl.int64) * s_state_h
    s = tl.load(head_base + src * s_state_slot + tile, mask=mask_pn, other=0.0).to(tl.float32)

    x_row = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h
    dt_row = dt_ptr + b.to(tl.int64) * s_dt_b + h * s_dt_h
    B_row = B_ptr + b.to(tl.int64) * s_B_b + g * s_B_g
    C_row = C_ptr + b.to(tl.int64) * s_C_b + g * s_C_g
    y_row = y_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
    for t in range(T):
        x = tl.load(x_row + t * s_x_t + offs_p * s_x_p, mask=mask_p, other=0.0).to(tl.float32)  # [BLOCK_P]
        Bv = tl.load(B_row + t * s_B_t + offs_n * s_B_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        Cv = tl.load(C_row + t * s_C_t + offs_n * s_C_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        dt = tl.load(dt_row + t * s_dt_t).to(tl.float32) + dt_bias
        dt = tl.maximum(_softplus(dt), dt_min)
        decay = tl.exp(dt * A)
        s = decay * s + (dt * x)[:, None] * Bv[None, :]  # fp32 [BLOCK_P, BLOCK_N]
        y = tl.sum(s * Cv[None, :], axis=1) + D * x  # [BLOCK_P], from the fp32 state
        valid = t < n_valid
        # The pool's rounded copy is what the next position reads, as in the reference.
        stored = _round_to(s, state_ptr.dtype.element_ty)
        # Padding positions may name slot -1: never address through it.
        dst = tl.load(dst_ptr + b * s_dst_b + t * s_dst_t)
        dst = tl.where(valid, dst, 0).to(tl.int64)
        # (The interpreter promotes `bool tensor & bool scalar` to int32, which a store mask rejects, so
        # the position's validity enters the mask through a comparison.)
        p_limit = tl.where(valid, P, 0)
        store_mask = (offs_p < p_limit)[:, None] & mask_n[None, :]
        tl.store(head_base + dst * s_state_slot + tile, stored, mask=store_mask)
        s = stored.to(tl.float32)
        y = tl.where(valid, y, 0.0)
        tl.store(y_row + t * s_y_t + offs_p * s_y_p, _round_to(y, y_ptr.dtype.element_ty), mask=mask_p)


def _launch_config(P: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps): the whole N in one tile, about 2048 state elements per program."""
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(1, 2048 // block_n))
    return block_p, block_n, 4


def _launch(
    ssm_state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    src_slots: Tensor, dst_slots: Tensor, num_tokens: Tensor | None, y: Tensor, dt_min: float,
    batch: int, T: int, H: int, P: int, N: int, G: int,
    x_strides: tuple[int, ...], dt_strides: tuple[int, ...], B_strides: tuple[int, ...],
    C_strides: tuple[int, ...], dst_strides: tuple[int, ...], y_strides: tuple[int, ...],
) -> None:  # fmt: skip
    if batch == 0:
        return
    block_p, block_n, num_warps = _launch_config(P, N)
    grid = (triton.cdiv(P, block_p), batch, H)
    _ssu_kernel[grid](
        ssm_state, x, dt, A, B, C, D, dt_bias,
        src_slots, dst_slots, src_slots if num_tokens is None else num_tokens, y,
        T, P, N, H // G, float(dt_min),
        *ssm_state.stride(), *x_strides, *dt_strides, *B_strides, *C_strides, *dst_strides, *y_strides,
        HAS_NUM_TOKENS=num_tokens is not None, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
    )  # fmt: skip


def _check_param_shapes(fn: str, A: Tensor, D: Tensor, dt_bias: Tensor, H: int, G: int) -> None:
    check_shape(fn, "A", A, "[H]", (H,))
    check_shape(fn, "D", D, "[H]", (H,))
    check_shape(fn, "dt_bias", dt_bias, "[H]", (H,))
    if G == 0 or H % G != 0:
        raise ValueError(f"{fn}: expected H ({H}) to be a multiple of G, got G = {G}")


def selective_state_update_triton(
    ssm_state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    state_slots: Tensor,
    dt_min: float,
) -> Tensor:
    """Advance each row's state by one token and return that token's output (`selective_state_update`).

    ssm_state [S, H, P, N] pool, updated in place at `state_slots` only; x [B, H, P]; dt [B, H] raw
    (before dt_bias and softplus); A, D, dt_bias [H]; B, C [B, G, N]; state_slots [B] distinct ints in
    [0, S) (unchecked: see the module docstring). Returns y [B, H, P] in x.dtype.
    """
    fn = "selective_state_update_triton"
    if x.dim() != 3 or ssm_state.dim() != 4 or B.dim() != 3:
        raise ValueError(
            f"{fn}: expected x [B, H, P], ssm_state [S, H, P, N], B [B, G, N], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}"
        )
    batch, H, P = x.shape
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G = B.shape[1]
    check_shape(fn, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(fn, "dt", dt, "[B, H]", (batch, H))
    check_shape(fn, "B", B, "[B, G, N]", (batch, G, N))
    check_shape(fn, "C", C, "[B, G, N]", (batch, G, N))
    check_shape(fn, "state_slots", state_slots, "[B]", (batch,))
    _check_param_shapes(fn, A, D, dt_bias, H, G)

    y = torch.empty_like(x)
    # One position (T = 1) whose dst slot is its src slot; a stride of 0 over the missing T axis.
    _launch(
        ssm_state, x, dt, A, B, C, D, dt_bias, state_slots, state_slots, None, y, dt_min,
        batch, 1, H, P, N, G,
        (x.stride(0), 0, x.stride(1), x.stride(2)), (dt.stride(0), 0, dt.stride(1)),
        (B.stride(0), 0, B.stride(1), B.stride(2)), (C.stride(0), 0, C.stride(1), C.stride(2)),
        (state_slots.stride(0), 0), (y.stride(0), 0, y.stride(1), y.stride(2)),
    )  # fmt: skip
    return y


def selective_state_update_multi_triton(
    ssm_state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    src_slots: Tensor,
    dst_slots: Tensor,
    dt_min: float,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Advance each row's SSM state over its T verify tokens, storing the state after each position
    (`selective_state_update_multi`).

    ssm_state [S, H, P, N] pool, written only at the valid dst slots; x [B, T, H, P]; dt [B, T, H] raw
    (before dt_bias and softplus); A, D, dt_bias [H]; B, C [B, T, G, N]; src_slots [B]; dst_slots [B, T];
    num_tokens [B] in 1..T (None: all T). Slot values are unchecked (see the module docstring).
    Returns y [B, T, H, P] in x.dtype, zero past num_tokens.
    """
    fn = "selective_state_update_multi_triton"
    if x.dim() != 4 or ssm_state.dim() != 4 or B.dim() != 4:
        raise ValueError(
            f"{fn}: expected x [B, T, H, P], ssm_state [S, H, P, N], B [B, T, G, N], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}"
        )
    batch, T, H, P = x.shape
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G = B.shape[2]
    check_shape(fn, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(fn, "dt", dt, "[B, T, H]", (batch, T, H))
    check_shape(fn, "B", B, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "C", C, "[B, T, G, N]", (batch, T, G, N))
    check_shape(fn, "src_slots", src_slots, "[B]", (batch,))
    check_shape(fn, "dst_slots", dst_slots, "[B, T]", (batch, T))
    if num_tokens is not None:
        check_shape(fn, "num_tokens", num_tokens, "[B]", (batch,))
    if T < 1:
        raise ValueError(f"{fn}: x expected at least one token per row (T >= 1), got {tuple(x.shape)}")
    _check_param_shapes(fn, A, D, dt_bias, H, G)

    y = torch.empty_like(x)
    _launch(
        ssm_state, x, dt, A, B, C, D, dt_bias, src_slots, dst_slots, num_tokens, y, dt_min,
        batch, T, H, P, N, G,
        x.stride(), dt.stride(), B.stride(), C.stride(), dst_slots.stride(), y.stride(),
    )  # fmt: skip
    return y
