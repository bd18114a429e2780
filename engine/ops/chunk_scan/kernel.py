"""Triton kernels of the Mamba2 chunked selective scan ("SSD") over a varlen batch of prefill rows.

Same signature, semantics and return value as the torch reference `mamba_chunk_scan_varlen`
(`reference.py`; see it for the math): dt is raw (discretized here exactly as `discretize_dt`),
each row is cut into chunks of `chunk_size` tokens counted from its own first token, a row starts from
its slot's state when has_initial_state (from zeros otherwise, and the slot is then never read), y comes
back in x.dtype with the D * x skip, and the row's final state goes into its slot in the pool's dtype.
An empty row writes its initial state (or zeros) back, as the reference does. Head h uses the B/C group
h // (H // G).

Three or four launches, stream-ordered (fp32 math, fp32 accumulators; `tl.dot` takes 16-bit operands
when the activations are bf16/fp16, and fp32 with IEEE precision when they are fp32):

0. `_ssd_dt_kernel`, one program per (chunk, block of heads), all chunks at once: the discretized dt and
   the running sums of a = dt * A from the chunk's start, into fp32 [H, T] buffers for launches 1 and 3.
   (Taken out of launch 1's sequential walk, where each chunk's scan and reductions lay on the path from
   one chunk to the next.)
1. `_ssd_state_kernel`, one program per (row, head, block of P, block of N), sequential over the row's
   chunks. It holds its [BLOCK_P, BLOCK_N] state tile in fp32 registers, starting from the slot (or
   zeros). Per chunk it loads dt and the running sums, stores the tile as the chunk's START state (in the
   dot dtype: what phase 3 multiplies with), then advances it:
       s = exp(sum a) * s + (x * dt * exp(decay to chunk end))^T @ B          (one tl.dot)
   After the row's last chunk it stores the tile into the row's slot, rounded to the pool dtype. A
   program reads the slot tile it later overwrites, and no other program touches it.
   Fusing the chunk-state and state-passing phases means the per-chunk contributions never go through
   memory (they would be an fp32 [chunks, H, P, N] buffer written once and read once).
2. (share_cb, the default) `_ssd_cb_kernel`, one program per (chunk, group, block of BLOCK_M chunk
   positions): C_m @ B_k^T for the source blocks k up to the diagonal, into a [chunks, G, chunk_size,
   chunk_size] buffer padded to whole tiles (fp32 by default, as state-spaces/mamba keeps its CB; the tiles
   up to the diagonal are written whole, zero above it). The heads of a group share B and C, so this is
   computed once per group instead of once per head (H // G times over, 16 at the 8B-like size).
3. `_ssd_output_kernel`, one program per (chunk, block of BLOCK_M chunk positions x block of P, head):
       y_m = (C_m @ S^T) * exp(cs_m) + sum over source blocks k <= m of
             ((C_m @ B_k^T) * exp(cs_m - cs_k) * dt_k, causal) @ x_k  + D * x_m
   with S the chunk's start state. Only source blocks up to the diagonal are visited. The C_m @ B_k^T
   tile is read from launch 2's buffer (share_cb) or recomputed per head (share_cb=False, the old path).
   With the same tiles and an fp32 buffer both give the same products. The in-chunk decay is factored
   where that is safe (A <= 0 and the block's running sums span <= FACTOR_RANGE, so nothing overflows):
   exp(cs_m - cs_k) = exp(cs_m - c) * exp(c - cs_k) around the middle c of the block's sums, a column scale
   on the C·B^T tile and a row scale on the result, instead of an exp and a causal mask per tile entry (the
   kernel was bound by those integer and special-function instructions). The same roundings as the exact
   path (the product C·B^T * scale * dt once to the dot dtype), so the same accuracy; else the exact path.

No host reads of device tensors when `chunk_meta` is given: the grids of launches 0, 2 and 3 need the
number of chunks over all rows, which `build_chunk_meta` computes from host ints (the runner has them).
Without it, the op reads query_start_loc back (`.tolist()`, a sync) and builds the metadata itself.
Only shapes and dtypes are checked; slot values are the caller's contract, unchecked (distinct, in [0, S): an
out-of-range slot is an out-of-bounds access, two rows on one slot race). The reference checks them.

All tensors are addressed through their strides, so x, B, C and dt may be views into the in_proj / conv
output. Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported) runs all the
launches on CPU tensors; its tl.dot mishandles bf16 (numpy has none), so there the 16-bit operands are
rounded as on the GPU and multiplied in fp32 (`_operand`). On the GPU, `tl.exp` is the fast ex2.approx
path and the in-chunk decays come from differences of running sums (the reference sums the masked
terms), so results agree with the reference to a few fp32 ulps of the state (plus the 16-bit rounding of
dot operands and of the chunk-start states), not bit for bit.

Cost model (8B-like layer, 8k bf16 tokens, chunk 128): launch 0 reads dt and writes dt and the running
sums (~10 MB); launch 1 reads x once per N block and writes the bf16 chunk-start states (~134 MB); launch 2
reads B and C once and writes the tiles up to the diagonal of the fp32 CB (~25 MB of 34 MB allocated at
64 x 32 tiles); launch 3 reads x, the start states and writes y (~400 MB in all), and per head reads the CB
tiles (from L2 mostly: as many bytes as the B tiles the per-head path reads, but without its C·B tl.dot,
~45% of that kernel's tensor-core work). block_p / block_n / block_m / block_k are exposed for tuning;
launch 2 uses launch 3's block_m / block_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.ops.chunk_scan.tuning import (
    CB_STAGES,
    CB_WARPS,
    DT_BLOCK_H,
    DT_WARPS,
    FACTOR_RANGE,
    OUTPUT_MAXNREG,
    OUTPUT_STAGES,
    OUTPUT_WARPS,
    STATE_AFFINE,
    STATE_BLOCK_P,
    STATE_BLOCK_P_WIDE,
    STATE_ONE_WAVE_STAGES,
    STATE_ONE_WAVE_WARPS,
    STATE_PROGRAMS_PER_SM,
    STATE_STAGES,
    STATE_WARPS,
)
from baton.engine.ops.triton_common import (
    cdiv,
    next_power_of_2,
    round_to,
    shared_memory_per_block,
    sm_count,
    softplus,
)
from baton.engine.ops.triton_common import interpreted as _interpreted

_FN = "mamba_chunk_scan_varlen_triton"
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MIN_BLOCK = 16  # tl.dot's smallest tile side


# ---- chunk metadata (host ints -> one small device tensor) --------------------------------------


@dataclass(frozen=True)
class ChunkMeta:
    """Where the chunks of a varlen batch lie, as device int32 tensors; build it with `build_chunk_meta`.

    Chunk c (counted over all rows, row by row) covers tokens chunk_start[c] : chunk_start[c] +
    chunk_len[c]; row r owns chunks row_chunk[r] : row_chunk[r+1] (none for an empty row), so a row's
    first chunk is row_chunk[r] and its last row_chunk[r+1] - 1. The host ints say what it was built for.
    """

    num_tokens: int
    num_rows: int
    chunk_size: int
    num_chunks: int
    chunk_start: Tensor  # [num_chunks] int32
    chunk_len: Tensor  # [num_chunks] int32
    row_chunk: Tensor  # [num_rows + 1] int32


def _check_bounds(fn: str, starts: list[int], num_tokens: int | None) -> None:
    """Host ints: non-decreasing from 0 (to num_tokens, when given)."""
    if (
        not starts
        or starts[0] != 0
        or (num_tokens is not None and starts[-1] != num_tokens)
        or any(a > b for a, b in zip(starts, starts[1:], strict=False))
    ):
        to = "" if num_tokens is None else f" to T = {num_tokens}"
        raise ValueError(f"{fn}: query_start_loc expected non-decreasing from 0{to}, got {starts}")


def build_chunk_meta(query_start_loc_host: list[int], chunk_size: int, device) -> ChunkMeta:
    """ChunkMeta of the rows query_start_loc_host[r] : query_start_loc_host[r+1] (host ints, non-decreasing
    from 0). One host-to-device copy, from pinned memory and non-blocking on CUDA (a pageable copy would
    wait for the stream); no device reads. The caching host allocator keeps the pinned block until the
    copy is done. Each array starts 16-byte aligned (`to_device_parts`): Triton specializes a pointer on that.
    """
    from baton.engine.host_copy import to_device_parts

    starts = [int(s) for s in query_start_loc_host]
    _check_bounds("build_chunk_meta", starts, None)
    if chunk_size <= 0:
        raise ValueError(f"build_chunk_meta: expected chunk_size > 0, got {chunk_size}")
    chunk_start: list[int] = []
    chunk_len: list[int] = []
    row_chunk = [0]
    for lo, hi in zip(starts, starts[1:], strict=False):
        for s in range(lo, hi, chunk_size):
            chunk_start.append(s)
            chunk_len.append(min(chunk_size, hi - s))
        row_chunk.append(len(chunk_start))
    n = len(chunk_start)
    chunk_start_d, chunk_len_d, row_chunk_d = to_device_parts([chunk_start, chunk_len, row_chunk], torch.int32,
                                                              torch.device(device))
    return ChunkMeta(
        num_tokens=starts[-1], num_rows=len(starts) - 1, chunk_size=chunk_size, num_chunks=n,
        chunk_start=chunk_start_d, chunk_len=chunk_len_d, row_chunk=row_chunk_d,
    )  # fmt: skip


# ---- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _operand(v, dtype: tl.constexpr, NATIVE_DOT: tl.constexpr):
    """`v` as a tl.dot operand of `dtype` (rounded to nearest even). The interpreter's tl.dot mishandles
    bf16 (numpy has none), so without NATIVE_DOT the rounded value is handed over in fp32: the same
    products, an fp32 dot."""
    if NATIVE_DOT:
        return v.to(dtype)
    else:
        return round_to(v.to(tl.float32), dtype).to(tl.float32)


@triton.jit
def _mma(a, b, NATIVE_DOT: tl.constexpr):
    """a @ b with an fp32 accumulator; fp32 operands in full (IEEE) precision rather than TF32."""
    if NATIVE_DOT:
        return tl.dot(a, b)
    else:
        return tl.dot(a, b, input_precision="ieee")


# P, N and the heads per group are compile-time constants of the three kernels (a model has one layer shape), so that
# a block's P / N mask is all-true without a compare where whole blocks tile P / N.
@triton.jit
def _in_bounds(offs, size: tl.constexpr, BLOCK: tl.constexpr):
    """offs < size for a block of BLOCK offsets; all true, with no compare, where whole blocks tile size."""
    if size % BLOCK == 0:
        return tl.full([BLOCK], 1, tl.int1)
    else:
        return offs < size


@triton.jit
def _ssd_dt_kernel(
    dt_ptr, A_ptr, dt_bias_ptr, chunk_start_ptr, chunk_len_ptr, dt_out_ptr, cs_out_ptr,
    H, dt_min, s_dt_t, s_dt_h, s_buf_h, s_buf_t,
    BLOCK_L: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """One (chunk, block of heads): the discretized dt, max(softplus(dt + dt_bias), dt_min), and the running sums cs
    of dt * A from the chunk's start (inclusive), into fp32 [H, T] buffers; nothing past the chunk's end."""
    c = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    mask_h = offs_h < H
    mask = (offs_l < length)[:, None] & mask_h[None, :]
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + start * s_dt_t + offs_l[:, None] * s_dt_t + offs_h[None, :] * s_dt_h, mask=mask, other=0.0)
    dt = tl.where(mask, tl.maximum(softplus(dt.to(tl.float32) + dt_bias[None, :]), dt_min), 0.0)  # [BLOCK_L, BLOCK_H]
    cs = tl.cumsum(dt * A[None, :], axis=0)
    buf = start * s_buf_t + offs_l[:, None] * s_buf_t + offs_h[None, :] * s_buf_h
    tl.store(dt_out_ptr + buf, dt, mask=mask)
    tl.store(cs_out_ptr + buf, cs, mask=mask)


@triton.jit
def _ssd_state_kernel(
    x_ptr, B_ptr,
    pool_ptr, slots_ptr, init_ptr,
    chunk_start_ptr, chunk_len_ptr, row_chunk_ptr,
    states_ptr, dt_ptr, cs_ptr,
    P: tl.constexpr, N: tl.constexpr, heads_per_group: tl.constexpr, chunk_size,
    s_x_t, s_x_h, s_x_p,
    s_B_t, s_B_g, s_B_n,
    s_pool_slot, s_pool_h, s_pool_p, s_pool_n,
    s_st_c, s_st_h, s_st_p, s_st_n,
    s_buf_h, s_buf_t,
    NATIVE_DOT: tl.constexpr,
    AFFINE: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    h = tl.program_id(1)
    pid_pn = tl.program_id(2)
    n_pblocks = tl.cdiv(P, BLOCK_P)
    pid_p = pid_pn % n_pblocks
    pid_n = pid_pn // n_pblocks
    g = h // heads_per_group

    offs_l = tl.arange(0, BLOCK_L)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_p = _in_bounds(offs_p, P, BLOCK_P)
    mask_n = _in_bounds(offs_n, N, BLOCK_N)
    mask_pn = mask_p[:, None] & mask_n[None, :]

    dot_dtype = states_ptr.dtype.element_ty

    # The initial state; without has_initial_state the slot is masked off entirely (never read).
    # Addressing: 64-bit scalar base pointers (per row, head, chunk), 32-bit offsets within a tile; 64-bit
    # pointer arithmetic per tile element would cost registers.
    slot = tl.load(slots_ptr + r).to(tl.int64)
    pool_head = pool_ptr + slot * s_pool_slot + h.to(tl.int64) * s_pool_h
    pn_pool = offs_p[:, None] * s_pool_p + offs_n[None, :] * s_pool_n  # [BLOCK_P, BLOCK_N]
    init = tl.load(init_ptr + r).to(tl.int32)
    p_init = tl.where(init != 0, P, 0)
    init_mask = (offs_p < p_init)[:, None] & mask_n[None, :]
    s = tl.load(pool_head + pn_pool, mask=init_mask, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]

    x_head = x_ptr + h.to(tl.int64) * s_x_h
    B_group = B_ptr + g.to(tl.int64) * s_B_g
    st_head = states_ptr + h.to(tl.int64) * s_st_h
    st_tile = offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n
    dt_head = dt_ptr + h.to(tl.int64) * s_buf_h
    cs_head = cs_ptr + h.to(tl.int64) * s_buf_h

    # int64 bounds make the chunk index (and the offsets from it) 64-bit on the GPU; the interpreter hands
    # the loop a Python int, so no `.to()` on it.
    c_lo = tl.load(row_chunk_ptr + r).to(tl.int64)
    c_hi = tl.load(row_chunk_ptr + r + 1).to(tl.int64)
    # AFFINE: a row's chunks start every chunk_size tokens from its first (as build_chunk_meta lays them out), so
    # the loop's addresses are affine in c instead of loaded from the metadata each chunk (which software
    # pipelining can prefetch ahead of the chunk before). The row's bounds are read once (masked: an empty row's
    # first chunk index may be past the metadata).
    if AFFINE:
        has_chunks = c_lo < c_hi
        row_start = tl.load(chunk_start_ptr + c_lo, mask=has_chunks, other=0).to(tl.int64)
        row_end = (tl.load(chunk_start_ptr + c_hi - 1, mask=has_chunks, other=0).to(tl.int64)
                   + tl.load(chunk_len_ptr + c_hi - 1, mask=has_chunks, other=0).to(tl.int64))
    for c in range(c_lo, c_hi):
        if AFFINE:
            start = row_start + (c - c_lo) * chunk_size
            length = tl.minimum(row_end - start, chunk_size).to(tl.int32)
        else:
            start = tl.load(chunk_start_ptr + c).to(tl.int64)
            length = tl.load(chunk_len_ptr + c)
        mask_l = offs_l < length

        # dt and the running sums from _ssd_dt_kernel (the walk has no scan or reduction on it); the chunk's decay is
        # its last running sum itself (the last token's decay to the chunk's end must be exactly exp(0) = 1).
        dt = tl.load(dt_head + start * s_buf_t + offs_l * s_buf_t, mask=mask_l, other=0.0)  # [BLOCK_L]
        cs = tl.load(cs_head + start * s_buf_t + offs_l * s_buf_t, mask=mask_l, other=0.0)
        total = tl.load(cs_head + (start + length - 1) * s_buf_t)

        # The state at the chunk's start, for the output kernel.
        tl.store(st_head + c * s_st_c + st_tile, round_to(s, dot_dtype), mask=mask_pn)

        # The chunk's own contribution: token l's input, decayed to the chunk's end.
        x = tl.load(
            x_head + start * s_x_t + offs_l[:, None] * s_x_t + offs_p[None, :] * s_x_p,
            mask=mask_l[:, None] & mask_p[None, :],
            other=0.0,
        ).to(tl.float32)  # [BLOCK_L, BLOCK_P]
        Bm = tl.load(
            B_group + start * s_B_t + offs_l[:, None] * s_B_t + offs_n[None, :] * s_B_n,
            mask=mask_l[:, None] & mask_n[None, :],
            other=0.0,
        )  # [BLOCK_L, BLOCK_N]
        # Past the chunk's end dt is 0 and the decay exp(0): a zero weight even where exp(total) would overflow (A > 0).
        w = x * (dt * tl.exp(tl.where(mask_l, total - cs, 0.0)))[:, None]
        contrib = _mma(
            tl.trans(_operand(w, dot_dtype, NATIVE_DOT)), _operand(Bm, dot_dtype, NATIVE_DOT), NATIVE_DOT
        )  # [BLOCK_P, BLOCK_N]
        s = tl.exp(total) * s + contrib

    tl.store(pool_head + pn_pool, round_to(s, pool_ptr.dtype.element_ty), mask=mask_pn)


@triton.jit
def _cb_tile(C_m, B_chunk, offs_k, offs_n, mask_k, mask_n, s_B_t, s_B_n, dot_dtype: tl.constexpr,
             NATIVE_DOT: tl.constexpr):  # fmt: skip
    """C_m @ B_k^T [BLOCK_M, BLOCK_K] in fp32: C_m (a dot operand already) against the chunk's B rows offs_k,
    loaded transposed (zero past the chunk's end)."""
    Bt_k = tl.load(
        B_chunk + offs_k[None, :] * s_B_t + offs_n[:, None] * s_B_n,
        mask=mask_n[:, None] & mask_k[None, :],
        other=0.0,
    )  # [BLOCK_N, BLOCK_K]
    return _mma(C_m, _operand(Bt_k, dot_dtype, NATIVE_DOT), NATIVE_DOT)


@triton.jit
def _ssd_cb_kernel(
    B_ptr, C_ptr, chunk_start_ptr, chunk_len_ptr, cb_ptr, dot_ref_ptr,
    N: tl.constexpr,
    s_B_t, s_B_g, s_B_n,
    s_C_t, s_C_g, s_C_n,
    s_cb_c, s_cb_g, s_cb_m, s_cb_k,
    NATIVE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """C_m @ B_k^T of one (chunk, group, block of BLOCK_M chunk positions), for the source blocks up to the
    diagonal, stored in cb_ptr's dtype (the output kernel's tiles and operand rounding: with the same
    BLOCK_M / BLOCK_K these are the very products its per-head path computes). Every entry of those tiles is
    stored: zero above the diagonal and past the chunk's end."""
    c = tl.program_id(0)
    g = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    dot_dtype = dot_ref_ptr.dtype.element_ty  # the output kernel's: x's (dot_ref_ptr is never read)

    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < length
    mask_n = _in_bounds(offs_n, N, BLOCK_N)
    B_chunk = B_ptr + g.to(tl.int64) * s_B_g + start * s_B_t
    C_chunk = C_ptr + g.to(tl.int64) * s_C_g + start * s_C_t
    cb_tile = cb_ptr + c.to(tl.int64) * s_cb_c + g.to(tl.int64) * s_cb_g
    C_m = tl.load(
        C_chunk + offs_m[:, None] * s_C_t + offs_n[None, :] * s_C_n,
        mask=mask_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    C_m = _operand(C_m, dot_dtype, NATIVE_DOT)  # [BLOCK_M, BLOCK_N]
    k_hi = tl.where(m0 < length, tl.minimum(m0 + BLOCK_M, length), 0)
    for k0 in range(0, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < length
        cb = _cb_tile(C_m, B_chunk, offs_k, offs_n, mask_k, mask_n, s_B_t, s_B_n, dot_dtype, NATIVE_DOT)
        # The whole tile, zero above the diagonal (the buffer is padded to whole tiles): the output kernel's
        # factored path reads it unmasked. Past the chunk's end C and B were loaded as zeros, so are these.
        cb = tl.where(offs_m[:, None] >= offs_k[None, :], cb, 0.0)
        tl.store(cb_tile + offs_m[:, None] * s_cb_m + offs_k[None, :] * s_cb_k, round_to(cb, cb_ptr.dtype.element_ty))


@triton.jit
def _ssd_output_kernel(
    x_ptr, A_ptr, B_ptr, C_ptr, D_ptr,
    chunk_start_ptr, chunk_len_ptr,
    states_ptr, dt_buf_ptr, cs_buf_ptr, y_ptr, cb_ptr,
    P: tl.constexpr, N: tl.constexpr, heads_per_group: tl.constexpr, factor_range,
    s_x_t, s_x_h, s_x_p,
    s_B_t, s_B_g, s_B_n,
    s_C_t, s_C_g, s_C_n,
    s_st_c, s_st_h, s_st_p, s_st_n,
    s_buf_h, s_buf_t,
    s_y_t, s_y_h, s_y_p,
    s_cb_c, s_cb_g, s_cb_m, s_cb_k,
    NATIVE_DOT: tl.constexpr,
    SHARE_CB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    pid_mp = tl.program_id(1)
    h = tl.program_id(2)
    n_pblocks = tl.cdiv(P, BLOCK_P)
    pid_p = pid_mp % n_pblocks
    m0 = (pid_mp // n_pblocks) * BLOCK_M
    g = h // heads_per_group
    dot_dtype = states_ptr.dtype.element_ty

    start = tl.load(chunk_start_ptr + c).to(tl.int64)
    length = tl.load(chunk_len_ptr + c)
    offs_m = m0 + tl.arange(0, BLOCK_M)  # positions within the chunk
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < length
    mask_p = _in_bounds(offs_p, P, BLOCK_P)
    mask_n = _in_bounds(offs_n, N, BLOCK_N)

    # 64-bit scalar base pointers at the chunk's first token, 32-bit offsets within the tiles.
    x_chunk = x_ptr + h.to(tl.int64) * s_x_h + start * s_x_t
    B_chunk = B_ptr + g.to(tl.int64) * s_B_g + start * s_B_t
    C_chunk = C_ptr + g.to(tl.int64) * s_C_g + start * s_C_t
    cs_chunk = cs_buf_ptr + h.to(tl.int64) * s_buf_h + start * s_buf_t
    dt_chunk = dt_buf_ptr + h.to(tl.int64) * s_buf_h + start * s_buf_t
    cb_chunk = cb_ptr + c.to(tl.int64) * s_cb_c + g.to(tl.int64) * s_cb_g  # (a stand-in without SHARE_CB)
    cs_m = tl.load(cs_chunk + offs_m * s_buf_t, mask=mask_m, other=0.0)  # [BLOCK_M]
    C_m = tl.load(
        C_chunk + offs_m[:, None] * s_C_t + offs_n[None, :] * s_C_n,
        mask=mask_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    C_m = _operand(C_m, dot_dtype, NATIVE_DOT)  # [BLOCK_M, BLOCK_N]

    # From the chunk's start state S [P, N], loaded transposed: (C_m @ S^T) * exp(cs_m).
    S_t = tl.load(
        states_ptr + c.to(tl.int64) * s_st_c + h.to(tl.int64) * s_st_h
        + offs_n[:, None] * s_st_n + offs_p[None, :] * s_st_p,
        mask=mask_n[:, None] & mask_p[None, :], other=0.0,
    )  # [BLOCK_N, BLOCK_P]  # fmt: skip
    S_t = _operand(S_t, dot_dtype, NATIVE_DOT)
    acc = _mma(C_m, S_t, NATIVE_DOT) * tl.exp(cs_m)[:, None]  # [BLOCK_M, BLOCK_P] fp32

    # Within the chunk: causal, decay-weighted C·B over the source blocks up to the diagonal.
    # (None for a block past the end of a short last chunk: its rows are all masked off.)
    k_hi = tl.where(m0 < length, tl.minimum(m0 + BLOCK_M, length), 0)
    # Factored path: exp(cs_m - cs_k) = exp(cs_m - c) * exp(c - cs_k), with c the middle of the block's running
    # sums. The decay then scales C·B^T's columns before the dot and y's rows after it, instead of a [BLOCK_M,
    # BLOCK_K] exp and causal mask per source block (C·B^T comes zero above the diagonal). Safe when A <= 0 (the sums
    # fall along the chunk: every factor for an earlier block is <= 1) and the block's own sums span at most
    # factor_range (its factors stay <= exp(factor_range / 2)); otherwise the exact per-entry path below.
    # (With A <= 0 the block's first running sum is its largest and its last the smallest.)
    has_rows = m0 < length
    cs_hi = tl.load(cs_chunk + m0 * s_buf_t, mask=has_rows, other=0.0)
    cs_lo = tl.load(cs_chunk + (tl.minimum(m0 + BLOCK_M, length) - 1) * s_buf_t, mask=has_rows, other=0.0)
    A_h = tl.load(A_ptr + h).to(tl.float32)
    if has_rows & (A_h <= 0.0) & (cs_hi - cs_lo <= factor_range):
        c_mid = 0.5 * (cs_hi + cs_lo)
        acc_in = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        for k0 in range(0, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < length
            if SHARE_CB:
                # Whole tiles, zero above the diagonal and past the chunk's end (_ssd_cb_kernel).
                cb = tl.load(cb_chunk + offs_m[:, None] * s_cb_m + offs_k[None, :] * s_cb_k)
            else:
                cb = _cb_tile(C_m, B_chunk, offs_k, offs_n, mask_k, mask_n, s_B_t, s_B_n, dot_dtype, NATIVE_DOT)
                cb = tl.where(offs_m[:, None] >= offs_k[None, :], cb, 0.0)
            cs_k = tl.load(cs_chunk + offs_k * s_buf_t, mask=mask_k, other=0.0)
            dt_k = tl.load(dt_chunk + offs_k * s_buf_t, mask=mask_k, other=0.0)
            x_k = tl.load(
                x_chunk + offs_k[:, None] * s_x_t + offs_p[None, :] * s_x_p,
                mask=mask_k[:, None] & mask_p[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_P]
            # The column scale goes on C·B^T (one rounding of the product; x as given, as in the exact path).
            w = cb.to(tl.float32) * (tl.exp(c_mid - cs_k) * dt_k)[None, :]
            acc_in += _mma(_operand(w, dot_dtype, NATIVE_DOT), _operand(x_k, dot_dtype, NATIVE_DOT), NATIVE_DOT)
        acc += tl.exp(tl.where(mask_m, cs_m - c_mid, 0.0))[:, None] * acc_in  # (rows past the end: stored masked)
    else:
        for k0 in range(0, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < length
            causal = (offs_m[:, None] >= offs_k[None, :]) & mask_k[None, :] & mask_m[:, None]
            if SHARE_CB:
                # The group's C·B tile, computed once by _ssd_cb_kernel.
                cb = tl.load(
                    cb_chunk + offs_m[:, None] * s_cb_m + offs_k[None, :] * s_cb_k, mask=causal, other=0.0
                ).to(tl.float32)  # [BLOCK_M, BLOCK_K]
            else:
                cb = _cb_tile(C_m, B_chunk, offs_k, offs_n, mask_k, mask_n, s_B_t, s_B_n, dot_dtype, NATIVE_DOT)
            cs_k = tl.load(cs_chunk + offs_k * s_buf_t, mask=mask_k, other=0.0)
            dt_k = tl.load(dt_chunk + offs_k * s_buf_t, mask=mask_k, other=0.0)
            # -inf above the diagonal: exp() is 0 there and never overflows.
            decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
            w = cb * decay * dt_k[None, :]
            x_k = tl.load(
                x_chunk + offs_k[:, None] * s_x_t + offs_p[None, :] * s_x_p,
                mask=mask_k[:, None] & mask_p[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_P]
            acc += _mma(_operand(w, dot_dtype, NATIVE_DOT), _operand(x_k, dot_dtype, NATIVE_DOT), NATIVE_DOT)

    # The skip connection, in fp32 from x as given.
    mask_mp = mask_m[:, None] & mask_p[None, :]
    x_m = tl.load(x_chunk + offs_m[:, None] * s_x_t + offs_p[None, :] * s_x_p, mask=mask_mp, other=0.0)
    acc += tl.load(D_ptr + h).to(tl.float32) * x_m.to(tl.float32)
    y_chunk = y_ptr + h.to(tl.int64) * s_y_h + start * s_y_t
    y_tile = y_chunk + offs_m[:, None] * s_y_t + offs_p[None, :] * s_y_p
    tl.store(y_tile, round_to(acc, y_ptr.dtype.element_ty), mask=mask_mp)


# ---- host side ---------------------------------------------------------------------------------------


def _check_args(x, dt, A, B, C, D, dt_bias, query_start_loc, ssm_state, state_slots, has_initial_state,
                chunk_size, chunk_meta) -> None:  # fmt: skip
    """The reference's shape checks plus dtype/device ones; never reads a device tensor."""
    if x.dim() != 3 or B.dim() != 3 or ssm_state.dim() != 4 or state_slots.dim() != 1:
        raise ValueError(
            f"{_FN}: expected x [T, H, P], B [T, G, N], ssm_state [S, H, P, N], state_slots [R], got "
            f"x {tuple(x.shape)}, B {tuple(B.shape)}, ssm_state {tuple(ssm_state.shape)}, "
            f"state_slots {tuple(state_slots.shape)}"
        )
    T, H, P = x.shape
    S, N = ssm_state.shape[0], ssm_state.shape[3]
    G, R = B.shape[1], state_slots.shape[0]
    check_shape(_FN, "ssm_state", ssm_state, "[S, H, P, N]", (S, H, P, N))
    check_shape(_FN, "dt", dt, "[T, H]", (T, H))
    check_shape(_FN, "A", A, "[H]", (H,))
    check_shape(_FN, "B", B, "[T, G, N]", (T, G, N))
    check_shape(_FN, "C", C, "[T, G, N]", (T, G, N))
    check_shape(_FN, "D", D, "[H]", (H,))
    check_shape(_FN, "dt_bias", dt_bias, "[H]", (H,))
    check_shape(_FN, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(_FN, "has_initial_state", has_initial_state, "[R]", (R,))
    if G == 0 or H % G != 0:
        raise ValueError(f"{_FN}: expected H ({H}) to be a multiple of G, got G = {G}")
    if chunk_size <= 0:
        raise ValueError(f"{_FN}: expected chunk_size > 0, got {chunk_size}")
    for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("dt_bias", dt_bias),
                    ("ssm_state", ssm_state)):  # fmt: skip
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{_FN}: {name} expected float32, float16 or bfloat16, got {t.dtype}")
    for name, t in (("query_start_loc", query_start_loc), ("state_slots", state_slots)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{_FN}: {name} expected an integer tensor, got {t.dtype}")
    if has_initial_state.dtype.is_floating_point or has_initial_state.dtype.is_complex:
        raise ValueError(
            f"{_FN}: has_initial_state expected a bool or integer tensor, got {has_initial_state.dtype}"
        )
    others = dict(dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, ssm_state=ssm_state,
                  query_start_loc=query_start_loc, state_slots=state_slots,
                  has_initial_state=has_initial_state)  # fmt: skip
    for name, t in others.items():
        if t.device != x.device:
            raise ValueError(f"{_FN}: {name} expected on {x.device}, got {t.device}")
    if chunk_meta is not None:
        built = (chunk_meta.num_tokens, chunk_meta.num_rows, chunk_meta.chunk_size)
        if built != (T, R, chunk_size):
            raise ValueError(
                f"{_FN}: chunk_meta expected (num_tokens, num_rows, chunk_size) = {(T, R, chunk_size)}, "
                f"got {built}"
            )
        if chunk_meta.row_chunk.device != x.device:
            raise ValueError(f"{_FN}: chunk_meta expected on {x.device}, got {chunk_meta.row_chunk.device}")


def _block_l(chunk_size: int) -> int:
    """A whole chunk's block of positions (the dt launch's and the state walk's)."""
    return max(_MIN_BLOCK, next_power_of_2(chunk_size))


def _pow2_block(requested: int | None, default: int, size: int, name: str) -> int:
    """A requested tile side (checked), else `default` capped at `size` rounded up to a power of two."""
    if requested is not None:
        if requested < _MIN_BLOCK or requested & (requested - 1):
            raise ValueError(f"{_FN}: {name} expected a power of two >= {_MIN_BLOCK}, got {requested}")
        return requested
    return max(_MIN_BLOCK, min(default, next_power_of_2(size)))


@dataclass(frozen=True)
class _Tiles:
    block_l: int  # a whole chunk (state kernel)
    block_p: int  # the output kernel's block of P
    state_block_p: int  # the state kernel's (its program count: H x P / state_block_p x N / block_n per row)
    state_warps: int
    state_stages: int
    block_n: int  # state kernel's block of N (the output kernel contracts over all of N)
    block_m: int
    block_k: int


@dataclass(frozen=True)
class StateLaunch:
    """The state kernel's block of P, warps and pipeline stages."""

    block_p: int
    warps: int
    stages: int


def _one_wave_shared_memory(block_l: int, block_p: int, block_n: int) -> int:
    """Bytes of shared memory the one-wave launch takes: its pipeline's stages of 16-bit x and B chunk tiles, and 8 KB
    for the rest (149.5 KB as compiled at the 8b-like size, where this gives 152)."""
    return STATE_ONE_WAVE_STAGES * block_l * (block_p + block_n) * 2 + 8192


def default_state_launch(rows: int, H: int, P: int, N: int, block_n: int, sms: int | None, block_l: int = 128,
                         shared_memory: int | None = None) -> StateLaunch:  # fmt: skip
    """The state kernel's launch by how many of its programs the GPU holds at once (a row's chunks are walked one
    after another, so a second wave doubles the walk):
    - its wide programs (STATE_BLOCK_P_WIDE) all fit, one per SM, and the device's `shared_memory` per program
      (bytes; None: unknown, taken to suffice) holds the pipeline of STATE_ONE_WAVE_STAGES chunk tiles of block_l
      positions (~150 KB at the 8b-like size; an H100 or H200 allows 227 KB): the wide block with
      STATE_ONE_WAVE_WARPS and STATE_ONE_WAVE_STAGES;
    - else its narrow programs (STATE_BLOCK_P) fit STATE_PROGRAMS_PER_SM to an SM: the narrow block;
    - else the wide block (half as many programs), both with STATE_WARPS and STATE_STAGES.
    sms None (no GPU): the narrow block."""
    narrow = StateLaunch(STATE_BLOCK_P, STATE_WARPS, STATE_STAGES)
    if sms is None:
        return narrow
    wide_p = max(STATE_BLOCK_P, STATE_BLOCK_P_WIDE)
    per_row_head = cdiv(N, block_n)
    fits = shared_memory is None or _one_wave_shared_memory(block_l, min(wide_p, next_power_of_2(P)),
                                                            block_n) <= shared_memory
    if fits and rows * H * cdiv(P, wide_p) * per_row_head <= sms:
        return StateLaunch(wide_p, STATE_ONE_WAVE_WARPS, STATE_ONE_WAVE_STAGES)
    if rows * H * cdiv(P, STATE_BLOCK_P) * per_row_head <= sms * STATE_PROGRAMS_PER_SM:
        return narrow
    return StateLaunch(wide_p, STATE_WARPS, STATE_STAGES)


def _tiles(fp32: bool, P: int, N: int, chunk_size: int, block_p, block_n, block_m, block_k,
           state_block_p=None, rows: int = 1, H: int = 1, sms: int | None = None,
           shared_memory: int | None = None) -> _Tiles:  # fmt: skip
    """Default tiles. 16-bit: 64/128/64/32 (block_p / block_n / block_m / block_k), the best of a sweep on a GPU at
    the 8b-like layer size. fp32 dots (IEEE) need smaller tiles. A state_block_p given runs with STATE_WARPS and
    STATE_STAGES.
    """
    out_block_p = _pow2_block(block_p, 32 if fp32 else 64, P, "block_p")
    state_block_n = _pow2_block(block_n, 32 if fp32 else 128, N, "block_n")
    # (sms: 16-bit dots on a GPU, where the rule was measured; the fp32 path keeps the narrow block.)
    if state_block_p is not None:
        state = StateLaunch(_pow2_block(state_block_p, STATE_BLOCK_P, P, "state_block_p"), STATE_WARPS, STATE_STAGES)
    else:
        state = default_state_launch(rows, H, P, N, state_block_n, None if fp32 else sms, _block_l(chunk_size),
                                     shared_memory)
        state = StateLaunch(_pow2_block(None, state.block_p, P, "state_block_p"), state.warps, state.stages)
    return _Tiles(
        block_l=_block_l(chunk_size),
        block_p=out_block_p,
        state_block_p=state.block_p,
        state_warps=state.warps,
        state_stages=state.stages,
        block_n=state_block_n,
        block_m=_pow2_block(block_m, 32 if fp32 else 64, chunk_size, "block_m"),
        block_k=_pow2_block(block_k, 32, chunk_size, "block_k"),
    )


def chunk_dt_cumsum_triton(dt: Tensor, A: Tensor, dt_bias: Tensor, dt_min: float, chunk_meta: ChunkMeta
                           ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Launch 0 on its own: the discretized dt (`discretize_dt`) and, per chunk of `chunk_meta`, the running sums of
    dt * A from the chunk's first token (inclusive), as fp32 [H, max(T, 1)] views of rows padded to 16 columns (column 0
    unwritten when T = 0).
    dt [T, H] raw; A, dt_bias [H]. Shapes are the caller's (mamba_chunk_scan_varlen_triton checks them)."""
    T, H = dt.shape
    # Rows padded to 16 columns: the head stride, an integer argument of three kernels, is then always divisible
    # by 16, one specialization whatever T (Triton compiles apart a value divisible by 16 or not).
    width = max(T, 1)
    padded = width + (-width) % 16
    dt_buf = torch.empty((H, padded), dtype=torch.float32, device=dt.device)[:, :width]
    cs_buf = torch.empty((H, padded), dtype=torch.float32, device=dt.device)[:, :width]
    if chunk_meta.num_chunks:
        _ssd_dt_kernel[(chunk_meta.num_chunks, cdiv(H, DT_BLOCK_H))](
            dt, A, dt_bias, chunk_meta.chunk_start, chunk_meta.chunk_len, dt_buf, cs_buf, H, float(dt_min),
            *dt.stride(), *dt_buf.stride(), BLOCK_L=_block_l(chunk_meta.chunk_size),
            BLOCK_H=DT_BLOCK_H, num_warps=DT_WARPS,
        )  # fmt: skip
    return dt_buf, cs_buf


def mamba_chunk_scan_varlen_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    query_start_loc: Tensor,
    ssm_state: Tensor,
    state_slots: Tensor,
    has_initial_state: Tensor,
    chunk_size: int,
    dt_min: float,
    chunk_meta: ChunkMeta | None = None,
    *,
    block_p: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    block_k: int | None = None,
    state_block_p: int | None = None,
    share_cb: bool = True,
    cb_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Triton `mamba_chunk_scan_varlen`: scan every prefill row; write each row's final state into its slot.

    x [T, H, P]; dt [T, H] raw (before dt_bias and softplus); A, D, dt_bias [H]; B, C [T, G, N];
    query_start_loc [R+1] integer, non-decreasing from 0 to T; ssm_state [S, H, P, N] pool, written only
    at the rows' slots; state_slots [R] integer, distinct and in [0, S) (unchecked); has_initial_state
    [R] bool (False: the row starts from zeros and its slot is never read). chunk_meta: from
    `build_chunk_meta(query_start_loc as host ints, chunk_size, device)`, and then the kernels read the
    rows from it alone (query_start_loc is only shape-checked); None builds it from
    `query_start_loc.tolist()` (a host sync). state_block_p / block_n tile the state kernel's [P, N] state
    (state_block_p defaults to `default_state_launch`'s, apart from block_p), block_m / block_k the output
    kernel's chunk positions; powers of two >= 16. share_cb: compute C·B^T once per (chunk, group) in a third
    launch, into a [chunks, G, chunk_size, chunk_size] buffer of cb_dtype (fp32: the products the per-head path
    computes, unrounded) that the output kernel reads; False: each head's output program recomputes it (the
    old path, kept for comparison). Returns y [T, H, P] in x.dtype.
    """
    _check_args(x, dt, A, B, C, D, dt_bias, query_start_loc, ssm_state, state_slots, has_initial_state,
                chunk_size, chunk_meta)  # fmt: skip
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = state_slots.shape[0]
    sms = sm_count(x.device) if x.is_cuda else None
    shared_memory = shared_memory_per_block(x.device) if x.is_cuda else None
    t = _tiles(x.dtype == torch.float32, P, N, chunk_size, block_p, block_n, block_m, block_k, state_block_p,
               rows=R, H=H, sms=sms, shared_memory=shared_memory)
    if cb_dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{_FN}: cb_dtype expected float32, float16 or bfloat16, got {cb_dtype}")
    if chunk_meta is None:
        bounds = query_start_loc.tolist()  # the documented sync
        _check_bounds(_FN, bounds, T)
        chunk_meta = build_chunk_meta(bounds, chunk_size, x.device)

    y = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    if R == 0:
        return y
    # 16-bit activations: 16-bit dot operands on the GPU. fp32 ones (and the interpreter): fp32 IEEE dots.
    native_dot = x.dtype != torch.float32 and not _interpreted()
    # Chunk-start states in the dtype phase 3's tl.dot takes them in: x's for 16-bit activations.
    # (At least one element each: no null data pointers reach the launcher.)
    states = torch.empty((max(chunk_meta.num_chunks, 1), H, P, N), dtype=x.dtype, device=x.device)
    dt_buf, cs_buf = chunk_dt_cumsum_triton(dt, A, dt_bias, dt_min, chunk_meta)
    # Only empty rows (T == 0): x and B are never read (nor dt: launch 0 has no chunks); stand-ins keep null pointers out.
    x_in, B_in = (x, B) if T else (dt_buf, dt_buf)

    meta = (chunk_meta.chunk_start, chunk_meta.chunk_len)
    _ssd_state_kernel[(R, H, cdiv(P, t.state_block_p) * cdiv(N, t.block_n))](
        x_in, B_in,
        ssm_state, state_slots, has_initial_state,
        *meta, chunk_meta.row_chunk,
        states, dt_buf, cs_buf,
        P, N, H // G, chunk_size,
        *x.stride(), *B.stride(), *ssm_state.stride(), *states.stride(), *dt_buf.stride(),
        NATIVE_DOT=native_dot, AFFINE=STATE_AFFINE, BLOCK_L=t.block_l,
        BLOCK_P=t.state_block_p, BLOCK_N=t.block_n, num_warps=t.state_warps, num_stages=t.state_stages,
    )  # fmt: skip
    if chunk_meta.num_chunks == 0:
        return y  # only empty rows: their slots are written, there is no output

    block_n_out = max(_MIN_BLOCK, next_power_of_2(N))  # C·B and C·S contract over the whole state
    m_blocks = cdiv(chunk_size, t.block_m)
    if share_cb:
        # Each chunk's [chunk_size, chunk_size] C·B^T, padded to whole tiles; only the tiles on and below the
        # diagonal are written (and read).
        side = cdiv(chunk_size, max(t.block_m, t.block_k)) * max(t.block_m, t.block_k)
        cb = torch.empty((chunk_meta.num_chunks, G, side, side), dtype=cb_dtype, device=x.device)
        _ssd_cb_kernel[(chunk_meta.num_chunks, G, m_blocks)](
            B, C, *meta, cb, states,
            N,
            *B.stride(), *C.stride(), *cb.stride(),
            NATIVE_DOT=native_dot, BLOCK_M=t.block_m, BLOCK_K=t.block_k, BLOCK_N=block_n_out,
            num_warps=CB_WARPS, num_stages=CB_STAGES,
        )  # fmt: skip
    else:
        cb = cs_buf  # never read (SHARE_CB=False); a stand-in with zero strides
    cb_strides = cb.stride() if share_cb else (0, 0, 0, 0)
    grid = (chunk_meta.num_chunks, m_blocks * cdiv(P, t.block_p), H)
    _ssd_output_kernel[grid](
        x, A, B, C, D,
        *meta,
        states, dt_buf, cs_buf, y, cb,
        P, N, H // G, FACTOR_RANGE,
        *x.stride(), *B.stride(), *C.stride(), *states.stride(), *dt_buf.stride(), *y.stride(), *cb_strides,
        NATIVE_DOT=native_dot, SHARE_CB=share_cb, BLOCK_M=t.block_m, BLOCK_K=t.block_k, BLOCK_P=t.block_p,
        BLOCK_N=block_n_out, num_warps=OUTPUT_WARPS, num_stages=OUTPUT_STAGES, maxnreg=OUTPUT_MAXNREG,
    )  # fmt: skip
    return y
