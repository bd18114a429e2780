"""Triton kernels of the Gated DeltaNet decode (one token per row) and speculative verify (T = 1+K tokens per row,
by replay), beside their torch references.

Same signatures, semantics and return values as `gated_delta_decode` and `gated_delta_verify` (`reference.py`); see
there for the math. Tiles: one per (row, value head h, block of BLOCK_V value columns), numbered with the value
block fastest, then the head (`_tile_of`); one program per tile, but decode may give a program several consecutive
tiles (`tuning.DECODE_LAUNCH`). A program holds its [Dk, BLOCK_V] state tile in fp32 registers,
reads it from the row's slot once and computes from the RAW inputs in-kernel: q and k of key head h // (Hv // Hk)
l2-normalised (q scaled by Dk^-0.5), g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) rounded to b's
dtype. One step decays the tile by exp(g) and adds outer(k, beta * (v - S^T k)); the output o = S^T q reads the fp32
state before it is rounded for the pool.

Decode advances the tile by the row's token and stores it back. Verify replays the slot's `replay[b]` pending
positions (each rounded to the pool dtype, as a decode step stores it: the committed state is the decode kernel's
bit for bit), stores that state once (only where replay[b] > 0), then steps over the row's T positions in registers
only (each rounded as the pool would hold it), zeroes the outputs past num_tokens[b], and finally, in a second
launch, records this step's raw k, v, a, b as the slot's pending inputs at [slot, :T].

No host reads of device tensors: only shapes are checked here; index values are the caller's contract, unchecked
(an out-of-range slot is an out-of-bounds access on the GPU): slots are distinct values in [0, S); verify:
num_tokens[b] in 1..T, replay[b] in 0..L. The references check all of this with host reads; run them when in doubt.
On the GPU `exp` and `rsqrt` are the fast approximations, so results agree with the references to a few fp32 ulps.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.checks import check_decode_shapes, check_verify_shapes
from baton.engine.ops.gated_delta.tuning import RECORD_BLOCK, STEP_TILE, STEP_WARPS, decode_launch
from baton.engine.ops.triton_common import cdiv, next_power_of_2, pdl, pdl_wait, round_to, softplus


@triton.jit
def _unit(ptr, offs, mask):
    """fp32 l2-normalised vector loaded at ptr + offs (masked lanes 0), as the reference's `_unit`."""
    x = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) + 1e-6)


@triton.jit
def _gates(a_raw, b_raw, neg_A, dt_bias, BETA_DTYPE: tl.constexpr):
    """(g, beta) of one token: g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b) rounded to b's dtype,
    as the reference takes the sigmoid in that dtype."""
    g = neg_A * softplus(a_raw.to(tl.float32) + dt_bias)
    beta = tl.math.div_rn(1.0, 1.0 + tl.exp(-b_raw.to(tl.float32)))
    return g, round_to(beta, BETA_DTYPE).to(tl.float32)


@triton.jit
def _delta_step(s, k, v, g, beta):
    """One delta-rule step of an fp32 [BLOCK_K, BLOCK_V] state tile with unit key k [BLOCK_K], value v [BLOCK_V]."""
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
    return s + k[:, None] * delta[None, :]


