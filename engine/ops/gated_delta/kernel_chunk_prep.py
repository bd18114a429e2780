"""The chunk-parallel Gated DeltaNet prefill's prep, two launches over every (chunk, value head) at once (see
`kernel_chunk_wy.py` for the whole pipeline and its notation).

1. `_wy_solve_kernel`: the chunk's gates (G, the within-chunk cumulative log decay, and beta, from the raw a and b),
   the raw key products k_i . k_j by [SUB, SUB] blocks over Dk slices (16-bit keys multiply exactly into fp32 sums;
   the keys' squared norms are the diagonal's), the UT system A[i, j] = beta_i (k^_i . k^_j) exp(G_i - G_j), i > j,
   on the l2-normalised keys k^ (the norms scale the products, so no normalised key tile is ever made), and
   T = (I + A)^-1: the diagonal blocks' inverses within register tiles (`tuning.WY_SOLVE_DOUBLING`: a product of
   powers, or forward substitution), the blocks below them from those. T goes to memory in the scratch dtype, with
   the per-token factors the second launch needs in fp32.
2. `_wy_wu_kernel`: W = T diag(beta exp(G) / |k|) k, U = T diag(beta) v, the causal scores
   P[i, j] = (q^_i . k^_j) exp(G_i - G_j) (i >= j) and, for the split scan, the decayed keys. With bf16 scratch, W
   and U multiply bf16 operands: T with its columns scaled, and the keys and values as stored. The scores are made
   here rather than in the scan, which holds q and k anyway: beside its state they would spill its registers, on
   the serial path.

Splitting keeps each launch's live tiles small: the one-launch prep held the whole chunk's keys, system, inverse and
products at once and spilled registers. A chunk is held as four sub-blocks of SUB tokens; a smaller chunk leaves the
last ones empty (their tokens are padding: k = v = 0, g = 0, beta = 0) and stores nothing of them.
"""

import triton
import triton.language as tl

from baton.engine.ops.gated_delta.kernel import _gates
from baton.engine.ops.triton_common import interpreted, round_to

# Whether kernels run in Triton's interpreter, whose tl.dot takes no 16-bit operands.
_INTERPRETED = tl.constexpr(interpreted())


@triton.jit
def _sub_gates(a_ptr, b_ptr, t, valid, neg_A, dt_bias, carry, s_a_t, s_b_t):
    """(G from the chunk's start, beta) of one sub-block's tokens `t`; `carry` is G up to the sub-block's start.
    Padding tokens get g = 0 and beta = 0: they leave the state as it is."""
    g, beta = _gates(tl.load(a_ptr + t * s_a_t, mask=valid, other=0.0),
                     tl.load(b_ptr + t * s_b_t, mask=valid, other=0.0), neg_A, dt_bias, b_ptr.dtype.element_ty)
    return tl.cumsum(tl.where(valid, g, 0.0), axis=0) + carry, tl.where(valid, beta, 0.0)


@triton.jit
def _last(x, SUB: tl.constexpr):
    """The last element of a [SUB] vector, as a scalar."""
    return tl.sum(tl.where(tl.arange(0, SUB) == SUB - 1, x, 0.0), axis=0)


@triton.jit
def _diag(x, SUB: tl.constexpr):
    """The diagonal of a [SUB, SUB] tile."""
    offs = tl.arange(0, SUB)
    return tl.sum(tl.where(offs[:, None] == offs[None, :], x, 0.0), axis=1)


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
    """The [SUB, len(offs)] tile of chunk rows `rows` (tokens t0 + rows; rows past n: 0), as stored."""
    return tl.load(ptr + (t0 + rows)[:, None] * s_t + offs[None, :] * s_d, mask=(rows < n)[:, None] & mask[None, :],
                   other=0.0)  # fmt: skip


