"""Chunk-parallel Triton kernels of the Gated DeltaNet varlen prefill (the chunked WY form of the reference's
`_chunk_row`), launched by `kernel_prefill.py`.

A row's long walk is split so that only one cheap loop stays serial. Chunks of CHUNK tokens are counted from each
row's first token (a row's last chunk is partial; its missing tokens act as padding with k = v = 0, g = 0, beta = 0,
which leave the state as it is) and numbered over the batch, row after row.

1. `_chunk_table_kernel`: per chunk its first token and length, per row the number of its first chunk, built on the
   device from `query_start_loc` (no host read, so a CUDA graph can capture it). The table has room for the bound
   cdiv(T, CHUNK) + R; the chunks past the batch's last have length 0 and their programs exit at once.
2. `_wy_prep_kernel`, one program per (chunk, value head), all independent (a chunk's heads numbered together):
   from the raw inputs (q, k of key head h // (Hv // Hk) l2-normalised, q scaled by Dk^-0.5, g and beta as the
   decode kernel makes them) the within-chunk cumulative log decay G, the UT system
   A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) (i > j), its inverse T = (I + A)^-1, W = T (beta exp(G) k),
   U = T (beta v) and the causal scores P[i, j] = (q_i . k_j) exp(G_i - G_j) (i >= j). The chunk is held as up to
   four sub-blocks of MIN_DOT tokens, each its own register tile: T's diagonal blocks by forward substitution within
   a [MIN_DOT, MIN_DOT] tile, the blocks below them from those (T_ij = -T_ii sum_m A_im T_mj), every other product
   one tl.dot between sub-blocks; no workspace, no barrier.
3. `_wy_scan_kernel`, one program per (row, value head, block of BLOCK_V value columns): the [Dk, BLOCK_V] state in
   fp32 registers from the row's slot (zeros, the slot never read, where has_initial_state[r] is False), then per
   chunk V' = U - W S, O = (q exp(G)) S + P V', S = exp(G_last) S + (k exp(G_last - G))^T V'; the final state is
   stored once, rounded to the pool dtype. No per-chunk state goes to memory: the state kernel and the output
   kernel of the usual chunked pipeline are one.

Precision (`tuning.WY_PRECISION`, `tuning.WY_SCAN_BF16`). fp32 inputs: every product in full fp32, scratch fp32,
within fp32 rounding of the reference. 16-bit inputs: the prep's products on tensor cores in TF32 (the diagonal
blocks' forward substitution in fp32); the scan, the serial part, multiplies bf16 operands (the state, W, V', the
scores, q and k each rounded to bf16; fp32 sums), as flash-linear-attention does.
Scratch (`wy_scratch`) is fp32 except W and the scores, stored in bf16 when the scan rounds them so anyway (half the
bytes, the same products); U stays fp32: it enters V' = U - W S unrounded, before the cancellation that makes V'
small.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.kernel import _gates, _program_tile
from baton.engine.ops.gated_delta.tuning import (
    WY_MAX_CHUNK,
    WY_PRECISION,
    WY_PREP_SLICE,
    WY_PREP_WARPS,
    WY_SCAN_BF16,
    WY_SCAN_STAGES,
    WY_SCAN_TILE,
    WY_SCAN_WARPS,
    WY_TABLE_BLOCK,
)
from baton.engine.ops.triton_common import cdiv, interpreted, next_power_of_2, round_to

# tl.dot's smallest tile side.
MIN_DOT = 16


@triton.jit
def _chunk_table_kernel(qsl_ptr, start_ptr, len_ptr, first_ptr, R, n_max, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """start/len [n_max]: each chunk's first token and length (0 past the batch's chunks); first [R]: each row's
    first chunk. Every program walks the rows (R is small beside the tokens) and fills its block of chunks."""
    pid = tl.program_id(0)
    cid = pid * BLOCK + tl.arange(0, BLOCK)
    start = tl.zeros([BLOCK], dtype=tl.int32)
    length = tl.zeros([BLOCK], dtype=tl.int32)
    before = pid * 0  # chunks of the rows before row r
    lo = tl.load(qsl_ptr).to(tl.int32)
    for r in range(R):
        hi = tl.load(qsl_ptr + r + 1).to(tl.int32)
        n = (hi - lo + CHUNK - 1) // CHUNK
        first_token = lo + (cid - before) * CHUNK
        inrow = (cid >= before) & (cid < before + n)
        start = tl.where(inrow, first_token, start)
        length = tl.where(inrow, tl.minimum(hi - first_token, CHUNK), length)
        tl.store(first_ptr + r, before, mask=pid == 0)
        before += n
        lo = hi
    tl.store(start_ptr + cid, start, mask=cid < n_max)
    tl.store(len_ptr + cid, length, mask=cid < n_max)


@triton.jit
def _unit_rows(ptr, t, valid, offs_k, mask_k, s_t, s_d):
    """fp32 [CHUNK, BLOCK_K] rows at tokens t, each l2-normalised as `kernel._unit` (rows not valid: 0)."""
    x = tl.load(ptr + t[:, None] * s_t + offs_k[None, :] * s_d, mask=valid[:, None] & mask_k[None, :], other=0.0)
    x = x.to(tl.float32)
    return x * tl.math.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


# Whether kernels run in Triton's interpreter, whose tl.dot takes no bf16 operands (decided as `triton.jit` was).
_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, BF16: tl.constexpr):
    """a @ b accumulated in fp32: fp32 operands at PRECISION, or (BF16) both rounded to bf16 first, as tensor cores
    take them at twice TF32's rate (the interpreter multiplies the rounded values in fp32: the same products)."""
    if BF16:
        a = round_to(a.to(tl.float32), tl.bfloat16)
        b = round_to(b.to(tl.float32), tl.bfloat16)
        if _INTERPRETED:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b, input_precision=PRECISION)