@triton.jit
def _tile_of(p, Hv, Dv, BLOCK_V: tl.constexpr):
    """(block of Dv, value head, row) of tile number p: the value block varies fastest, then the head, so
    consecutive tiles walk one slot's [Hv, Dk, Dv] state contiguously."""
    n_blocks = tl.cdiv(Dv, BLOCK_V)
    return p % n_blocks, (p // n_blocks) % Hv, p // (n_blocks * Hv)


@triton.jit
def _program_tile(Hv, Dv, BLOCK_V: tl.constexpr):
    """(block of Dv, value head, row) of this program's one tile (`_tile_of`)."""
    return _tile_of(tl.program_id(0), Hv, Dv, BLOCK_V)


@triton.jit
def _load_state_at(state_ptr, slot_ptr, p, Hv, Dv, s_st_slot, s_st_h, s_st_k, s_st_v, offs_k, offs_vb, mask_k,
                   BLOCK_V: tl.constexpr, STREAM: tl.constexpr):  # fmt: skip
    """The fp32 [BLOCK_K, BLOCK_V] state tile of decode tile number p (a real tile: the caller clamps)."""
    pid_v, h, b = _tile_of(p, Hv, Dv, BLOCK_V)
    offs_v = pid_v * BLOCK_V + offs_vb
    mask = mask_k[:, None] & (offs_v < Dv)[None, :]
    # 64-bit slot offsets: a pool can hold more than 2**31 elements.
    slot = tl.load(slot_ptr + b).to(tl.int64)
    at = state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
    if STREAM:  # read once per step: not worth a place in L2
        x = tl.load(at, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(at, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _gdn_decode_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, slot_ptr, o_ptr,
    n_tiles, Hv, Dk, Dv, heads_per_key, scale,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_q_b, s_q_h, s_q_d,
    s_k_b, s_k_h, s_k_d,
    s_v_b, s_v_h, s_v_d,
    s_a_b, s_a_h,
    s_b_b, s_b_h,
    s_o_b, s_o_h, s_o_d,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    TILES: tl.constexpr,
    STREAM: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # TILES consecutive tiles per program, the next one's state load issued before this one's update and store, so
    # a program keeps a read in flight while it computes.
    first = tl.program_id(0) * TILES
    offs_k = tl.arange(0, BLOCK_K)
    offs_vb = tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    pdl_wait(PDL)
    # Tiles past the end (the last program's, when TILES does not divide the count) redo the last tile's reads and
    # store nothing.
    last = n_tiles - 1
    s_next = _load_state_at(state_ptr, slot_ptr, tl.minimum(first, last), Hv, Dv, s_st_slot, s_st_h, s_st_k, s_st_v,
                            offs_k, offs_vb, mask_k, BLOCK_V, STREAM)  # fmt: skip
    for i in tl.static_range(TILES):
        p = tl.minimum(first + i, last)
        s = s_next
        if i + 1 < TILES:
            s_next = _load_state_at(state_ptr, slot_ptr, tl.minimum(first + i + 1, last), Hv, Dv, s_st_slot, s_st_h,
                                    s_st_k, s_st_v, offs_k, offs_vb, mask_k, BLOCK_V, STREAM)  # fmt: skip
        pid_v, h, b = _tile_of(p, Hv, Dv, BLOCK_V)
        kh = h // heads_per_key
        offs_v = pid_v * BLOCK_V + offs_vb
        mask_v = (offs_v < Dv) & (first + i + offs_vb * 0 < n_tiles)
        neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
        bb = b.to(tl.int64)
        q = _unit(q_ptr + bb * s_q_b + kh * s_q_h, offs_k * s_q_d, mask_k) * scale
        k = _unit(k_ptr + bb * s_k_b + kh * s_k_h, offs_k * s_k_d, mask_k)
        v = tl.load(v_ptr + bb * s_v_b + h * s_v_h + offs_v * s_v_d, mask=mask_v, other=0.0).to(tl.float32)
        g, beta = _gates(tl.load(a_ptr + bb * s_a_b + h * s_a_h), tl.load(b_ptr + bb * s_b_b + h * s_b_h), neg_A,
                         dt_bias, b_ptr.dtype.element_ty)  # fmt: skip
        s = _delta_step(s, k, v, g, beta)
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V], from the fp32 state
        slot = tl.load(slot_ptr + b).to(tl.int64)
        state_at = (state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h + offs_k[:, None] * s_st_k
                    + offs_v[None, :] * s_st_v)  # fmt: skip
        mask_kv = mask_k[:, None] & mask_v[None, :]
        if STREAM:  # written once, read next step: streamed past L2
            tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=mask_kv, cache_modifier=".cs")
        else:
            tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=mask_kv)
        tl.store(o_ptr + bb * s_o_b + h * s_o_h + offs_v * s_o_d, round_to(o, o_ptr.dtype.element_ty), mask=mask_v)


