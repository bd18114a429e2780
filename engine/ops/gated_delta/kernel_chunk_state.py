"""The split second stage of the chunk-parallel Gated DeltaNet prefill (`tuning.WY_SPLIT_SCAN`), the shape
flash-linear-attention gives it: after the chunk table and the prep of `kernel_chunk_wy.py` (which here also writes
the decayed keys kd = k exp(G_last - G)),

1. `_wy_state_kernel`, one program per (row, value head, block of BLOCK_V value columns): the [Dk, BLOCK_V] state in
   fp32 registers from the row's slot (zeros, the slot never read, where has_initial_state[r] is False), then per
   chunk only the recurrence: the chunk's start state S goes to a per-(chunk, head) scratch, V' = U - W S goes to
   another, and S = exp(G_last) S + kd^T V'; the final state is stored once, rounded to the pool dtype. Two
   dependent products per chunk are all the serial path holds.
2. `_wy_output_kernel`, one program per (chunk, value head, block of value columns), all independent:
   O = (q exp(G)) S_start + P V' from the stored start state, new values and the prep's scores.

Precision as the fused scan's: the scratch states and new values are in the dtype the second stage rounds its
products' operands to (bf16 for 16-bit inputs, fp32 for fp32 ones), so both paths multiply the same values.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.kernel import _program_tile
from baton.engine.ops.gated_delta.kernel_chunk_wy import MIN_DOT, _mm, _unit_rows, wy_prepare
from baton.engine.ops.gated_delta.tuning import (
    WY_OUT_TILE,
    WY_OUT_WARPS,
    WY_STATE_STAGES,
    WY_STATE_TILE,
    WY_STATE_WARPS,
)
from baton.engine.ops.triton_common import cdiv, next_power_of_2, round_to


@triton.jit
def _wy_state_kernel(
    state_ptr, qsl_ptr, slot_ptr, init_ptr, first_ptr, w_ptr, u_ptr, kd_ptr, g_ptr, vn_ptr, h_ptr,
    Hv, Dk, Dv,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_DOTS: tl.constexpr,
):  # fmt: skip
    pid_v, h, r = _program_tile(Hv, Dv, BLOCK_V)
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    mask_kv = mask_k[:, None] & mask_v[None, :]

    lo = tl.load(qsl_ptr + r).to(tl.int64)
    hi = tl.load(qsl_ptr + r + 1).to(tl.int64)
    first = tl.load(first_ptr + r).to(tl.int64)
    k_limit = tl.where(tl.load(init_ptr + r) != 0, Dk, 0)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    state_at = state_ptr + slot * s_st_slot + h.to(tl.int64) * s_st_h
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v  # [BLOCK_K, BLOCK_V]
    # A row without an initial state starts from zeros: the masked load never touches its slot.
    s = tl.load(state_at + tile, mask=(offs_k < k_limit)[:, None] & mask_v[None, :], other=0.0).to(tl.float32)

    # 64-bit scalar bases, 32-bit tile offsets: a tile of 64-bit addresses kept across the loop would cost registers.
    rows_k = offs_c[:, None] * Dk + offs_k[None, :]
    rows_v = offs_c[:, None] * Dv + offs_v[None, :]
    tile_h = offs_k[:, None] * Dv + offs_v[None, :]
    for j in range(0, tl.cdiv(hi - lo, CHUNK)):
        e = (first + j) * Hv + h
        cum_last = tl.load(g_ptr + e * CHUNK + CHUNK - 1)
        w = tl.load(w_ptr + e * CHUNK * Dk + rows_k, mask=mask_k[None, :], other=0.0)
        u = tl.load(u_ptr + e * CHUNK * Dv + rows_v, mask=mask_v[None, :], other=0.0)
        kd = tl.load(kd_ptr + e * CHUNK * Dk + rows_k, mask=mask_k[None, :], other=0.0)
        tl.store(h_ptr + e * Dk * Dv + tile_h, round_to(s, h_ptr.dtype.element_ty), mask=mask_kv)
        # The part of each write that the chunk's start state already predicts is not written again.
        v_new = u - _mm(w, s, PRECISION, BF16_DOTS)  # [CHUNK, BLOCK_V]
        tl.store(vn_ptr + e * CHUNK * Dv + rows_v, round_to(v_new, vn_ptr.dtype.element_ty), mask=mask_v[None, :])
        s = s * tl.exp(cum_last) + _mm(tl.trans(kd), v_new, PRECISION, BF16_DOTS)
    tl.store(state_at + tile, round_to(s, state_ptr.dtype.element_ty), mask=mask_kv)


@triton.jit
def _wy_output_kernel(
    q_ptr, cstart_ptr, clen_ptr, p_ptr, g_ptr, vn_ptr, h_ptr, o_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_q_t, s_q_h, s_q_d,
    s_o_t, s_o_h, s_o_d,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_DOTS: tl.constexpr,
):  # fmt: skip
    # The value blocks, then the value heads of one chunk are neighbours: those of one key head read the same q.
    n_vb = tl.cdiv(Dv, BLOCK_V)
    pid = tl.program_id(0)
    pid_v = pid % n_vb
    h = (pid // n_vb) % Hv
    ci = pid // (n_vb * Hv)
    n = tl.load(clen_ptr + ci)
    if n == 0:  # past the batch's last chunk
        return
    kh = h // heads_per_key
    t0 = tl.load(cstart_ptr + ci).to(tl.int64)
    e = ci.to(tl.int64) * Hv + h
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv
    valid = offs_c < n

    cum = tl.load(g_ptr + e * CHUNK + offs_c)
    q = _unit_rows(q_ptr + t0 * s_q_t + kh * s_q_h, offs_c, valid, offs_k, mask_k, s_q_t, s_q_d)
    s = tl.load(h_ptr + e * Dk * Dv + offs_k[:, None] * Dv + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :],
                other=0.0)  # fmt: skip
    o = _mm(q * (scale * tl.exp(cum))[:, None], s, PRECISION, BF16_DOTS)
    v_new = tl.load(vn_ptr + e * CHUNK * Dv + offs_c[:, None] * Dv + offs_v[None, :], mask=mask_v[None, :], other=0.0)
    o += _mm(tl.load(p_ptr + e * CHUNK * CHUNK + offs_c[:, None] * CHUNK + offs_c[None, :]), v_new, PRECISION,
             BF16_DOTS)  # fmt: skip
    tl.store(o_ptr + t0 * s_o_t + h * s_o_h + offs_c[:, None] * s_o_t + offs_v[None, :] * s_o_d,
             round_to(o, o_ptr.dtype.element_ty), mask=valid[:, None] & mask_v[None, :])  # fmt: skip


def split_scratch(max_chunks: int, Hv: int, Dk: int, Dv: int, chunk: int, low: torch.dtype,
                  device: torch.device) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(start states [max_chunks, Hv, Dk, Dv], new values [max_chunks, Hv, C, Dv]) in `low`, the split path's
    scratch beside the prep's."""
    return (torch.empty(max_chunks, Hv, Dk, Dv, dtype=low, device=device),
            torch.empty(max_chunks, Hv, chunk, Dv, dtype=low, device=device))  # fmt: skip