@triton.jit
def _sub_gates(a_ptr, b_ptr, t, valid, neg_A, dt_bias, carry, s_a_t, s_b_t):
    """(cumulative log decay from the chunk's start, beta) of one sub-block's tokens `t`; `carry` is the decay up to
    the sub-block's start. Padding tokens get g = 0 and beta = 0 (with k = v = 0): they leave the state as it is."""
    g, beta = _gates(tl.load(a_ptr + t * s_a_t, mask=valid, other=0.0), tl.load(b_ptr + t * s_b_t, mask=valid, other=0.0),
                     neg_A, dt_bias, b_ptr.dtype.element_ty)  # fmt: skip
    return tl.cumsum(tl.where(valid, g, 0.0), axis=0) + carry, tl.where(valid, beta, 0.0)


@triton.jit
def _last(x, SUB: tl.constexpr):
    """The last element of a [SUB] vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, SUB) == SUB - 1, x, 0.0), axis=0)


@triton.jit
def _pick(j: tl.constexpr, x0, x1, x2, x3):
    """x_j of four values, j a constant."""
    if j == 0:  # noqa: SIM116 (a Triton function: no dicts)
        return x0
    elif j == 1:
        return x1
    elif j == 2:
        return x2
    else:
        return x3


@triton.jit
def _decay(cum_i, cum_j, DIAG: tl.constexpr, SUB: tl.constexpr):
    """exp(G_i - G_j) between the tokens of sub-block i and those of sub-block j before it. DIAG (1: j < i,
    2: j <= i): the same sub-block, the other entries 0, masked before the exponent can overflow."""
    if DIAG == 0:
        return tl.exp(cum_i[:, None] - cum_j[None, :])
    else:
        offs = tl.arange(0, SUB)
        keep = offs[:, None] > offs[None, :] if DIAG == 1 else offs[:, None] >= offs[None, :]
        return tl.where(keep, tl.exp(tl.where(keep, cum_i[:, None] - cum_j[None, :], 0.0)), 0.0)


@triton.jit
def _inv_unit_lower(a, SUB: tl.constexpr):
    """(I + a)^-1 of a strictly lower [SUB, SUB] tile by forward substitution in registers: row i is
    e_i - sum over j < i of a[i, j] times row j (rows 0 and 1 need no step)."""
    offs = tl.arange(0, SUB)
    inv = -a
    for i in tl.static_range(2, SUB):
        row = tl.sum(tl.where((offs == i)[:, None], -a, 0.0), axis=0)
        row = row + tl.sum(row[:, None] * inv, axis=0)
        inv = tl.where((offs == i)[:, None], row[None, :], inv)
    return inv + tl.where(offs[:, None] == offs[None, :], 1.0, 0.0)


@triton.jit
def _solve_block(t_ii, x, t_jj, PRECISION: tl.constexpr):
    """-t_ii x t_jj: a block of T below its diagonal, from the diagonal blocks' inverses."""
    return -tl.dot(tl.dot(t_ii, x, input_precision=PRECISION), t_jj, input_precision=PRECISION)