@triton.jit
def _gdn_verify_kernel(
    state_ptr, pk_ptr, pv_ptr, pa_ptr, pb_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr,
    slot_ptr, replay_ptr, num_tokens_ptr, o_ptr,
    T, Hv, Dk, Dv, heads_per_key, scale,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_pk_slot, s_pk_t, s_pk_h, s_pk_d,
    s_pv_slot, s_pv_t, s_pv_h, s_pv_d,
    s_pa_slot, s_pa_t, s_pa_h,
    s_pb_slot, s_pb_t, s_pb_h,
    s_q_b, s_q_t, s_q_h, s_q_d,
    s_k_b, s_k_t, s_k_h, s_k_d,
    s_v_b, s_v_t, s_v_h, s_v_d,
    s_a_b, s_a_t, s_a_h,
    s_b_b, s_b_t, s_b_h,
    s_o_b, s_o_t, s_o_h, s_o_d,
    HAS_NUM_TOKENS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid_v, h, b = _program_tile(Hv, Dv, BLOCK_V)
    kh = h // heads_per_key
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    mask_kv = mask_k[:, None] & mask_v[None, :]
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v  # [BLOCK_K, BLOCK_V]

    if HAS_NUM_TOKENS:  # noqa: SIM108 (a compile-time branch: the other one is never built)
        n_valid = tl.load(num_tokens_ptr + b).to(tl.int32)
    else:
        n_valid = T
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    slot = tl.load(slot_ptr + b).to(tl.int64)
    state_at = state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h + tile
    s = tl.load(state_at, mask=mask_kv, other=0.0).to(tl.float32)

    # Replay the accepted positions of the slot's last verify from their recorded raw inputs, each rounded to the
    # pool dtype as a decode step stores it; then store the committed state, once.
    n_rep = tl.load(replay_ptr + b).to(tl.int32)
    pk_row = pk_ptr + slot * s_pk_slot + kh * s_pk_h
    pv_row = pv_ptr + slot * s_pv_slot + h * s_pv_h
    pa_row = pa_ptr + slot * s_pa_slot + h * s_pa_h
    pb_row = pb_ptr + slot * s_pb_slot + h * s_pb_h
    for j in range(n_rep):
        k = _unit(pk_row + j * s_pk_t, offs_k * s_pk_d, mask_k)
        v = tl.load(pv_row + j * s_pv_t + offs_v * s_pv_d, mask=mask_v, other=0.0).to(tl.float32)
        g, beta = _gates(tl.load(pa_row + j * s_pa_t), tl.load(pb_row + j * s_pb_t), neg_A, dt_bias,
                         pb_ptr.dtype.element_ty)  # fmt: skip
        s = _delta_step(s, k, v, g, beta)
        s = round_to(s, state_ptr.dtype.element_ty).to(tl.float32)
    k_limit = tl.where(n_rep > 0, Dk, 0)
    tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=(offs_k < k_limit)[:, None] & mask_v[None, :])

    # This step's T positions, in registers only: no per-position state is stored.
    bb = b.to(tl.int64)
    q_row = q_ptr + bb * s_q_b + kh * s_q_h
    k_row = k_ptr + bb * s_k_b + kh * s_k_h
    v_row = v_ptr + bb * s_v_b + h * s_v_h
    a_row = a_ptr + bb * s_a_b + h * s_a_h
    b_row = b_ptr + bb * s_b_b + h * s_b_h
    o_row = o_ptr + bb * s_o_b + h * s_o_h
    for t in range(T):
        q = _unit(q_row + t * s_q_t, offs_k * s_q_d, mask_k) * scale
        k = _unit(k_row + t * s_k_t, offs_k * s_k_d, mask_k)
        v = tl.load(v_row + t * s_v_t + offs_v * s_v_d, mask=mask_v, other=0.0).to(tl.float32)
        g, beta = _gates(tl.load(a_row + t * s_a_t), tl.load(b_row + t * s_b_t), neg_A, dt_bias,
                         b_ptr.dtype.element_ty)  # fmt: skip
        s = _delta_step(s, k, v, g, beta)
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V], from the fp32 state
        # The next position reads what the pool would hold, as a decode step (and a later replay) does.
        s = round_to(s, state_ptr.dtype.element_ty).to(tl.float32)
        o = tl.where(t < n_valid, o, 0.0)
        tl.store(o_row + t * s_o_t + offs_v * s_o_d, round_to(o, o_ptr.dtype.element_ty), mask=mask_v)