def chunk_split_prefill(state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                        dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, init_flags: Tensor,
                        chunk_size: int, o: Tensor) -> None:  # fmt: skip
    """`chunk_wy_prefill` with the split second stage: the chunk table and prep, then the state and output
    launches, writing o [T, Hv, Dv] and the rows' final states into their slots."""
    Hk, Dk = q.shape[1], q.shape[2]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    prep = wy_prepare(q, k, v, a, b, A_log, dt_bias, query_start_loc, R, chunk_size, kd=True)
    scratch, block_k = prep.scratch, prep.block_k
    max_chunks = prep.lengths.shape[0]
    starts, v_new = split_scratch(max_chunks, Hv, Dk, Dv, chunk_size, scratch["w"].dtype, v.device)

    block_v = max(MIN_DOT, min(next_power_of_2(Dv), WY_STATE_TILE // block_k))
    _wy_state_kernel[(cdiv(Dv, block_v) * Hv * R,)](
        state, query_start_loc, state_slots, init_flags, prep.first,
        scratch["w"], scratch["u"], scratch["kd"], scratch["g"], v_new, starts,
        Hv, Dk, Dv, *state.stride(),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=prep.precision, BF16_DOTS=prep.bf16_dots,
        num_warps=WY_STATE_WARPS, num_stages=1 if prep.fp32 else WY_STATE_STAGES,
    )  # fmt: skip

    block_v = max(MIN_DOT, min(next_power_of_2(Dv), WY_OUT_TILE // block_k))
    _wy_output_kernel[(max_chunks * Hv * cdiv(Dv, block_v),)](
        q, prep.starts, prep.lengths, scratch["p"], scratch["g"], v_new, starts, o,
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *q.stride(), *o.stride(),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=prep.precision,
        BF16_DOTS=prep.bf16_dots, num_warps=WY_OUT_WARPS,
    )  # fmt: skip