@triton.jit
def _raw_dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b of tiles as loaded: 16-bit operands multiply exactly into fp32 sums (the interpreter takes them as
    fp32: the same products), fp32 ones at PRECISION."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=PRECISION)
    elif _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _rows(ptr, t0, rows, n, offs, mask, s_t, s_d):
    """The [SUB, len(offs)] input tile of chunk rows `rows` (tokens t0 + rows; rows past n: 0), as stored."""
    return tl.load(ptr + (t0 + rows)[:, None] * s_t + offs[None, :] * s_d, mask=(rows < n)[:, None] & mask[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _wy_prep_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, cstart_ptr, clen_ptr, w_ptr, u_ptr, p_ptr, g_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_q_t, s_q_h, s_q_d,
    s_k_t, s_k_h, s_k_d,
    s_v_t, s_v_h, s_v_d,
    s_a_t, s_a_h,
    s_b_t, s_b_h,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BK: tl.constexpr,
    SOLVE_PRECISION: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # The chunk is four sub-blocks of SUB tokens (a smaller chunk pads the last ones: their tokens are padding,
    # stored nowhere), unrolled, each product a tl.dot between [SUB, SUB] blocks and [SUB, BK] slices of the head
    # dims, so that only blocks, per-token vectors and one slice per sub-block are live at a time (the register tiles
    # of whole rows spill) and the UT solve's forward substitution stays within [SUB, SUB] tiles in registers.
    # The value heads of one chunk are neighbours: those of one key head read the same q and k.
    h = tl.program_id(0) % Hv
    ci = tl.program_id(0) // Hv
    n = tl.load(clen_ptr + ci)
    if n == 0:  # past the batch's last chunk
        return
    kh = h // heads_per_key
    t0 = tl.load(cstart_ptr + ci).to(tl.int64)
    r0 = tl.arange(0, SUB)
    r1 = r0 + SUB
    r2 = r0 + 2 * SUB
    r3 = r0 + 3 * SUB
    e = ci.to(tl.int64) * Hv + h  # this (chunk, head)'s place in the scratch tensors
    a_at = a_ptr + h * s_a_h
    b_at = b_ptr + h * s_b_h
    k_at = k_ptr + kh * s_k_h
    q_at = q_ptr + kh * s_q_h
    v_at = v_ptr + h * s_v_h
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)

    cum_0, beta_0 = _sub_gates(a_at, b_at, t0 + r0, r0 < n, neg_A, dt_bias, 0.0, s_a_t, s_b_t)
    cum_1, beta_1 = _sub_gates(a_at, b_at, t0 + r1, r1 < n, neg_A, dt_bias, _last(cum_0, SUB), s_a_t, s_b_t)
    cum_2, beta_2 = _sub_gates(a_at, b_at, t0 + r2, r2 < n, neg_A, dt_bias, _last(cum_1, SUB), s_a_t, s_b_t)
    cum_3, beta_3 = _sub_gates(a_at, b_at, t0 + r3, r3 < n, neg_A, dt_bias, _last(cum_2, SUB), s_a_t, s_b_t)
    for i in tl.static_range(4):
        if i * SUB < CHUNK:
            tl.store(g_ptr + e * CHUNK + i * SUB + r0, _pick(i, cum_0, cum_1, cum_2, cum_3))

    # One pass over Dk: the rows' squared norms (q and k are l2-normalised by scaling the products after) and the
    # raw products k_i . k_j (the UT system's) and q_i . k_j (the scores'), j <= i, by [SUB, SUB] blocks.
    f0 = tl.zeros([SUB, SUB], dtype=tl.float32)
    kk10, kk20, kk21, kk30, kk31, kk32 = f0, f0, f0, f0, f0, f0
    kk00, kk11, kk22, kk33 = f0, f0, f0, f0
    qk00, qk10, qk11, qk20, qk21, qk22, qk30, qk31, qk32, qk33 = f0, f0, f0, f0, f0, f0, f0, f0, f0, f0
    v0 = tl.zeros([SUB], dtype=tl.float32)
    nk0, nk1, nk2, nk3, nq0, nq1, nq2, nq3 = v0, v0, v0, v0, v0, v0, v0, v0
    for kb in tl.static_range(0, BLOCK_K, BK):
        offs = kb + tl.arange(0, BK)
        m = offs < Dk
        k0 = _rows(k_at, t0, r0, n, offs, m, s_k_t, s_k_d)
        k1 = _rows(k_at, t0, r1, n, offs, m, s_k_t, s_k_d)
        k2 = _rows(k_at, t0, r2, n, offs, m, s_k_t, s_k_d)
        k3 = _rows(k_at, t0, r3, n, offs, m, s_k_t, s_k_d)
        nk0 += tl.sum(k0.to(tl.float32) * k0.to(tl.float32), axis=1)
        nk1 += tl.sum(k1.to(tl.float32) * k1.to(tl.float32), axis=1)
        nk2 += tl.sum(k2.to(tl.float32) * k2.to(tl.float32), axis=1)
        nk3 += tl.sum(k3.to(tl.float32) * k3.to(tl.float32), axis=1)
        k0t, k1t, k2t, k3t = tl.trans(k0), tl.trans(k1), tl.trans(k2), tl.trans(k3)
        kk00 = _raw_dot(k0, k0t, kk00, SOLVE_PRECISION)
        kk10 = _raw_dot(k1, k0t, kk10, SOLVE_PRECISION)
        kk11 = _raw_dot(k1, k1t, kk11, SOLVE_PRECISION)
        kk20 = _raw_dot(k2, k0t, kk20, SOLVE_PRECISION)
        kk21 = _raw_dot(k2, k1t, kk21, SOLVE_PRECISION)
        kk22 = _raw_dot(k2, k2t, kk22, SOLVE_PRECISION)
        kk30 = _raw_dot(k3, k0t, kk30, SOLVE_PRECISION)
        kk31 = _raw_dot(k3, k1t, kk31, SOLVE_PRECISION)
        kk32 = _raw_dot(k3, k2t, kk32, SOLVE_PRECISION)
        kk33 = _raw_dot(k3, k3t, kk33, SOLVE_PRECISION)
        q = _rows(q_at, t0, r0, n, offs, m, s_q_t, s_q_d)
        nq0 += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        qk00 = _raw_dot(q, k0t, qk00, PRECISION)
        q = _rows(q_at, t0, r1, n, offs, m, s_q_t, s_q_d)
        nq1 += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        qk10 = _raw_dot(q, k0t, qk10, PRECISION)
        qk11 = _raw_dot(q, k1t, qk11, PRECISION)
        q = _rows(q_at, t0, r2, n, offs, m, s_q_t, s_q_d)
        nq2 += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        qk20 = _raw_dot(q, k0t, qk20, PRECISION)
        qk21 = _raw_dot(q, k1t, qk21, PRECISION)
        qk22 = _raw_dot(q, k2t, qk22, PRECISION)
        q = _rows(q_at, t0, r3, n, offs, m, s_q_t, s_q_d)
        nq3 += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        qk30 = _raw_dot(q, k0t, qk30, PRECISION)
        qk31 = _raw_dot(q, k1t, qk31, PRECISION)
        qk32 = _raw_dot(q, k2t, qk32, PRECISION)
        qk33 = _raw_dot(q, k3t, qk33, PRECISION)
    # 1 / |k| and scale / |q| per token, as `kernel._unit` normalises.
    rk0, rk1 = tl.math.rsqrt(nk0 + 1e-6), tl.math.rsqrt(nk1 + 1e-6)
    rk2, rk3 = tl.math.rsqrt(nk2 + 1e-6), tl.math.rsqrt(nk3 + 1e-6)

    # The causal scores P[r, c] = (q_r . k_c) exp(G_r - G_c), r >= c; zeros above the diagonal (the scan reads the
    # whole [CHUNK, CHUNK] tile).
    p_at = p_ptr + e * CHUNK * CHUNK
    for i in tl.static_range(4):
        if i * SUB < CHUNK:
            rq = tl.math.rsqrt(_pick(i, nq0, nq1, nq2, nq3) + 1e-6) * scale
            cum_i = _pick(i, cum_0, cum_1, cum_2, cum_3)
            for j in tl.static_range(4):
                if j * SUB < CHUNK:
                    if j > i:
                        p_ij = f0
                    else:
                        qk = _pick(j, _pick(i, qk00, qk10, qk20, qk30), _pick(i, qk00, qk11, qk21, qk31),
                                   _pick(i, qk00, qk11, qk22, qk32), qk33)  # fmt: skip
                        p_ij = qk * rq[:, None] * _pick(j, rk0, rk1, rk2, rk3)[None, :] \
                            * _decay(cum_i, _pick(j, cum_0, cum_1, cum_2, cum_3), 2 if j == i else 0, SUB)  # fmt: skip
                    tl.store(p_at + (i * SUB + r0)[:, None] * CHUNK + j * SUB + r0[None, :],
                             round_to(p_ij, p_ptr.dtype.element_ty))  # fmt: skip

    # The UT system A[r, c] = beta_r (k_r . k_c) exp(G_r - G_c), r > c, by blocks (the diagonal ones strictly
    # lower), and T = (I + A)^-1: its diagonal blocks by forward substitution, then those below them from those
    # (T_ij = -T_ii (sum over j <= m < i of A_im T_mj)).
    a00 = kk00 * (beta_0 * rk0)[:, None] * rk0[None, :] * _decay(cum_0, cum_0, 1, SUB)
    a10 = kk10 * (beta_1 * rk1)[:, None] * rk0[None, :] * _decay(cum_1, cum_0, 0, SUB)
    a11 = kk11 * (beta_1 * rk1)[:, None] * rk1[None, :] * _decay(cum_1, cum_1, 1, SUB)
    a20 = kk20 * (beta_2 * rk2)[:, None] * rk0[None, :] * _decay(cum_2, cum_0, 0, SUB)
    a21 = kk21 * (beta_2 * rk2)[:, None] * rk1[None, :] * _decay(cum_2, cum_1, 0, SUB)
    a22 = kk22 * (beta_2 * rk2)[:, None] * rk2[None, :] * _decay(cum_2, cum_2, 1, SUB)
    a30 = kk30 * (beta_3 * rk3)[:, None] * rk0[None, :] * _decay(cum_3, cum_0, 0, SUB)
    a31 = kk31 * (beta_3 * rk3)[:, None] * rk1[None, :] * _decay(cum_3, cum_1, 0, SUB)
    a32 = kk32 * (beta_3 * rk3)[:, None] * rk2[None, :] * _decay(cum_3, cum_2, 0, SUB)
    a33 = kk33 * (beta_3 * rk3)[:, None] * rk3[None, :] * _decay(cum_3, cum_3, 1, SUB)
    t00 = _inv_unit_lower(a00, SUB)
    t11 = _inv_unit_lower(a11, SUB)
    t22 = _inv_unit_lower(a22, SUB)
    t33 = _inv_unit_lower(a33, SUB)
    t10 = _solve_block(t11, a10, t00, SOLVE_PRECISION)
    t21 = _solve_block(t22, a21, t11, SOLVE_PRECISION)
    t32 = _solve_block(t33, a32, t22, SOLVE_PRECISION)
    t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=SOLVE_PRECISION)
                  + tl.dot(a21, t10, input_precision=SOLVE_PRECISION), input_precision=SOLVE_PRECISION)
    t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=SOLVE_PRECISION)
                  + tl.dot(a32, t21, input_precision=SOLVE_PRECISION), input_precision=SOLVE_PRECISION)
    t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=SOLVE_PRECISION)
                  + tl.dot(a31, t10, input_precision=SOLVE_PRECISION)
                  + tl.dot(a32, t20, input_precision=SOLVE_PRECISION), input_precision=SOLVE_PRECISION)

    # The chunk's delta-rule writes at once, W = T (beta exp(G) k) and U = T (beta v): what each token writes given
    # the ones before it in the chunk. The per-token factors go into T's columns, so the inputs enter the products
    # as stored (exact in TF32 when 16-bit).
    sw0, sw1 = beta_0 * rk0 * tl.exp(cum_0), beta_1 * rk1 * tl.exp(cum_1)
    sw2, sw3 = beta_2 * rk2 * tl.exp(cum_2), beta_3 * rk3 * tl.exp(cum_3)
    for kb in tl.static_range(0, BLOCK_K, BK):
        offs = kb + tl.arange(0, BK)
        m = offs < Dk
        x0 = _rows(k_at, t0, r0, n, offs, m, s_k_t, s_k_d).to(tl.float32)
        x1 = _rows(k_at, t0, r1, n, offs, m, s_k_t, s_k_d).to(tl.float32)
        x2 = _rows(k_at, t0, r2, n, offs, m, s_k_t, s_k_d).to(tl.float32)
        x3 = _rows(k_at, t0, r3, n, offs, m, s_k_t, s_k_d).to(tl.float32)
        _store_wu(w_ptr + e * CHUNK * Dk, offs, m, Dk, r0, x0, x1, x2, x3, sw0, sw1, sw2, sw3,
                  t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, CHUNK, SUB, PRECISION)  # fmt: skip
    for vb in tl.static_range(0, BLOCK_DV, BK):
        offs = vb + tl.arange(0, BK)
        m = offs < Dv
        y0 = _rows(v_at, t0, r0, n, offs, m, s_v_t, s_v_d).to(tl.float32)
        y1 = _rows(v_at, t0, r1, n, offs, m, s_v_t, s_v_d).to(tl.float32)
        y2 = _rows(v_at, t0, r2, n, offs, m, s_v_t, s_v_d).to(tl.float32)
        y3 = _rows(v_at, t0, r3, n, offs, m, s_v_t, s_v_d).to(tl.float32)
        _store_wu(u_ptr + e * CHUNK * Dv, offs, m, Dv, r0, y0, y1, y2, y3, beta_0, beta_1, beta_2, beta_3,
                  t00, t10, t11, t20, t21, t22, t30, t31, t32, t33, CHUNK, SUB, PRECISION)  # fmt: skip