def launch_config(Dk: int, Dv: int, tile: int = STEP_TILE) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): the whole Dk in one tile, Dv split so the tile holds about `tile` state elements."""
    block_k = next_power_of_2(Dk)
    return block_k, min(next_power_of_2(Dv), max(1, tile // block_k))


def gated_delta_decode_triton(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state_slots: Tensor,
    *,
    tile: int | None = None,
    num_warps: int | None = None,
    tiles: int | None = None,
    stream: bool | None = None,
) -> Tensor:
    """Advance each row's state by one token and return that token's output (`gated_delta_decode`).

    state [S, Hv, Dk, Dv] pool, updated in place at `state_slots` only; q, k [B, Hk, Dk]; v [B, Hv, Dv]; a, b [B, Hv]
    raw; A_log, dt_bias [Hv]; state_slots [B] distinct ints in [0, S) (unchecked: see the module docstring).
    Returns o [B, Hv, Dv] in v.dtype. `tile`, `num_warps`, `tiles` (tiles per program) and `stream` (L2 eviction
    hints) override the batch size's tuning (`decode_launch`: benchmarks sweep them).
    """
    fn = "gated_delta_decode_triton"
    batch, Hk, Dk, Hv, Dv, _ = check_decode_shapes(fn, state, q, k, v, a, b, A_log, dt_bias, state_slots)

    o = torch.empty_like(v)
    if batch:
        tuned = decode_launch(batch)
        block_k, block_v = launch_config(Dk, Dv, tile or tuned.tile)
        tiles_per_program = tiles or tuned.tiles
        n_tiles = cdiv(Dv, block_v) * Hv * batch
        _gdn_decode_kernel[(cdiv(n_tiles, tiles_per_program),)](
            state, q, k, v, a, b, A_log, dt_bias, state_slots, o,
            n_tiles, Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
            *state.stride(), *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *o.stride(),
            BLOCK_K=block_k, BLOCK_V=block_v, TILES=tiles_per_program,
            STREAM=tuned.stream if stream is None else stream, num_warps=num_warps or tuned.warps, **pdl(v),
        )  # fmt: skip
    return o


@triton.jit
def _copy_row(src, dst, width, BLOCK: tl.constexpr):
    for start in range(0, width, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < width, other=0.0).to(tl.float32)
        tl.store(dst + offs, round_to(x, dst.dtype.element_ty), mask=offs < width)


@triton.jit
def _record_kernel(
    k_ptr, v_ptr, a_ptr, b_ptr, pk_ptr, pv_ptr, pa_ptr, pb_ptr, slot_ptr, wk, wv, wa, wb,
    s_k_b, s_k_t, s_v_b, s_v_t, s_a_b, s_a_t, s_b_b, s_b_t,
    s_pk_slot, s_pk_t, s_pv_slot, s_pv_t, s_pa_slot, s_pa_t, s_pb_slot, s_pb_t,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """pending_*[slots[b], t] = this step's k / v / a / b of (b, t), cast to the pending dtype; program axis 2 picks
    the tensor. Each token's inputs are unit-stride (widths Hk*Dk, Hv*Dv, Hv, Hv)."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    which = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    b64 = b.to(tl.int64)
    if which == 0:
        _copy_row(k_ptr + b64 * s_k_b + t * s_k_t, pk_ptr + slot * s_pk_slot + t * s_pk_t, wk, BLOCK)
    elif which == 1:
        _copy_row(v_ptr + b64 * s_v_b + t * s_v_t, pv_ptr + slot * s_pv_slot + t * s_pv_t, wv, BLOCK)
    elif which == 2:
        _copy_row(a_ptr + b64 * s_a_b + t * s_a_t, pa_ptr + slot * s_pa_slot + t * s_pa_t, wa, BLOCK)
    else:
        _copy_row(b_ptr + b64 * s_b_b + t * s_b_t, pb_ptr + slot * s_pb_slot + t * s_pb_t, wb, BLOCK)


