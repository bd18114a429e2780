"""Triton kernels for the Mamba2 selective state update: decode (one token per row) and speculative verify
(T = 1+K tokens per row, by replay), beside their torch references.

Same signatures, semantics and return values as `selective_state_update` and
`selective_state_update_verify` (`reference.py`); see those for the math and the replay. One program per
(row, head, block of BLOCK_P head-dim rows), numbered head-major (`_program_tile`), holds its [BLOCK_P, N]
state tile in fp32 registers and reads it from the row's slot once. Decode advances it by the token and stores
it back. Verify first replays the slot's `replay[b]` pending positions (each rounded to the pool dtype, as a
decode step stores it) and stores that committed state once, then steps over the row's T positions in
registers only: a verify step moves one state read and one state write per row, whatever K is. Each position's
output y reads the fp32 state before rounding, as the references do. Head h reads the B/C group h // (H // G).

No host reads of device tensors: only shapes are checked here; index values are the caller's contract,
unchecked (an out-of-range slot is an out-of-bounds access on the GPU): slots are distinct values in
[0, S); verify: num_tokens[b] in 1..T, replay[b] in 0..L. The references check all of this with host
reads; run them when in doubt.

Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported) runs both on CPU tensors.
On the GPU, `tl.exp` lowers to the fast ex2.approx path, so results agree with the torch reference to
a few fp32 ulps, not bit for bit.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.ssm_update.reference import check_verify_shapes
from baton.engine.ops.ssm_update.tuning import ONE_WARP_ROWS, RECORD_BLOCK
from baton.engine.ops.triton_common import cdiv, next_power_of_2, pdl, pdl_wait, round_to, softplus


@triton.jit
def _ssm_step(s, x, Bv, dt_raw, A, dt_bias, dt_min):
    """One recurrence step of an fp32 [BLOCK_P, BLOCK_N] state tile: (new fp32 state, discretized dt)."""
    dt = tl.maximum(softplus(dt_raw + dt_bias), dt_min)
    decay = tl.exp(dt * A)
    return decay * s + (dt * x)[:, None] * Bv[None, :], dt


@triton.jit
def _program_tile(H, P, BLOCK_P: tl.constexpr):
    """(block of P, head, row) of this program in the 1-D grid: the block of P varies fastest, then the head,
    so consecutive programs walk one slot's [H, P, N] state contiguously, which is faster than rows varying fastest
    (rows lie megabytes apart in the engine's pool)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(P, BLOCK_P)
    return pid % n_blocks, (pid // n_blocks) % H, pid // (n_blocks * H)


@triton.jit
def _ssu_decode_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slot_ptr, y_ptr,
    H, P, N, heads_per_group, dt_min,
    s_state_slot, s_state_h, s_state_p, s_state_n,
    s_x_b, s_x_h, s_x_p,
    s_dt_b, s_dt_h,
    s_B_b, s_B_g, s_B_n,
    s_C_b, s_C_g, s_C_n,
    s_y_b, s_y_h, s_y_p,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pid_p, h, b = _program_tile(H, P, BLOCK_P)
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    offs_n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_pn = mask_p[:, None] & mask_n[None, :]
    tile = offs_p[:, None] * s_state_p + offs_n[None, :] * s_state_n  # [BLOCK_P, BLOCK_N]

    A = tl.load(A_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    pdl_wait(PDL)  # (A, D and dt_bias above are constants)
    # 64-bit slot offsets: a pool can hold more than 2**31 elements.
    slot = tl.load(slot_ptr + b).to(tl.int64)
    state_at = state_ptr + h.to(tl.int64) * s_state_h + slot * s_state_slot + tile
    s = tl.load(state_at, mask=mask_pn, other=0.0).to(tl.float32)

    bb = b.to(tl.int64)
    x = tl.load(x_ptr + bb * s_x_b + h * s_x_h + offs_p * s_x_p, mask=mask_p, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + bb * s_B_b + g * s_B_g + offs_n * s_B_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + bb * s_C_b + g * s_C_g + offs_n * s_C_n, mask=mask_n, other=0.0).to(tl.float32)
    dt_raw = tl.load(dt_ptr + bb * s_dt_b + h * s_dt_h).to(tl.float32)
    s, dt = _ssm_step(s, x, Bv, dt_raw, A, dt_bias, dt_min)
    y = tl.sum(s * Cv[None, :], axis=1) + D * x  # [BLOCK_P], from the fp32 state
    tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=mask_pn)
    tl.store(y_ptr + bb * s_y_b + h * s_y_h + offs_p * s_y_p, round_to(y, y_ptr.dtype.element_ty), mask=mask_p)


@triton.jit
def _ssu_verify_kernel(
    state_ptr, px_ptr, pB_ptr, pdt_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr,
    slot_ptr, replay_ptr, num_tokens_ptr, y_ptr,
    T, H, P, N, heads_per_group, dt_min,
    s_state_slot, s_state_h, s_state_p, s_state_n,
    s_px_slot, s_px_t, s_px_h, s_px_p,
    s_pB_slot, s_pB_t, s_pB_g, s_pB_n,
    s_pdt_slot, s_pdt_t, s_pdt_h,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_y_b, s_y_t, s_y_h, s_y_p,
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_p, h, b = _program_tile(H, P, BLOCK_P)
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

    slot = tl.load(slot_ptr + b).to(tl.int64)
    state_at = state_ptr + h.to(tl.int64) * s_state_h + slot * s_state_slot + tile
    s = tl.load(state_at, mask=mask_pn, other=0.0).to(tl.float32)

    # Replay the accepted positions of the slot's last verify from their recorded inputs, each rounded to
    # the pool dtype as a decode step stores it; then store the committed state, once.
    n_rep = tl.load(replay_ptr + b).to(tl.int32)
    px_row = px_ptr + slot * s_px_slot + h * s_px_h
    pB_row = pB_ptr + slot * s_pB_slot + g * s_pB_g
    pdt_row = pdt_ptr + slot * s_pdt_slot + h * s_pdt_h
    for j in range(n_rep):
        x = tl.load(px_row + j * s_px_t + offs_p * s_px_p, mask=mask_p, other=0.0).to(tl.float32)
        Bv = tl.load(pB_row + j * s_pB_t + offs_n * s_pB_n, mask=mask_n, other=0.0).to(tl.float32)
        dt_raw = tl.load(pdt_row + j * s_pdt_t).to(tl.float32)
        s, dt = _ssm_step(s, x, Bv, dt_raw, A, dt_bias, dt_min)
        s = round_to(s, state_ptr.dtype.element_ty).to(tl.float32)
    p_limit = tl.where(n_rep > 0, P, 0)
    tl.store(state_at, round_to(s, state_ptr.dtype.element_ty),
             mask=(offs_p < p_limit)[:, None] & mask_n[None, :])

    # This step's T positions, in registers only: no per-position state is stored.
    x_row = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h
    dt_row = dt_ptr + b.to(tl.int64) * s_dt_b + h * s_dt_h
    B_row = B_ptr + b.to(tl.int64) * s_B_b + g * s_B_g
    C_row = C_ptr + b.to(tl.int64) * s_C_b + g * s_C_g
    y_row = y_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
    for t in range(T):
        x = tl.load(x_row + t * s_x_t + offs_p * s_x_p, mask=mask_p, other=0.0).to(tl.float32)  # [BLOCK_P]
        Bv = tl.load(B_row + t * s_B_t + offs_n * s_B_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        Cv = tl.load(C_row + t * s_C_t + offs_n * s_C_n, mask=mask_n, other=0.0).to(tl.float32)  # [BLOCK_N]
        dt_raw = tl.load(dt_row + t * s_dt_t).to(tl.float32)
        s, dt = _ssm_step(s, x, Bv, dt_raw, A, dt_bias, dt_min)
        y = tl.sum(s * Cv[None, :], axis=1) + D * x  # [BLOCK_P], from the fp32 state
        # The next position reads what the pool would hold, as a decode step (and a later replay) does.
        s = round_to(s, state_ptr.dtype.element_ty).to(tl.float32)
        y = tl.where(t < n_valid, y, 0.0)
        tl.store(y_row + t * s_y_t + offs_p * s_y_p, round_to(y, y_ptr.dtype.element_ty), mask=mask_p)


def _launch_config(P: int, N: int, verify: bool = False, batch: int = 0) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps): the whole N in one tile; about 1024 state elements per program for
    decode and 2048 for verify, the best of a tile sweep at the 8b-like size. Decode batches of ONE_WARP_ROWS rows
    or more take one warp, fewer two: chosen by timing whole decode steps (`benchmarks/launch_probe.py`), where
    the kernels alone could not tell them apart.
    Verify takes one warp at every batch: with two, each position's B, C and y change layout between the warps
    through shared memory, while one warp shuffles them in registers."""
    block_n = next_power_of_2(N)
    block_p = min(next_power_of_2(P), max(1, (2048 if verify else 1024) // block_n))
    return block_p, block_n, 1 if verify or batch >= ONE_WARP_ROWS else 2


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
    if batch:
        block_p, block_n, num_warps = _launch_config(P, N, batch=batch)
        _ssu_decode_kernel[(cdiv(P, block_p) * H * batch,)](
            ssm_state, x, dt, A, B, C, D, dt_bias, state_slots, y,
            H, P, N, H // G, float(dt_min),
            *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
            BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps, **pdl(x),
        )  # fmt: skip
    return y


@triton.jit
def _copy_row(src, dst, width, BLOCK: tl.constexpr):
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(src + offs, mask=offs < width, other=0.0).to(tl.float32)
        tl.store(dst + offs, round_to(v, dst.dtype.element_ty), mask=offs < width)


@triton.jit
def _record_kernel(
    x_ptr, B_ptr, dt_ptr, px_ptr, pB_ptr, pdt_ptr, slot_ptr, wx, wB, wdt,
    s_x_b, s_x_t, s_B_b, s_B_t, s_dt_b, s_dt_t,
    s_px_slot, s_px_t, s_pB_slot, s_pB_t, s_pdt_slot, s_pdt_t,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """pending_*[slots[b], t] = this step's x / B / dt of (b, t), cast to the pending dtype; program axis 2
    picks the tensor. Each token's inputs are unit-stride (widths H*P, G*N, H)."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    which = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    b64 = b.to(tl.int64)
    if which == 0:
        _copy_row(x_ptr + b64 * s_x_b + t * s_x_t, px_ptr + slot * s_px_slot + t * s_px_t, wx, BLOCK)
    elif which == 1:
        _copy_row(B_ptr + b64 * s_B_b + t * s_B_t, pB_ptr + slot * s_pB_slot + t * s_pB_t, wB, BLOCK)
    else:
        _copy_row(dt_ptr + b64 * s_dt_b + t * s_dt_t, pdt_ptr + slot * s_pdt_slot + t * s_pdt_t, wdt, BLOCK)


def _token_rows(t: Tensor) -> Tensor:
    """[B, T, ...] -> [B, T, width] with unit stride inside a token (a view for the step's split inputs)."""
    t3 = t.reshape(t.shape[0], t.shape[1], -1)
    return t3 if t3.stride(2) == 1 else t3.contiguous()


def _record_pending(pending_x: Tensor, pending_B: Tensor, pending_dt: Tensor, x: Tensor, B: Tensor, dt: Tensor,
                    slots: Tensor) -> None:
    """pending_*[slots, :T] = x / B / dt in one launch (the reference's three indexed stores)."""
    batch, T = x.shape[:2]
    if not batch:
        return
    src = [_token_rows(v) for v in (x, B, dt)]
    dst = [p.view(p.shape[0], p.shape[1], -1) for p in (pending_x, pending_B, pending_dt)]
    _record_kernel[(batch, T, 3)](
        *src, *dst, slots, *(v.shape[2] for v in src),
        *(st for v in src for st in v.stride()[:2]), *(st for p in dst for st in p.stride()[:2]),
        BLOCK=RECORD_BLOCK, num_warps=4,
    )  # fmt: skip


def selective_state_update_verify_triton(
    ssm_state: Tensor,
    pending_x: Tensor,
    pending_B: Tensor,
    pending_dt: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    replay: Tensor,
    dt_min: float,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Replay each row's `replay[b]` pending positions into its state (stored once), then its T verify
    tokens; this step's inputs become the slot's pending ones (`selective_state_update_verify`).

    ssm_state [S, H, P, N]; pending_x [S, L, H, P], pending_B [S, L, G, N], pending_dt [S, L, H] with L >= T;
    x [B, T, H, P]; dt [B, T, H] raw; A, D, dt_bias [H]; B, C [B, T, G, N]; slots [B]; replay [B] in 0..L;
    num_tokens [B] in 1..T (None: all T). Index values are unchecked (see the module docstring).
    Returns y [B, T, H, P] in x.dtype, zero past num_tokens.
    """
    fn = "selective_state_update_verify_triton"
    if x.dim() != 4 or ssm_state.dim() != 4 or B.dim() != 4 or pending_x.dim() != 4:
        raise ValueError(
            f"{fn}: expected x [B, T, H, P], ssm_state [S, H, P, N], B [B, T, G, N], pending_x [S, L, H, P], "
            f"got x {tuple(x.shape)}, ssm_state {tuple(ssm_state.shape)}, B {tuple(B.shape)}, "
            f"pending_x {tuple(pending_x.shape)}"
        )
    check_verify_shapes(fn, ssm_state, pending_x, pending_B, pending_dt, x, dt, A, B, C, D, dt_bias, slots,
                        replay, num_tokens)
    batch, T, H, P = x.shape
    N, G = ssm_state.shape[3], B.shape[2]
    y = torch.empty_like(x)
    if batch:
        block_p, block_n, num_warps = _launch_config(P, N, verify=True)
        _ssu_verify_kernel[(cdiv(P, block_p) * H * batch,)](
            ssm_state, pending_x, pending_B, pending_dt, x, dt, A, B, C, D, dt_bias,
            slots, replay, slots if num_tokens is None else num_tokens, y,
            T, H, P, N, H // G, float(dt_min),
            *ssm_state.stride(), *pending_x.stride(), *pending_B.stride(), *pending_dt.stride(),
            *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
            HAS_NUM_TOKENS=num_tokens is not None, BLOCK_P=block_p, BLOCK_N=block_n, num_warps=num_warps,
        )  # fmt: skip
    # This step's inputs are the next step's pending ones. Written after the kernel (stream order): every
    # head's programs read the group's pending B, so an in-kernel write would race with their replay. One
    # launch for all three.
    _record_pending(pending_x, pending_B, pending_dt, x, B, dt, slots)
    return y