@triton.jit
def _store_wu(out_ptr, offs, m, ncols, r0, x0, x1, x2, x3, s0, s1, s2, s3, t00, t10, t11, t20, t21, t22, t30, t31,
              t32, t33, CHUNK: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Columns `offs` of T (s x) for the four sub-blocks' slices x_j and per-token factors s_j, stored as rows of
    the chunk's row-major [CHUNK, ncols] region in its dtype."""
    c0, c1, c2, c3 = t00 * s0[None, :], t10 * s0[None, :], t20 * s0[None, :], t30 * s0[None, :]
    out = tl.dot(c0, x0, input_precision=PRECISION)
    tl.store(out_ptr + r0[:, None] * ncols + offs[None, :], round_to(out, out_ptr.dtype.element_ty), mask=m[None, :])
    if SUB < CHUNK:
        out = tl.dot(c1, x0, input_precision=PRECISION) + tl.dot(t11 * s1[None, :], x1, input_precision=PRECISION)
        tl.store(out_ptr + (r0 + SUB)[:, None] * ncols + offs[None, :], round_to(out, out_ptr.dtype.element_ty),
                 mask=m[None, :])  # fmt: skip
    if 2 * SUB < CHUNK:
        out = tl.dot(c2, x0, input_precision=PRECISION) + tl.dot(t21 * s1[None, :], x1, input_precision=PRECISION) \
            + tl.dot(t22 * s2[None, :], x2, input_precision=PRECISION)  # fmt: skip
        tl.store(out_ptr + (r0 + 2 * SUB)[:, None] * ncols + offs[None, :], round_to(out, out_ptr.dtype.element_ty),
                 mask=m[None, :])  # fmt: skip
        out = tl.dot(c3, x0, input_precision=PRECISION) + tl.dot(t31 * s1[None, :], x1, input_precision=PRECISION) \
            + tl.dot(t32 * s2[None, :], x2, input_precision=PRECISION) \
            + tl.dot(t33 * s3[None, :], x3, input_precision=PRECISION)  # fmt: skip
        tl.store(out_ptr + (r0 + 3 * SUB)[:, None] * ncols + offs[None, :], round_to(out, out_ptr.dtype.element_ty),
                 mask=m[None, :])  # fmt: skip


@triton.jit
def _wy_scan_kernel(
    state_ptr, q_ptr, k_ptr, qsl_ptr, slot_ptr, init_ptr, first_ptr, w_ptr, u_ptr, p_ptr, g_ptr, o_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_q_t, s_q_h, s_q_d,
    s_k_t, s_k_h, s_k_d,
    s_o_t, s_o_h, s_o_d,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
    BF16_DOTS: tl.constexpr,
):  # fmt: skip
    pid_v, h, r = _program_tile(Hv, Dv, BLOCK_V)
    kh = h // heads_per_key
    offs_c = tl.arange(0, CHUNK)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < Dk
    mask_v = offs_v < Dv

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
    for j in range(0, tl.cdiv(hi - lo, CHUNK)):
        e = (first + j) * Hv + h
        t0 = lo + j * CHUNK
        valid = offs_c < hi - t0
        cum = tl.load(g_ptr + e * CHUNK + offs_c)
        cum_last = tl.load(g_ptr + e * CHUNK + CHUNK - 1)
        w = tl.load(w_ptr + e * CHUNK * Dk + rows_k, mask=mask_k[None, :], other=0.0)
        u = tl.load(u_ptr + e * CHUNK * Dv + rows_v, mask=mask_v[None, :], other=0.0)
        # The part of each write that the chunk's start state already predicts is not written again.
        v_new = u - _mm(w, s, PRECISION, BF16_DOTS)  # [CHUNK, BLOCK_V]

        q = _unit_rows(q_ptr + t0 * s_q_t + kh * s_q_h, offs_c, valid, offs_k, mask_k, s_q_t, s_q_d)
        o = _mm(q * (scale * tl.exp(cum))[:, None], s, PRECISION, BF16_DOTS)
        o += _mm(tl.load(p_ptr + e * CHUNK * CHUNK + offs_c[:, None] * CHUNK + offs_c[None, :]), v_new, PRECISION,
                 BF16_DOTS)  # fmt: skip
        tl.store(o_ptr + t0 * s_o_t + h * s_o_h + offs_c[:, None] * s_o_t + offs_v[None, :] * s_o_d,
                 round_to(o, o_ptr.dtype.element_ty), mask=valid[:, None] & mask_v[None, :])  # fmt: skip

        k = _unit_rows(k_ptr + t0 * s_k_t + kh * s_k_h, offs_c, valid, offs_k, mask_k, s_k_t, s_k_d)
        s = s * tl.exp(cum_last) + _mm(tl.trans(k * tl.exp(cum_last - cum)[:, None]), v_new, PRECISION, BF16_DOTS)
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
    tl.store(state_at + tile, round_to(s, state_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_v[None, :])


def chunk_parallel(chunk_size: int) -> bool:
    """Whether a prefill of `chunk_size` can run these kernels: their tiles need a power of two of at least
    MIN_DOT tokens, and the prep's sub-blocks at most four of those (`WY_MAX_CHUNK`)."""
    return MIN_DOT <= chunk_size <= WY_MAX_CHUNK and chunk_size & (chunk_size - 1) == 0


def wy_scratch(max_chunks: int, Hv: int, Dk: int, Dv: int, chunk: int, low: torch.dtype,
               device: torch.device) -> dict[str, Tensor]:  # fmt: skip
    """The per-(chunk, value head) tensors the prep kernel writes for the scan: in the dtype `low` (fp32 or bf16) W
    [., C, Dk] and the scores p [., C, C]; in fp32 U [., C, Dv] and the cumulative log decay g [., C]."""
    n = (max_chunks, Hv)
    f32 = dict(dtype=torch.float32, device=device)
    return dict(w=torch.empty(*n, chunk, Dk, dtype=low, device=device), u=torch.empty(*n, chunk, Dv, **f32),
                p=torch.empty(*n, chunk, chunk, dtype=low, device=device), g=torch.empty(*n, chunk, **f32))


def chunk_wy_prefill(state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                     dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, init_flags: Tensor,
                     chunk_size: int, o: Tensor) -> None:  # fmt: skip
    """The three launches of a chunk-parallel prefill of R >= 1 rows (shapes checked by the caller; init_flags is
    has_initial_state as bytes), writing o [T, Hv, Dv] and the rows' final states into their slots."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    dev = v.device
    max_chunks = cdiv(T, chunk_size) + R
    starts = torch.empty(max_chunks, dtype=torch.int32, device=dev)
    lengths = torch.empty(max_chunks, dtype=torch.int32, device=dev)
    first = torch.empty(R, dtype=torch.int32, device=dev)
    _chunk_table_kernel[(cdiv(max_chunks, WY_TABLE_BLOCK),)](
        query_start_loc, starts, lengths, first, R, max_chunks, CHUNK=chunk_size, BLOCK=WY_TABLE_BLOCK, num_warps=4,
    )  # fmt: skip

    fp32 = q.dtype == k.dtype == v.dtype == torch.float32
    solve_precision, precision = WY_PRECISION[fp32]
    bf16_dots = WY_SCAN_BF16 and not fp32
    # The scan rounds W and the scores to bf16 for its products anyway: stored so, they move half the bytes for the
    # same result.
    scratch = wy_scratch(max_chunks, Hv, Dk, Dv, chunk_size, torch.bfloat16 if bf16_dots else torch.float32, dev)
    block_k = max(MIN_DOT, next_power_of_2(Dk))
    _wy_prep_kernel[(max_chunks * Hv,)](
        q, k, v, a, b, A_log, dt_bias, starts, lengths, scratch["w"], scratch["u"], scratch["p"], scratch["g"],
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *q.stride(), *k.stride(), *v.stride(), *a.stride(), *b.stride(),
        CHUNK=chunk_size, SUB=max(MIN_DOT, chunk_size // 4), BLOCK_K=block_k, BK=min(block_k, WY_PREP_SLICE),
        BLOCK_DV=max(MIN_DOT, next_power_of_2(Dv)),
        SOLVE_PRECISION=solve_precision, PRECISION=precision, num_warps=WY_PREP_WARPS,
    )  # fmt: skip

    block_v = max(MIN_DOT, min(next_power_of_2(Dv), WY_SCAN_TILE // block_k))
    _wy_scan_kernel[(cdiv(Dv, block_v) * Hv * R,)](
        state, q, k, query_start_loc, state_slots, init_flags, first,
        scratch["w"], scratch["u"], scratch["p"], scratch["g"], o,
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *state.stride(), *q.stride(), *k.stride(), *o.stride(),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=precision,
        BF16_DOTS=bf16_dots,
        num_warps=WY_SCAN_WARPS, num_stages=1 if fp32 else WY_SCAN_STAGES,
    )  # fmt: skip
