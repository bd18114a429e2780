"""Triton kernels of the Gated DeltaNet varlen prefill with initial and final states in pool slots, beside their torch
reference `gated_delta_prefill_varlen` (`reference.py`): same signature, semantics and return value.

Algorithms, picked by `chunked(chunk_size)`:
- chunk-parallel (power-of-two chunk_size from 16 to `tuning.WY_MAX_CHUNK`): the reference's WY/UT form in
  `kernel_chunk_wy.py`, chunks of `chunk_size` tokens counted from each row's first token. Every (chunk, value
  head) is prepared at once (the UT solve, W, U and the causal scores), then one scan per (row, value head, value
  block) carries the state over the row's chunks and writes the outputs on the way; only that scan's cheap
  per-chunk update is serial. `tuning.WY_SPLIT_SCAN` picks the split second stage instead
  (`kernel_chunk_state.py`): a scan that only carries the state, storing each chunk's start state, then the
  outputs of every chunk at once.
- token by token (any other chunk_size): one program per (row, value head h, block of BLOCK_V value columns), the
  value block fastest, then the head. It reads its row's bounds from `query_start_loc` and its [Dk, BLOCK_V] start
  state from the row's slot, walks the row with the decode kernel's step per token (o = S^T q from the fp32 state)
  and stores the final state once, rounded to the pool dtype.
Both read a row's start state from its slot (zeros, the slot never read, where has_initial_state[r] is False),
compute q, k (key head h // (Hv // Hk), l2-normalised) and the gates in-kernel from the raw inputs, as the decode
kernel does, and agree with the reference to fp32 rounding (16-bit inputs: to TF32 products), not bit for bit.

No host reads of device tensors: only shapes are checked here; query_start_loc (non-decreasing from 0 to T),
distinct slots in [0, S) and chunk_size > 0 are the caller's contract, unchecked (the reference checks them).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.checks import check_prefill_shapes
from baton.engine.ops.gated_delta.kernel import _delta_step, _gates, _program_tile, _unit, launch_config
from baton.engine.ops.gated_delta.kernel_chunk_state import chunk_split_prefill
from baton.engine.ops.gated_delta.kernel_chunk_wy import chunk_parallel, chunk_wy_prefill
from baton.engine.ops.gated_delta.tuning import PREFILL_TILE, STEP_WARPS, WY_SPLIT_SCAN
from baton.engine.ops.triton_common import cdiv, round_to


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


def chunked(chunk_size: int) -> bool:
    """Whether a prefill of `chunk_size` runs the chunk-parallel kernels (a power of two from 16 to WY_MAX_CHUNK
    tokens); any other chunk size runs the token-by-token kernel (same results to fp32 rounding)."""
    return chunk_parallel(chunk_size)


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
    if chunked(chunk_size):
        run = chunk_split_prefill if WY_SPLIT_SCAN else chunk_wy_prefill
        run(state, q, k, v, a, b, A_log, dt_bias, query_start_loc, state_slots, init_flags, chunk_size, o)
        return o
    block_k, block_v = launch_config(Dk, Dv, PREFILL_TILE)
    _gdn_prefill_kernel[(cdiv(Dv, block_v) * Hv * R,)](
        state, q, k, v, a, b, A_log, dt_bias, query_start_loc, state_slots, init_flags, o,
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *state.stride(), *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(), *o.stride(),
        BLOCK_K=block_k, BLOCK_V=block_v, num_warps=STEP_WARPS,
    )  # fmt: skip
    return o
