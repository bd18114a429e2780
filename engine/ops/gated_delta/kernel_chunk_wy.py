"""Chunk-parallel Triton kernels of the Gated DeltaNet varlen prefill (the chunked WY form of the reference's
`_chunk_row`), launched by `kernel_prefill.py`.

A row's long walk is split so that only one cheap loop stays serial. Chunks of CHUNK tokens are counted from each
row's first token (a row's last chunk is partial; its missing tokens act as padding with k = v = 0, g = 0, beta = 0,
which leave the state as it is) and numbered over the batch, row after row.

1. `_chunk_table_kernel`: per chunk its first token and length, per row the number of its first chunk, built on the
   device from `query_start_loc` (no host read, so a CUDA graph can capture it). The table has room for the bound
   cdiv(T, CHUNK) + R; the chunks past the batch's last have length 0 and their programs exit at once.
2. The prep (`kernel_chunk_prep.py`), two launches over every (chunk, value head) at once: from the raw inputs (q, k
   of key head h // (Hv // Hk) l2-normalised, q scaled by Dk^-0.5, g and beta as the decode kernel makes them) the
   within-chunk cumulative log decay G, the UT system A[i, j] = beta_i (k_i . k_j) exp(G_i - G_j) (i > j) and its
   inverse T = (I + A)^-1; then W = T (beta exp(G) k), U = T (beta v) and the causal scores
   P[i, j] = (q_i . k_j) exp(G_i - G_j) (i >= j).
3. `_wy_scan_kernel`, one program per (row, value head, block of BLOCK_V value columns): the [Dk, BLOCK_V] state in
   fp32 registers from the row's slot (zeros, the slot never read, where has_initial_state[r] is False), then per
   chunk V' = U - W S, O = (q exp(G)) S + P V', S = exp(G_last) S + (k exp(G_last - G))^T V'; the final state is
   stored once, rounded to the pool dtype. No per-chunk state goes to memory: the state kernel and the output
   kernel of the usual chunked pipeline are one.

Precision (`tuning.WY_PRECISION`, `tuning.WY_SCAN_BF16`). fp32 inputs: every product in full fp32, scratch fp32,
within fp32 rounding of the reference. 16-bit inputs: the prep's key and query products take the inputs as stored
(exact products, fp32 sums), the UT solve's products run on tensor cores in TF32 (the diagonal blocks' inverses
in full fp32), and W and U multiply bf16 operands (T's scaled columns and the inputs as stored); the scan,
the serial part, multiplies bf16 operands too (the state, W, V', the scores, q and k each rounded to bf16; fp32
sums), as flash-linear-attention does. Scratch (`wy_scratch`): T, W, U and P in bf16 where the products round
them so anyway (half the bytes). U enters V' = U - W S unrounded, so storing it in bf16 rounds it once more, as
flash-linear-attention does too: the state's error grows by a fifth of itself, within the 16-bit tolerances.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.gated_delta.kernel import _program_tile
from baton.engine.ops.gated_delta.kernel_chunk_prep import _wy_solve_kernel, _wy_wu_kernel
from baton.engine.ops.gated_delta.tuning import (
    WY_MAX_CHUNK,
    WY_PRECISION,
    WY_PREP_COLS,
    WY_PREP_STAGES,
    WY_PREP_WARPS,
    WY_SCAN_BF16,
    WY_SCAN_STAGES,
    WY_SCAN_TILE,
    WY_SCAN_WARPS,
    WY_SOLVE_BK,
    WY_SOLVE_DOUBLING,
    WY_SOLVE_STAGES,
    WY_SOLVE_WARPS,
    WY_SUB,
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
    mat = offs_c[:, None] * CHUNK + offs_c[None, :]
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
        o += _mm(tl.load(p_ptr + e * CHUNK * CHUNK + mat), v_new, PRECISION, BF16_DOTS)
        tl.store(o_ptr + t0 * s_o_t + h * s_o_h + offs_c[:, None] * s_o_t + offs_v[None, :] * s_o_d,
                 round_to(o, o_ptr.dtype.element_ty), mask=valid[:, None] & mask_v[None, :])  # fmt: skip

        k = _unit_rows(k_ptr + t0 * s_k_t + kh * s_k_h, offs_c, valid, offs_k, mask_k, s_k_t, s_k_d)
        s = s * tl.exp(cum_last) + _mm(tl.trans(k * tl.exp(cum_last - cum)[:, None]), v_new, PRECISION, BF16_DOTS)
    tile = offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
    tl.store(state_at + tile, round_to(s, state_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_v[None, :])


def chunk_parallel(chunk_size: int) -> bool:
    """Whether a prefill of `chunk_size` can run these kernels: their tiles need a power of two of at least
    MIN_DOT (and WY_SUB) tokens, and at most WY_MAX_CHUNK."""
    return max(MIN_DOT, WY_SUB) <= chunk_size <= WY_MAX_CHUNK and chunk_size & (chunk_size - 1) == 0


def wy_scratch(max_chunks: int, Hv: int, Dk: int, Dv: int, chunk: int, low: torch.dtype, device: torch.device,
               kd: bool = False) -> dict[str, Tensor]:  # fmt: skip
    """The per-(chunk, value head) tensors the prep writes for the scan: in the dtype `low` (fp32 or bf16) W
    [., C, Dk], U [., C, Dv], the scores p [., C, C] and the prep's own T [., C, C]; in fp32 the cumulative log
    decay g [., C] and the prep's per-token factors f [., 3, C]. With `kd`, also the split scan's decayed keys kd
    [., C, Dk] in `low`."""
    f32 = dict(dtype=torch.float32, device=device)
    n = (max_chunks, Hv)
    lo = dict(dtype=low, device=device)
    out = dict(w=torch.empty(*n, chunk, Dk, **lo), u=torch.empty(*n, chunk, Dv, **lo),
               p=torch.empty(*n, chunk, chunk, **lo), t=torch.empty(*n, chunk, chunk, **lo),
               g=torch.empty(*n, chunk, **f32), f=torch.empty(*n, 3, chunk, **f32))
    if kd:
        out["kd"] = torch.empty(*n, chunk, Dk, **lo)
    return out


class WyPrepared(NamedTuple):
    """What `wy_prepare` leaves for a second stage: the chunk table, the prep's scratch and the launch choices."""

    first: Tensor  # [R] each row's first chunk
    starts: Tensor  # [max_chunks] each chunk's first token
    lengths: Tensor  # [max_chunks] each chunk's length (0 past the batch's chunks)
    scratch: dict[str, Tensor]
    block_k: int
    precision: str  # tl.dot input precision of the second stage's products
    bf16_dots: bool  # whether the second stage rounds its products' operands to bf16
    fp32: bool  # whether q, k and v are all fp32