def _token_rows(t: Tensor) -> Tensor:
    """[B, T, ...] -> [B, T, width] with unit stride inside a token (a view for the step's split inputs)."""
    t3 = t.reshape(t.shape[0], t.shape[1], -1)
    return t3 if t3.stride(2) == 1 else t3.contiguous()


def _pending_rows(p: Tensor) -> Tensor:
    """[S, L, ...] -> [S, L, width] view; a pending tensor whose token is not unit-stride inside cannot be viewed."""
    p3 = p.view(p.shape[0], p.shape[1], -1)
    if p3.stride(2) != 1:
        raise ValueError(f"pending tensors expected unit stride inside a position, got strides {p.stride()}")
    return p3


def _record_pending(pending: list[Tensor], inputs: list[Tensor], slots: Tensor) -> None:
    """pending_*[slots, :T] = k / v / a / b in one launch (the reference's four indexed stores)."""
    batch, T = inputs[0].shape[:2]
    if not batch:
        return
    src = [_token_rows(x) for x in inputs]
    dst = [_pending_rows(p) for p in pending]
    _record_kernel[(batch, T, 4)](
        *src, *dst, slots, *(x.shape[2] for x in src),
        *(st for x in src for st in x.stride()[:2]), *(st for p in dst for st in p.stride()[:2]),
        BLOCK=RECORD_BLOCK, num_warps=4,
    )  # fmt: skip


def gated_delta_verify_triton(
    state: Tensor,
    pending_k: Tensor,
    pending_v: Tensor,
    pending_a: Tensor,
    pending_b: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    slots: Tensor,
    replay: Tensor,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """Replay each row's `replay[b]` pending positions into its state (stored once), then run its T verify tokens;
    this step's raw inputs become the slot's pending ones (`gated_delta_verify`).

    state [S, Hv, Dk, Dv]; pending_k [S, L, Hk, Dk], pending_v [S, L, Hv, Dv], pending_a, pending_b [S, L, Hv] with
    L >= T; q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv] raw; A_log, dt_bias [Hv]; slots [B]; replay [B] in
    0..L; num_tokens [B] in 1..T (None: all T). Index values are unchecked (see the module docstring).
    Returns o [B, T, Hv, Dv] in v.dtype, zero past num_tokens.
    """
    fn = "gated_delta_verify_triton"
    batch, T, Hk, Dk, Hv, Dv, _ = check_verify_shapes(fn, state, pending_k, pending_v, pending_a, pending_b, q, k, v,
                                                      a, b, A_log, dt_bias, slots, replay, num_tokens)
    o = torch.empty_like(v)
    if batch:
        block_k, block_v = launch_config(Dk, Dv)
        _gdn_verify_kernel[(cdiv(Dv, block_v) * Hv * batch,)](
            state, pending_k, pending_v, pending_a, pending_b, q, k, v, a, b, A_log, dt_bias,
            slots, replay, slots if num_tokens is None else num_tokens, o,
            T, Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
            *state.stride(), *pending_k.stride(), *pending_v.stride(), *pending_a.stride(), *pending_b.stride(),
            *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *o.stride(),
            HAS_NUM_TOKENS=num_tokens is not None, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=STEP_WARPS,
        )  # fmt: skip
    # This step's inputs are the next step's pending ones. Written after the kernel (stream order): every value
    # head's programs read the key head's pending k, so an in-kernel write would race with their replay.
    _record_pending([pending_k, pending_v, pending_a, pending_b], [k, v, a, b], slots)
    return o