@triton.jit
def _system(kk, rk_i, rk_j, beta_i, cum_i, cum_j, DIAG: tl.constexpr, SUB: tl.constexpr):
    """A block of the UT system from raw key products: beta_i (k_i . k_j) / (|k_i| |k_j|) exp(G_i - G_j); DIAG: a
    diagonal block, kept strictly lower (and its exponent masked before it can overflow)."""
    scale = (beta_i * rk_i)[:, None] * rk_j[None, :]
    if DIAG:
        offs = tl.arange(0, SUB)
        keep = offs[:, None] > offs[None, :]
        return tl.where(keep, kk * scale * tl.exp(tl.where(keep, cum_i[:, None] - cum_j[None, :], 0.0)), 0.0)
    else:
        return kk * scale * tl.exp(cum_i[:, None] - cum_j[None, :])


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
def _inv_unit_lower_doubling(a, SUB: tl.constexpr):
    """(I + a)^-1 of a strictly lower [16, 16] tile as the product (I - a)(I + a^2)(I + a^4)(I + a^8) (a^16 = 0: the
    product is the whole series sum of (-a)^n), by full-fp32 products: six tile products instead of 14 dependent
    steps of two cross-thread reductions each."""
    tl.static_assert(SUB == 16)
    offs = tl.arange(0, SUB)
    inv = tl.where(offs[:, None] == offs[None, :], 1.0, 0.0) - a
    p = a
    for _ in tl.static_range(3):
        p = tl.dot(p, p, input_precision="ieee")
        inv += tl.dot(inv, p, input_precision="ieee")
    return inv


@triton.jit
def _inv_diag(a, SUB: tl.constexpr, DOUBLING: tl.constexpr):
    """A diagonal block's inverse (I + a)^-1 (`tuning.WY_SOLVE_DOUBLING` picks the method)."""
    if DOUBLING:
        return _inv_unit_lower_doubling(a, SUB)
    else:
        return _inv_unit_lower(a, SUB)


@triton.jit
def _pick(i: tl.constexpr, x0, x1, x2, x3):
    """x_i of four values, i a constant."""
    if i == 0:  # noqa: SIM116 (a Triton function: no dicts)
        return x0
    elif i == 1:
        return x1
    elif i == 2:
        return x2
    else:
        return x3


@triton.jit
def _mm(a, b, P: tl.constexpr):
    return tl.dot(a, b, input_precision=P)