def wy_prepare(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
               query_start_loc: Tensor, R: int, chunk_size: int, kd: bool = False) -> WyPrepared:  # fmt: skip
    """The chunk table and prep launches of a chunk-parallel prefill of R >= 1 rows (with `kd`, the prep also
    writes the decayed keys the split scan takes)."""
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
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
    # The products round W, U, P and T to bf16 anyway: stored so, they move half the bytes for the same result.
    scratch = wy_scratch(max_chunks, Hv, Dk, Dv, chunk_size, torch.bfloat16 if bf16_dots else torch.float32, dev,
                         kd=kd)  # fmt: skip
    block_k = max(MIN_DOT, next_power_of_2(Dk))
    block_dv = max(MIN_DOT, next_power_of_2(Dv))
    grid = (max_chunks * Hv,)
    _wy_solve_kernel[grid](
        k, a, b, A_log, dt_bias, starts, lengths, scratch["t"], scratch["g"], scratch["f"], Hv, Dk, Hv // Hk,
        *k.stride(), *a.stride(), *b.stride(),
        CHUNK=chunk_size, SUB=WY_SUB, BLOCK_K=block_k, BK=min(block_k, WY_SOLVE_BK), PRECISION=solve_precision,
        DOUBLING=bool(WY_SOLVE_DOUBLING), num_warps=WY_SOLVE_WARPS, num_stages=1 if fp32 else WY_SOLVE_STAGES,
    )  # fmt: skip
    _wy_wu_kernel[grid](
        q, k, v, starts, lengths, scratch["t"], scratch["g"], scratch["f"],
        scratch["w"], scratch["u"], scratch["p"], scratch.get("kd", scratch["w"]),
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5, *q.stride(), *k.stride(), *v.stride(),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_DV=block_dv,
        COLS=min(block_k, block_dv, WY_PREP_COLS), PRECISION=precision, KD=kd, num_warps=WY_PREP_WARPS,
        num_stages=1 if fp32 else WY_PREP_STAGES,
    )  # fmt: skip
    return WyPrepared(first, starts, lengths, scratch, block_k, precision, bf16_dots, fp32)


def chunk_wy_prefill(state: Tensor, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                     dt_bias: Tensor, query_start_loc: Tensor, state_slots: Tensor, init_flags: Tensor,
                     chunk_size: int, o: Tensor) -> None:  # fmt: skip
    """The three launches of a chunk-parallel prefill of R >= 1 rows (shapes checked by the caller; init_flags is
    has_initial_state as bytes), writing o [T, Hv, Dv] and the rows' final states into their slots."""
    Hk, Dk = q.shape[1], q.shape[2]
    Hv, Dv = v.shape[1], v.shape[2]
    R = state_slots.shape[0]
    prep = wy_prepare(q, k, v, a, b, A_log, dt_bias, query_start_loc, R, chunk_size)
    scratch, block_k = prep.scratch, prep.block_k
    block_v = max(MIN_DOT, min(next_power_of_2(Dv), WY_SCAN_TILE // block_k))
    _wy_scan_kernel[(cdiv(Dv, block_v) * Hv * R,)](
        state, q, k, query_start_loc, state_slots, init_flags, prep.first,
        scratch["w"], scratch["u"], scratch["p"], scratch["g"], o,
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        *state.stride(), *q.stride(), *k.stride(), *o.stride(),
        CHUNK=chunk_size, BLOCK_K=block_k, BLOCK_V=block_v, PRECISION=prep.precision, BF16_DOTS=prep.bf16_dots,
        num_warps=WY_SCAN_WARPS, num_stages=1 if prep.fp32 else WY_SCAN_STAGES,
    )  # fmt: skip
