"""Triton kernels of the Gated DeltaNet varlen prefill with initial and final states in pool slots, beside their torch
reference `gated_delta_prefill_varlen` (`reference.py`): same signature, semantics and return value.

Grid (both kernels): one program per (row, value head h, block of BLOCK_V value columns), numbered with the value
block fastest, then the head. A program reads its row's bounds from `query_start_loc` and its [Dk, BLOCK_V] start
state from the row's slot (zeros, the slot never read, where has_initial_state[r] is False), walks the row with the
state in fp32 registers and stores the final state once, rounded to the pool dtype. q and k (key head h // (Hv //
Hk)) are l2-normalised and the gates computed in-kernel from the raw inputs, as in the decode kernel.

Algorithms, picked by `chunked(chunk_size)`:
- chunked (power-of-two chunk_size >= MIN_DOT): the reference's WY/UT form, chunk after chunk of `chunk_size` tokens
  counted from the row's first token (the last one padded with tokens that leave the state as it is): (I + L)^-1 by
  forward substitution, u and w from it, v_new = u - w S, o = (q exp(cum)) S + (q k^T * decay) v_new, then
  S = exp(cum_last) S + (k exp(cum_last - cum))^T v_new; the products are tl.dot in DOT_PRECISION.
- token by token (any other chunk_size): the decode kernel's step per token, o = S^T q from the fp32 state.
Both agree with the reference to fp32 rounding, not bit for bit. Rows and heads run in parallel; the chunks (tokens)
of a row run in order, so a long row is the kernel's critical path.

No host reads of device tensors: only shapes are checked here; query_start_loc (non-decreasing from 0 to T),
distinct slots in [0, S) and chunk_size > 0 are the caller's contract, unchecked (the reference checks them).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.checks import check_prefill_shapes
from baton.engine.ops.gated_delta.kernel import (
    _delta_step,
    _gates,
    _program_tile,
    _unit,
    launch_config,
)
from baton.engine.ops.gated_delta.tuning import (
    CHUNKED_TILE,
    CHUNKED_WARPS,
    DOT_PRECISION,
    PREFILL_TILE,
    STEP_WARPS,
)
from baton.engine.ops.triton_common import cdiv, next_power_of_2, round_to

# tl.dot's smallest tile side.
MIN_DOT = 16


@triton.jit
def _gdn_prefill_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, qsl_ptr, slot_ptr, init_ptr, o_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_q_t, s_q_h, s_q_d,
    s_k_t, s_k_h, s_k_d,
    s_v_t, s_v_h, s_v_d,
    s_a_t, s_a_h,
    s_b_t, s_b_h,
    s_o_t, s_o_h, s_o_d,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    pid_v, h, r = _program_tile(Hv, Dv, BLOCK_V)
    kh = h // heads_per_key
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    mask_kv = mask_k[:, None] & mask_v[None, :]
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v  # [BLOCK_K, BLOCK_V]

    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    lo = tl.load(qsl_ptr + r).to(tl.int64)
    hi = tl.load(qsl_ptr + r + 1).to(tl.int64)
    k_limit = tl.where(tl.load(init_ptr + r) != 0, Dk, 0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    state_at = state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h + tile
    # A row without an initial state starts from zeros: the masked load never touches its slot.
    s = tl.load(state_at, mask=(offs_k < k_limit)[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

    q_col = q_ptr + kh * s_q_h + offs_k * s_q_d
    k_col = k_ptr + kh * s_k_h + offs_k * s_k_d
    v_col = v_ptr + h * s_v_h + offs_v * s_v_d
    o_col = o_ptr + h * s_o_h + offs_v * s_o_d
    for t in range(lo, hi):
        q = _unit(q_col + t * s_q_t, 0, mask_k) * scale
        k = _unit(k_col + t * s_k_t, 0, mask_k)
        v = tl.load(v_col + t * s_v_t, mask=mask_v, other=0.0).to(tl.float32)
        g, beta = _gates(tl.load(a_ptr + t * s_a_t + h * s_a_h), tl.load(b_ptr + t * s_b_t + h * s_b_h), neg_A,
                         dt_bias, b_ptr.dtype.element_ty)  # fmt: skip
        s = _delta_step(s, k, v, g, beta)
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V]
        tl.store(o_col + t * s_o_t, round_to(o, o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=mask_kv)


@triton.jit
def _gdn_prefill_chunked_kernel(
    state_ptr, q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, qsl_ptr, slot_ptr, init_ptr, o_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_q_t, s_q_h, s_q_d,
    s_k_t, s_k_h, s_k_d,
    s_v_t, s_v_h, s_v_d,
    s_a_t, s_a_h,
    s_b_t, s_b_h,
    s_o_t, s_o_h, s_o_d,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    pid_v, h, r = _program_tile(Hv, Dv, BLOCK_V)
    kh = h // heads_per_key
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v  # [BLOCK_K, BLOCK_V]
    causal = offs_c[:, None] >= offs_c[None, :]  # [CHUNK, CHUNK]: position j at or before position i
    eye = offs_c[:, None] == offs_c[None, :]

    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    lo = tl.load(qsl_ptr + r).to(tl.int64)
    hi = tl.load(qsl_ptr + r + 1).to(tl.int64)
    k_limit = tl.where(tl.load(init_ptr + r) != 0, Dk, 0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    state_at = state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h + tile
    # A row without an initial state starts from zeros: the masked load never touches its slot.
    s = tl.load(state_at, mask=(offs_k < k_limit)[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

    for c0 in range(lo, hi, CHUNK):
        t = c0 + offs_c  # [CHUNK] token indices; those at or past hi are padding
        valid = t < hi
        mask_ck = valid[:, None] & mask_k[None, :]
        mask_cv = valid[:, None] & mask_v[None, :]
        k = tl.load(k_ptr + t[:, None] * s_k_t + kh * s_k_h + offs_k[None, :] * s_k_d, mask=mask_ck, other=0.0)
        k = k.to(tl.float32)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]  # [CHUNK, BLOCK_K]
        v = tl.load(v_ptr + t[:, None] * s_v_t + h * s_v_h + offs_v[None, :] * s_v_d, mask=mask_cv, other=0.0)
        g, beta = _gates(tl.load(a_ptr + t * s_a_t + h * s_a_h, mask=valid, other=0.0),
                         tl.load(b_ptr + t * s_b_t + h * s_b_h, mask=valid, other=0.0), neg_A, dt_bias,
                         b_ptr.dtype.element_ty)  # fmt: skip
        # Padding tokens get g = 0 and beta = 0 (with k = v = 0): they leave the state as it is.
        g = tl.where(valid, g, 0.0)
        beta = tl.where(valid, beta, 0.0)
        cum = tl.cumsum(g, axis=0)  # [CHUNK]: log decay from the chunk's start to position i, inclusive
        cum_last = tl.sum(tl.where(offs_c == CHUNK - 1, cum, 0.0), axis=0)
        # decay[i, j]: from position j to position i (0 where j > i; masked before it can overflow).
        decay = tl.where(causal, tl.exp(cum[:, None] - cum[None, :]), 0.0)  # [CHUNK, CHUNK]

        # The UT transform: (I + L)^-1 with L the strictly lower part of (k_beta k^T) * decay, by forward
        # substitution one row at a time (rows before i are already final when row i is updated).
        k_beta = k * beta[:, None]
        inv = -tl.where(eye, 0.0, tl.dot(k_beta, tl.trans(k), input_precision=DOT_PRECISION) * decay)
        for i in range(1, CHUNK):
            row = tl.sum(tl.where(offs_c[:, None] == i, inv, 0.0), axis=0)  # [CHUNK], nonzero before i
            row = row + tl.sum(row[:, None] * inv, axis=0)
            inv = tl.where(offs_c[:, None] == i, row[None, :], inv)
        inv = tl.where(eye, 1.0, inv)
        u = tl.dot(inv, v.to(tl.float32) * beta[:, None], input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]
        w = tl.dot(inv, k_beta * tl.exp(cum)[:, None], input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_K]
        # The part of each write that the chunk's start state already predicts is not written again.
        v_new = u - tl.dot(w, s, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]

        q = tl.load(q_ptr + t[:, None] * s_q_t + kh * s_q_h + offs_k[None, :] * s_q_d, mask=mask_ck, other=0.0)
        q = q.to(tl.float32)
        q = q * (tl.math.rsqrt(tl.sum(q * q, axis=1) + 1e-6) * scale)[:, None]  # [CHUNK, BLOCK_K]
        attn = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * decay  # [CHUNK, CHUNK], causal
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=DOT_PRECISION)
        o += tl.dot(attn, v_new, input_precision=DOT_PRECISION)  # [CHUNK, BLOCK_V]
        tl.store(o_ptr + t[:, None] * s_o_t + h * s_o_h + offs_v[None, :] * s_o_d,
                 round_to(o, o_ptr.dtype.element_ty), mask=mask_cv)  # fmt: skip

        k_to_end = k * tl.exp(cum_last - cum)[:, None]  # [CHUNK, BLOCK_K]
        s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision=DOT_PRECISION)
    tl.store(state_at, round_to(s, state_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_v[None, :])


def chunked(chunk_size: int) -> bool:
    """Whether a prefill of `chunk_size` runs the chunked kernel: its tiles need a power of two of at least MIN_DOT
    tokens; any other chunk size runs the token-by-token kernel (same results to fp32 rounding)."""
    return chunk_size >= MIN_DOT and chunk_size & (chunk_size - 1) == 0


def gated_delta_prefill_varlen_triton(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    query_start_loc: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    chunk_size: int,
) -> Tensor:
    """Run every prefill row of a varlen batch; write each row's final state into its pool slot
    (`gated_delta_prefill_varlen`).

    state [S, Hv, Dk, Dv] pool; q, k [T, Hk, Dk]; v [T, Hv, Dv]; a, b [T, Hv] raw; A_log, dt_bias [Hv];
    query_start_loc [R+1]; state_slots [R] distinct; has_initial_state [R] bool (False: the row starts from zeros
    and its slot's old contents are never read). Index values are unchecked (see the module docstring).
    Returns o [T, Hv, Dv] in v.dtype.
    """
    fn = "gated_delta_prefill_varlen_triton"
    T, Hk, Dk, Hv, Dv, S, R = check_prefill_shapes(fn, state, q, k, v, a, b, A_log, dt_bias, query_start_loc,
                                                   state_slots, has_initial_state, chunk_size)

    # A bool tensor read as bytes (a view, no copy): one flag load per row on any Triton.
    init_flags = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    o = torch.empty_like(v)
    if not R:
        return o
    args = (
        state, q, k, v, a, b, A_log, dt_bias, query_start_loc, state_slots, init_flags, o,
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *state.stride(), *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *o.stride(),
    )  # fmt: skip
    if chunked(chunk_size):
        block_k = max(MIN_DOT, next_power_of_2(Dk))
        block_v = max(MIN_DOT, min(next_power_of_2(Dv), CHUNKED_TILE // block_k))
        _gdn_prefill_chunked_kernel[(cdiv(Dv, block_v) * Hv * R,)](
            *args, CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, DOT_PRECISION=DOT_PRECISION,
            num_warps=CHUNKED_WARPS,
        )  # fmt: skip
    else:
        block_k, block_v = launch_config(Dk, Dv, PREFILL_TILE)
        _gdn_prefill_kernel[(cdiv(Dv, block_v) * Hv * R,)](*args, BLOCK_K=block_k, BLOCK_V=block_v,
                                                             num_warps=STEP_WARPS)  # fmt: skip
    return o