@triton.jit
def _store_block(t_at, x, i: tl.constexpr, j: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    offs = tl.arange(0, SUB)
    if i * SUB < CHUNK:
        at = (i * SUB + offs)[:, None] * CHUNK + j * SUB + offs[None, :]
        tl.store(t_at + at, round_to(x, t_at.dtype.element_ty))


@triton.jit
def _scaled_cols(t, f):
    """T's tile `t` (the scratch dtype) with its columns scaled by the per-token factors `f`, in the scratch dtype:
    the left operand of `_low_dot`."""
    return round_to(t.to(tl.float32) * f[None, :], t.dtype)


@triton.jit
def _low_dot(ts, x, PRECISION: tl.constexpr):
    """ts @ x accumulated in fp32, for `_scaled_cols`' tile and inputs `x` as stored: fp32 scratch at PRECISION;
    bf16 scratch on bf16 operands (inputs of another 16-bit dtype rounded; the interpreter multiplies the same values
    in fp32)."""
    if ts.dtype == tl.float32:
        return tl.dot(ts, x.to(tl.float32), input_precision=PRECISION)
    else:
        if x.dtype != tl.bfloat16:
            x = round_to(x.to(tl.float32), tl.bfloat16)
        if _INTERPRETED:
            return tl.dot(ts.to(tl.float32), x.to(tl.float32))
        else:
            return tl.dot(ts, x)


@triton.jit
def _wy_solve_kernel(
    k_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, cstart_ptr, clen_ptr, t_ptr, g_ptr, f_ptr,
    Hv, Dk, heads_per_key,
    s_k_t, s_k_h, s_k_d,
    s_a_t, s_a_h,
    s_b_t, s_b_h,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    DOUBLING: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): g [CHUNK] (G), t [CHUNK, CHUNK] (T, the blocks on and below the diagonal; the ones
    above are never written) and f [3, CHUNK]: beta exp(G) / |k|, beta, 1 / |k| per token."""
    # The value heads of one chunk are neighbours: those of one key head read the same keys.
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
    e = ci.to(tl.int64) * Hv + h
    a_at = a_ptr + h * s_a_h
    b_at = b_ptr + h * s_b_h
    k_at = k_ptr + kh * s_k_h
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    cum0, beta0 = _sub_gates(a_at, b_at, t0 + r0, r0 < n, neg_A, dt_bias, 0.0, s_a_t, s_b_t)
    cum1, beta1 = _sub_gates(a_at, b_at, t0 + r1, r1 < n, neg_A, dt_bias, _last(cum0, SUB), s_a_t, s_b_t)
    cum2, beta2 = _sub_gates(a_at, b_at, t0 + r2, r2 < n, neg_A, dt_bias, _last(cum1, SUB), s_a_t, s_b_t)
    cum3, beta3 = _sub_gates(a_at, b_at, t0 + r3, r3 < n, neg_A, dt_bias, _last(cum2, SUB), s_a_t, s_b_t)

    # The raw key products of the blocks on and below the diagonal, one Dk slice at a time.
    z = tl.zeros([SUB, SUB], dtype=tl.float32)
    kk00, kk10, kk11, kk20, kk21, kk22, kk30, kk31, kk32, kk33 = z, z, z, z, z, z, z, z, z, z
    for kb in range(0, BLOCK_K, BK):
        offs = kb + tl.arange(0, BK)
        m = offs < Dk
        k0 = _rows(k_at, t0, r0, n, offs, m, s_k_t, s_k_d)
        k1 = _rows(k_at, t0, r1, n, offs, m, s_k_t, s_k_d)
        k2 = _rows(k_at, t0, r2, n, offs, m, s_k_t, s_k_d)
        k3 = _rows(k_at, t0, r3, n, offs, m, s_k_t, s_k_d)
        kk00 = _raw_dot(k0, tl.trans(k0), kk00, PRECISION)
        kk10 = _raw_dot(k1, tl.trans(k0), kk10, PRECISION)
        kk11 = _raw_dot(k1, tl.trans(k1), kk11, PRECISION)
        kk20 = _raw_dot(k2, tl.trans(k0), kk20, PRECISION)
        kk21 = _raw_dot(k2, tl.trans(k1), kk21, PRECISION)
        kk22 = _raw_dot(k2, tl.trans(k2), kk22, PRECISION)
        kk30 = _raw_dot(k3, tl.trans(k0), kk30, PRECISION)
        kk31 = _raw_dot(k3, tl.trans(k1), kk31, PRECISION)
        kk32 = _raw_dot(k3, tl.trans(k2), kk32, PRECISION)
        kk33 = _raw_dot(k3, tl.trans(k3), kk33, PRECISION)
    # 1 / |k| per token, as `kernel._unit` normalises (padding keys: 0 products, any finite factor).
    rk0 = tl.math.rsqrt(_diag(kk00, SUB) + 1e-6)
    rk1 = tl.math.rsqrt(_diag(kk11, SUB) + 1e-6)
    rk2 = tl.math.rsqrt(_diag(kk22, SUB) + 1e-6)
    rk3 = tl.math.rsqrt(_diag(kk33, SUB) + 1e-6)

    a10 = _system(kk10, rk1, rk0, beta1, cum1, cum0, False, SUB)
    a20 = _system(kk20, rk2, rk0, beta2, cum2, cum0, False, SUB)
    a21 = _system(kk21, rk2, rk1, beta2, cum2, cum1, False, SUB)
    a30 = _system(kk30, rk3, rk0, beta3, cum3, cum0, False, SUB)
    a31 = _system(kk31, rk3, rk1, beta3, cum3, cum1, False, SUB)
    a32 = _system(kk32, rk3, rk2, beta3, cum3, cum2, False, SUB)
    t00 = _inv_diag(_system(kk00, rk0, rk0, beta0, cum0, cum0, True, SUB), SUB, DOUBLING)
    t11 = _inv_diag(_system(kk11, rk1, rk1, beta1, cum1, cum1, True, SUB), SUB, DOUBLING)
    t22 = _inv_diag(_system(kk22, rk2, rk2, beta2, cum2, cum2, True, SUB), SUB, DOUBLING)
    t33 = _inv_diag(_system(kk33, rk3, rk3, beta3, cum3, cum3, True, SUB), SUB, DOUBLING)
    # Below the diagonal: T_ij = -T_ii (sum over j <= m < i of A_im T_mj).
    t10 = -_mm(t11, _mm(a10, t00, PRECISION), PRECISION)
    t21 = -_mm(t22, _mm(a21, t11, PRECISION), PRECISION)
    t32 = -_mm(t33, _mm(a32, t22, PRECISION), PRECISION)
    t20 = -_mm(t22, _mm(a20, t00, PRECISION) + _mm(a21, t10, PRECISION), PRECISION)
    t31 = -_mm(t33, _mm(a31, t11, PRECISION) + _mm(a32, t21, PRECISION), PRECISION)
    t30 = -_mm(t33, _mm(a30, t00, PRECISION) + _mm(a31, t10, PRECISION) + _mm(a32, t20, PRECISION), PRECISION)

    t_at = t_ptr + e * CHUNK * CHUNK
    _store_block(t_at, t00, 0, 0, CHUNK, SUB)
    _store_block(t_at, t10, 1, 0, CHUNK, SUB)
    _store_block(t_at, t11, 1, 1, CHUNK, SUB)
    _store_block(t_at, t20, 2, 0, CHUNK, SUB)
    _store_block(t_at, t21, 2, 1, CHUNK, SUB)
    _store_block(t_at, t22, 2, 2, CHUNK, SUB)
    _store_block(t_at, t30, 3, 0, CHUNK, SUB)
    _store_block(t_at, t31, 3, 1, CHUNK, SUB)
    _store_block(t_at, t32, 3, 2, CHUNK, SUB)
    _store_block(t_at, t33, 3, 3, CHUNK, SUB)
    g_at = g_ptr + e * CHUNK
    f_at = f_ptr + e * 3 * CHUNK
    for i in tl.static_range(4):
        if i * SUB < CHUNK:
            rows = i * SUB + r0
            cum = _pick(i, cum0, cum1, cum2, cum3)
            beta = _pick(i, beta0, beta1, beta2, beta3)
            rk = _pick(i, rk0, rk1, rk2, rk3)
            tl.store(g_at + rows, cum)
            tl.store(f_at + rows, beta * tl.exp(cum) * rk)
            tl.store(f_at + CHUNK + rows, beta)
            tl.store(f_at + 2 * CHUNK + rows, rk)


@triton.jit
def _wy_wu_kernel(
    q_ptr, k_ptr, v_ptr, cstart_ptr, clen_ptr, t_ptr, g_ptr, f_ptr, w_ptr, u_ptr, p_ptr, kd_ptr,
    Hv, Dk, Dv, heads_per_key, scale,
    s_q_t, s_q_h, s_q_d,
    s_k_t, s_k_h, s_k_d,
    s_v_t, s_v_h, s_v_d,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    COLS: tl.constexpr,
    PRECISION: tl.constexpr,
    KD: tl.constexpr,
):  # fmt: skip
    """Per (chunk, value head): W [CHUNK, Dk], U [CHUNK, Dv] and the scores P [CHUNK, CHUNK] in their scratch dtypes
    and, with KD, the decayed keys k^ exp(G_last - G); the head dims COLS columns at a time, so that one
    [CHUNK, COLS] product is live beside T."""
    h = tl.program_id(0) % Hv
    ci = tl.program_id(0) // Hv
    n = tl.load(clen_ptr + ci)
    if n == 0:
        return
    kh = h // heads_per_key
    t = tl.load(cstart_ptr + ci).to(tl.int64) + tl.arange(0, CHUNK)
    offs_c = tl.arange(0, CHUNK)
    valid = offs_c < n
    e = ci.to(tl.int64) * Hv + h
    causal = offs_c[:, None] >= offs_c[None, :]
    mat = offs_c[:, None] * CHUNK + offs_c[None, :]
    f_at = f_ptr + e * 3 * CHUNK
    cum = tl.load(g_ptr + e * CHUNK + offs_c)
    rk = tl.load(f_at + 2 * CHUNK + offs_c)
    # T's blocks above the diagonal were never written: masked, not read. The per-token factors go into T's
    # columns, so the inputs enter the products as stored; T is read again for U (from cache) rather than kept.
    t_w = _scaled_cols(tl.load(t_ptr + e * CHUNK * CHUNK + mat, mask=causal, other=0.0), tl.load(f_at + offs_c))
    cum_last = tl.sum(tl.where(offs_c == CHUNK - 1, cum, 0.0), axis=0)

    qk = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    qq = tl.zeros([CHUNK], dtype=tl.float32)
    for c0 in range(0, BLOCK_K, COLS):
        offs = c0 + tl.arange(0, COLS)
        m = offs < Dk
        k = tl.load(k_ptr + t[:, None] * s_k_t + kh * s_k_h + offs[None, :] * s_k_d, mask=valid[:, None] & m[None, :],
                    other=0.0)  # fmt: skip
        w = _low_dot(t_w, k, PRECISION)
        tl.store(w_ptr + e * CHUNK * Dk + offs_c[:, None] * Dk + offs[None, :], round_to(w, w_ptr.dtype.element_ty),
                 mask=m[None, :])  # fmt: skip
        if KD:
            kd = k.to(tl.float32) * (rk * tl.exp(cum_last - cum))[:, None]
            tl.store(kd_ptr + e * CHUNK * Dk + offs_c[:, None] * Dk + offs[None, :],
                     round_to(kd, kd_ptr.dtype.element_ty), mask=m[None, :])  # fmt: skip
        q = tl.load(q_ptr + t[:, None] * s_q_t + kh * s_q_h + offs[None, :] * s_q_d, mask=valid[:, None] & m[None, :],
                    other=0.0)  # fmt: skip
        qq += tl.sum(q.to(tl.float32) * q.to(tl.float32), axis=1)
        qk = _raw_dot(q, tl.trans(k), qk, PRECISION)
    rq = tl.math.rsqrt(qq + 1e-6) * scale
    decay = tl.where(causal, tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    p = qk * (rq[:, None] * rk[None, :]) * decay
    tl.store(p_ptr + e * CHUNK * CHUNK + mat, round_to(p, p_ptr.dtype.element_ty))

    t_u = _scaled_cols(tl.load(t_ptr + e * CHUNK * CHUNK + mat, mask=causal, other=0.0),
                       tl.load(f_at + CHUNK + offs_c))  # fmt: skip
    for c0 in range(0, BLOCK_DV, COLS):
        offs = c0 + tl.arange(0, COLS)
        m = offs < Dv
        v = tl.load(v_ptr + t[:, None] * s_v_t + h * s_v_h + offs[None, :] * s_v_d, mask=valid[:, None] & m[None, :],
                    other=0.0)  # fmt: skip
        u = _low_dot(t_u, v, PRECISION)
        tl.store(u_ptr + e * CHUNK * Dv + offs_c[:, None] * Dv + offs[None, :], round_to(u, u_ptr.dtype.element_ty),
                 mask=m[None, :])  # fmt: skip
