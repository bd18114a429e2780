"""Triton causal attention over a paged KV cache, for prefill chunks, verify rows and decode rows alike.

Same signature, semantics and return value as `paged_attention` (`reference.py`); see that for the
cache layout and the math. Query i of row r sits at absolute position ctx + i (ctx = seq_len - q_len) and
sees keys 0 .. ctx + i; query head h reads KV head h // (Hq // Hkv). Scores, softmax and the P @ V sum
accumulate in fp32; the output is in q.dtype.

One program per (query block, KV head) (and per split, below); decode tiles number KV heads fastest. A query
block is up to BLOCK_Q consecutive queries of one row; the program stacks them with the KV head's `group = Hq
// Hkv` query heads into one tile of BLOCK_M >= BLOCK_Q * group rows (row m = query m // group, head m %
group), so every key and value of the KV head is read once per query block, not once per query head. The
program then walks the row's keys 0 .. (its last query's position) in tiles of BLOCK_N tokens, each token's
block id read from `block_tables`, with an online (flash-attention) softmax: scores by `tl.dot` (in log2 units,
for exp2), running max and sum in fp32. Prefill blocks take the key tiles that all their queries see whole
(below the causal diagonal) without a mask, and the causal mask per row of the tile only on the last ones.
Decode steps (`max_query_len == 1`) use BLOCK_Q = 1, so a decode row is one program per KV head holding its
`group` query heads. Rows of a few queries (a verify step's 1+K: tiles of at most SHORT_BLOCK_M rows) run as
decode tiles do, with 4 warps and split-K.

The mapping from program to (row, query block) is computed on the device (a cumulative sum of the rows'
query-block counts and a searchsorted over it), from a grid whose size depends on shapes only
(min(T, cdiv(T, BLOCK_Q) + R) programs per KV head, an upper bound; spare programs do nothing). So the
wrapper never reads device tensors on the host, and is CUDA-graph friendly for fixed T and R. A caller that
holds the rows' query starts as host ints (the runner, once per step for every attention layer) passes
the same mapping built there instead (`build_attention_meta`, one host-to-device copy): that saves each
layer the nine small device ops of building it.

No host reads of device tensors means the metadata are the caller's contract, unchecked (the reference
checks them with host reads; run it when in doubt): `query_start_loc` non-decreasing from 0 to T;
`seq_lens[r] >= q_len[r]`; `block_tables[r, :cdiv(seq_len, block_size)]` valid block ids (an out-of-range
id is an out-of-bounds access on the GPU). Entries past a row's last block are never read.

`max_query_len` (optional, an upper bound on any row's query length known to the caller; else the one
`attention_meta` carries) only picks the tile sizes; the result does not depend on it. Without either, a batch
with T <= R is taken for decode and any other for prefill.

Few, long decode (or short) rows (B * Hkv programs would leave most SMs idle) split each row's keys into
num_splits parts (flash-decoding's split-K): grid (programs x Hkv, num_splits), each part's running max,
sum and unnormalized fp32 accumulator go to scratch, and a second kernel merges them. The split count
comes from shapes and the SM count only (see `_auto_splits`); `num_splits` overrides it.

An FP8 cache (float8_e4m3fn) takes `kv_scale` [2] fp32 (K, V) on the device. Its tiles load as FP8 and convert
to q's dtype (exact: every e4m3 value is a bf16, fp16 and fp32 value); the K scale is folded into the score scale
and the V scale multiplies the accumulator before it is normalized (or stored as a split's partial), so that the
result is the reference's attention over the dequantized cache.

Triton's interpreter (`TRITON_INTERPRET=1`, set before this module is imported) runs the kernel on CPU
tensors; there bf16 casts truncate instead of rounding (the output is rounded by hand), so compare bf16
with tolerances. For fp32 inputs both dots run in IEEE fp32 (no TF32). For bf16 and fp16 on the GPU,
Q @ K^T runs on the half inputs (exact products, fp32 accumulation) and P is rounded to the value dtype
before P @ V, as flash attention does; the interpreter's `tl.dot` mishandles bf16 (numpy has no bf16),
so there both dots run in fp32 on the upcast inputs instead (the GPU-only path is covered by the `gpu`
tests).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.attention.reference import FP8_KV_DTYPE, check_kv_scale
from baton.engine.ops.attention.tuning import (
    DECODE_STAGES,
    PREFILL_BLOCK_M,
    PREFILL_BLOCK_N,
    PREFILL_STAGES,
    PREFILL_WARPS,
    SHORT_BLOCK_M,
    SPLIT_PROGRAMS_PER_SM,
    WIDE_DECODE_ROWS,
)
from baton.engine.ops.checks import check_shape
from baton.engine.ops.triton_common import cdiv, next_power_of_2, pdl, pdl_wait, round_to, sm_count
from baton.engine.ops.triton_common import interpreted as _interpreted


@dataclass(frozen=True)
class AttentionMeta:
    """The program -> (row, query block) mapping of one step's batch, for every attention layer. Valid only
    with the `query_start_loc` tensor it was built for (the kernel checks that it is given that very tensor:
    a batch derived with other rows must not carry it along)."""

    query_start_loc: Tensor
    block_q: int
    grid_m: int
    prog_row: Tensor     # [grid_m] int32
    prog_qblock: Tensor  # [grid_m] int32
    max_query_len: int | None = None  # the batch's longest row (host-known): the kernel's tiles follow it


def build_attention_meta(query_start_loc_host: list[int], query_start_loc: Tensor, q_heads: int, kv_heads: int,
                         head_dim: int) -> AttentionMeta:
    """The mapping the kernel would build on the device for this batch, built from the host ints of
    `query_start_loc` and sent in one non-blocking copy, with the batch's longest row as `max_query_len` (the
    kernel's tiles: a verify step's rows of 1+K queries take short tiles). Spare programs map to the last row,
    past its queries."""
    from baton.engine.host_copy import to_device_parts

    T, R = query_start_loc_host[-1], len(query_start_loc_host) - 1
    max_q = max((b - a for a, b in zip(query_start_loc_host, query_start_loc_host[1:], strict=False)), default=0)
    max_q = max(max_q, 1)
    block_q = _launch_config(q_heads // kv_heads, head_dim, max_q, T, R)[0]
    grid_m = min(T, cdiv(T, block_q) + R)
    rows: list[int] = []
    qblocks: list[int] = []
    for r in range(R):
        n = cdiv(query_start_loc_host[r + 1] - query_start_loc_host[r], block_q)
        rows += [r] * n
        qblocks += range(n)
    last = qblocks[-1] + 1 if rows and rows[-1] == R - 1 else 0
    spare = grid_m - len(rows)
    rows += [R - 1] * spare
    qblocks += range(last, last + spare)
    # Two aligned parts of one copy: Triton specializes a pointer on its 16-byte alignment.
    prog_row, prog_qblock = to_device_parts([rows, qblocks], torch.int32, query_start_loc.device)
    return AttentionMeta(query_start_loc, block_q, grid_m, prog_row, prog_qblock, max_q)


@triton.jit
def _query_tile(
    pid, kvh, prog_row_ptr, prog_qblock_ptr, qsl_ptr, seq_lens_ptr, group, head_dim,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """The program's query tile: row, per tile row its token, query head and absolute position, the
    [BLOCK_M, BLOCK_D] validity mask, kv_end (keys 0 .. kv_end - 1 are visible to some tile row) and
    kv_all (keys 0 .. kv_all - 1 are visible to every tile row: up to the block's first query's position)."""
    row = tl.load(prog_row_ptr + pid).to(tl.int32)
    qblock = tl.load(prog_qblock_ptr + pid).to(tl.int32)
    q_start = tl.load(qsl_ptr + row).to(tl.int32)
    q_len = tl.load(qsl_ptr + row + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + row).to(tl.int32)
    ctx = seq_len - q_len
    i0 = qblock * BLOCK_Q
    # Keys 0 .. the block's last query position; none for a spare program (i0 >= q_len).
    kv_end = tl.where(i0 < q_len, tl.minimum(ctx + i0 + BLOCK_Q, seq_len), 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qi = offs_m // group  # query within the block
    i = i0 + qi  # query within the row
    m_valid = (qi < BLOCK_Q) & (i < q_len)
    md_mask = m_valid[:, None] & (offs_d < head_dim)[None, :]
    tok = (q_start + i).to(tl.int64)
    head = kvh * group + offs_m % group
    q_pos = ctx + i
    return row, tok, head, q_pos, md_mask, kv_end, tl.minimum(ctx + i0 + 1, kv_end)


@triton.jit
def _attend(
    q, acc, m_i, l_i, start, kv_hi, q_pos, bt_row, kv_ptr, kvh, block_size, qk_scale, d_mask,
    s_kv_kv, s_kv_tok, s_kv_h, s_kv_d, s_kv_blk, s_bt_b,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, NATIVE_DOT: tl.constexpr, FP8: tl.constexpr,
):  # fmt: skip
    """One key tile (keys start .. start + BLOCK_N - 1) into the online softmax; scores in log2 units
    (qk_scale = scale * log2(e)). MASKED=False: every key is below kv_hi and visible to every row (no mask)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if MASKED:  # noqa: SIM108 (a compile-time branch)
        n_mask = offs_n < kv_hi
    else:
        n_mask = tl.full([BLOCK_N], 1, tl.int1)
    block_id = tl.load(bt_row + (offs_n // block_size) * s_bt_b, mask=n_mask, other=0).to(tl.int64)
    kv_rows = kv_ptr + block_id * s_kv_blk + (offs_n % block_size) * s_kv_tok + kvh * s_kv_h  # [BLOCK_N]
    nd_mask = n_mask[:, None] & d_mask[None, :]
    kv_tile = kv_rows[:, None] + offs_d[None, :] * s_kv_d  # [BLOCK_N, BLOCK_D]
    k = tl.load(kv_tile, mask=nd_mask, other=0.0)
    v = tl.load(kv_tile + s_kv_kv, mask=nd_mask, other=0.0)
    if FP8:
        # Exact: the scales are applied outside (`qk_scale`, and the accumulator at the end).
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    s = s * qk_scale  # [BLOCK_M, BLOCK_N] fp32, log2 units
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet (or never will: padding) keeps -inf; shift it by 0, not -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if NATIVE_DOT:  # noqa: SIM108 (a compile-time branch: the other one is never built)
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, prog_row_ptr, prog_qblock_ptr,
    m_part_ptr, l_part_ptr, acc_part_ptr, kv_scale_ptr,
    scale, group, block_size, head_dim, kv_heads,
    s_q_t, s_q_h, s_q_d,
    s_kv_blk, s_kv_kv, s_kv_tok, s_kv_h, s_kv_d,
    s_o_t, s_o_h, s_o_d,
    s_bt_r, s_bt_b,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_wait(PDL)
    if BLOCK_Q == 1:
        # Decode tiles: KV heads vary fastest, so the programs of one row read the same KV blocks' interleaved
        # heads side by side, sharing those blocks' cache lines.
        pid = tl.program_id(0) // kv_heads
        kvh = tl.program_id(0) % kv_heads
    else:
        # Query blocks vary fastest: each KV head's longest (last, causal) blocks do not all come at the end.
        grid_m = tl.num_programs(0) // kv_heads
        pid = tl.program_id(0) % grid_m
        kvh = tl.program_id(0) // grid_m
    # The split count is the grid's second dimension, not a constexpr: one compile whatever the count.
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    row, tok, head, q_pos, md_mask, kv_end, kv_all = _query_tile(
        pid,
        kvh,
        prog_row_ptr,
        prog_qblock_ptr,
        qsl_ptr,
        seq_lens_ptr,
        group,
        head_dim,
        BLOCK_Q,
        BLOCK_M,
        BLOCK_D,
    )
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q_rows = q_ptr + tok * s_q_t + head * s_q_h  # [BLOCK_M]
    q = tl.load(q_rows[:, None] + offs_d[None, :] * s_q_d, mask=md_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

    # This split's share of the keys: whole BLOCK_N tiles, the last split may get fewer (or none).
    chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    bt_row = bt_ptr + row.to(tl.int64) * s_bt_r
    qk_scale = scale * 1.4426950408889634  # log2(e): exp(x) = exp2(x * log2(e))
    if FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    masked_lo = kv_lo
    if BLOCK_Q > 1:
        # Prefill tiles: the key tiles every row of the block sees whole (below the causal diagonal, within
        # the row) run without the mask; only the last one or two tiles near the diagonal take it.
        masked_lo = tl.maximum(kv_lo, kv_lo + (tl.minimum(kv_all, kv_hi) - kv_lo) // BLOCK_N * BLOCK_N)
        for start in range(kv_lo, masked_lo, BLOCK_N):
            acc, m_i, l_i = _attend(
                q, acc, m_i, l_i, start, kv_hi, q_pos, bt_row, kv_ptr, kvh, block_size, qk_scale, d_mask,
                s_kv_kv, s_kv_tok, s_kv_h, s_kv_d, s_kv_blk, s_bt_b, BLOCK_N, BLOCK_D, False, NATIVE_DOT, FP8,
            )  # fmt: skip
    for start in range(masked_lo, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend(
            q, acc, m_i, l_i, start, kv_hi, q_pos, bt_row, kv_ptr, kvh, block_size, qk_scale, d_mask,
            s_kv_kv, s_kv_tok, s_kv_h, s_kv_d, s_kv_blk, s_bt_b, BLOCK_N, BLOCK_D, True, NATIVE_DOT, FP8,
        )  # fmt: skip

    if FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_tile = (out_ptr + tok * s_o_t + head * s_o_h)[:, None] + offs_d[None, :] * s_o_d
        tl.store(o_tile, round_to(out, out_ptr.dtype.element_ty), mask=md_mask)
    else:
        # Partial results, unnormalized, into [programs, Hkv, num_splits, BLOCK_M(, BLOCK_D)] fp32 scratch.
        offs_m = tl.arange(0, BLOCK_M)
        part = ((pid.to(tl.int64) * kv_heads + kvh) * num_splits + split) * BLOCK_M + offs_m
        tl.store(m_part_ptr + part, m_i)
        tl.store(l_part_ptr + part, l_i)
        tl.store(acc_part_ptr + part[:, None] * BLOCK_D + offs_d[None, :], acc)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    out_ptr, qsl_ptr, seq_lens_ptr, prog_row_ptr, prog_qblock_ptr,
    m_part_ptr, l_part_ptr, acc_part_ptr,
    group, head_dim, num_splits,
    s_o_t, s_o_h, s_o_d,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Merge one program's `num_splits` partial softmax results (flash-decoding's second pass); the count is a
    runtime value, unspecialized: one compile whatever it is."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    row, tok, head, q_pos, md_mask, kv_end, _ = _query_tile(
        pid,
        kvh,
        prog_row_ptr,
        prog_qblock_ptr,
        qsl_ptr,
        seq_lens_ptr,
        group,
        head_dim,
        BLOCK_Q,
        BLOCK_M,
        BLOCK_D,
    )
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    base = (pid.to(tl.int64) * tl.num_programs(1) + kvh) * num_splits
    for split in range(num_splits):
        part = (base + split) * BLOCK_M + offs_m
        m_s = tl.load(m_part_ptr + part)
        l_s = tl.load(l_part_ptr + part)
        acc_s = tl.load(acc_part_ptr + part[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)  # the parts' maxima are in log2 units (_attend)
        beta = tl.exp2(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_tile = (out_ptr + tok * s_o_t + head * s_o_h)[:, None] + offs_d[None, :] * s_o_d
    tl.store(o_tile, round_to(out, out_ptr.dtype.element_ty), mask=md_mask)


def _launch_config(group: int, head_dim: int, max_query_len: int | None, T: int, R: int) -> tuple[int, int, int, int, int]:  # fmt: skip
    """(BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, num_warps).

    Decode batches (max_query_len 1, or unknown with T <= R) take one query per block, so a program is one
    decode row's KV head, and from WIDE_DECODE_ROWS rows on key tiles of 128; otherwise about PREFILL_BLOCK_M query
    rows (queries x group heads) per program, fewer when max_query_len says the rows are short: the smallest
    power-of-two tile that holds max_query_len queries, filled. `tl.dot` needs every tile side >= 16.
    """
    decode = max_query_len == 1 or (max_query_len is None and T <= R)
    if decode:
        block_q, block_m = 1, max(16, next_power_of_2(group))
    else:
        cap = max(1, PREFILL_BLOCK_M // group)
        block_q = cap if max_query_len is None else max(1, min(cap, max_query_len))
        block_m = max(16, next_power_of_2(block_q * group))
        # BLOCK_Q is a constexpr: as many queries as the tile holds, so that it takes one value per tile size
        # (a handful) instead of one per distinct short max_query_len, each a compile inside some step.
        block_q = min(cap, block_m // group)
    short = not decode and block_m <= SHORT_BLOCK_M
    block_d = max(16, next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    if decode and R >= WIDE_DECODE_ROWS and block_d <= 128:
        block_n = 128
    if not decode and not short and block_d <= 128:
        block_n = PREFILL_BLOCK_N
    return block_q, block_m, block_n, block_d, 4 if decode or short else PREFILL_WARPS


def _decode_like(block_q: int, block_m: int) -> bool:
    """Decode tiles (one query) and short ones (at most SHORT_BLOCK_M rows): DECODE_STAGES, split-K allowed."""
    return block_q == 1 or block_m <= SHORT_BLOCK_M


def _auto_splits(device: torch.device, programs: int, block_q: int, block_m: int, max_keys: int,
                 block_n: int) -> int:
    """Split-K only for decode and short tiles (`_decode_like`) too few to fill the GPU: about
    SPLIT_PROGRAMS_PER_SM programs per SM, each split at least 8 key tiles of the longest possible row (max_blocks *
    block_size keys), at most 32."""
    if device.type != "cuda" or not _decode_like(block_q, block_m):
        return 1
    target = SPLIT_PROGRAMS_PER_SM * sm_count(device)
    return max(1, min(cdiv(target, programs), cdiv(max_keys, 8 * block_n), 32))


def paged_attention_triton(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    max_query_len: int | None = None,
    num_splits: int | None = None,
    attention_meta: AttentionMeta | None = None,
    kv_scale: Tensor | None = None,
) -> Tensor:
    """Causal attention of every row's queries over its sequence's cached keys and values (`paged_attention`).

    q [T, Hq, D]; kv_cache [num_blocks, 2, block_size, Hkv, D], already holding this step's K/V;
    query_start_loc [R+1]; seq_lens [R] tokens of the sequence including this step's; block_tables
    [R, max_blocks] int, entries past a row's last block are never read; max_query_len an optional upper
    bound on the rows' query lengths (tiling only); num_splits how many parts each row's keys are split
    into (None: chosen from the shapes and the GPU's SM count; 1 on the CPU); attention_meta the batch's
    program mapping from `build_attention_meta` (None: built here, on the device); kv_scale [2] fp32 (K, V) for a
    float8_e4m3fn cache, else None. Metadata values are unchecked (module docstring).
    Returns [T, Hq, D] in q.dtype.
    """
    fn = "paged_attention_triton"
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{fn}: kv_cache expected shape [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or block_tables.dim() != 2:
        raise ValueError(
            f"{fn}: expected q [T, Hq, D], block_tables [R, max_blocks], got q {tuple(q.shape)}, "
            f"block_tables {tuple(block_tables.shape)}"
        )
    T, q_heads = q.shape[0], q.shape[1]
    R = block_tables.shape[0]
    check_shape(fn, "q", q, "[T, Hq, D]", (T, q_heads, head_dim))
    check_shape(fn, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(fn, "seq_lens", seq_lens, "[R]", (R,))
    if q_heads % kv_heads != 0:
        raise ValueError(f"{fn}: expected Hq a multiple of Hkv = {kv_heads}, got Hq = {q_heads}")
    if max_query_len is not None and max_query_len < 1:
        raise ValueError(f"{fn}: max_query_len expected >= 1 or None, got {max_query_len}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"{fn}: num_splits expected >= 1 or None, got {num_splits}")
    if kv_cache.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"{fn}: expected kv_cache in q's dtype {q.dtype} or float8_e4m3fn, got {kv_cache.dtype}")
    check_kv_scale(fn, kv_cache, kv_scale)

    out = torch.empty(T, q_heads, head_dim, dtype=q.dtype, device=q.device)
    if T == 0 or R == 0:
        return out
    group = q_heads // kv_heads
    if max_query_len is None and attention_meta is not None:
        max_query_len = attention_meta.max_query_len
    block_q, block_m, block_n, block_d, num_warps = _launch_config(group, head_dim, max_query_len, T, R)

    # Program -> (row, query block) on the device. Each query block holds >= 1 query, so there are at most
    # T blocks, and sum(cdiv(q_len, BLOCK_Q)) <= cdiv(T, BLOCK_Q) + R: a grid sized from shapes alone.
    grid_m = min(T, cdiv(T, block_q) + R)
    qsl = query_start_loc.to(device=q.device, dtype=torch.int64)
    if attention_meta is not None:
        if attention_meta.query_start_loc is not query_start_loc:
            raise ValueError(f"{fn}: attention_meta expected to be built for this query_start_loc, got one built "
                             f"for another batch")
        if (attention_meta.block_q, attention_meta.grid_m) != (block_q, grid_m):
            raise ValueError(f"{fn}: attention_meta expected for BLOCK_Q {block_q} and {grid_m} programs, got "
                             f"{attention_meta.block_q} and {attention_meta.grid_m}")
        prog_row, prog_qblock = attention_meta.prog_row, attention_meta.prog_qblock
    else:
        q_lens = qsl[1:] - qsl[:-1]
        blocks_per_row = (q_lens + block_q - 1) // block_q  # [R]
        cum = torch.cumsum(blocks_per_row, 0)  # [R] inclusive
        pids = torch.arange(grid_m, device=q.device, dtype=torch.int64)
        prog_row = torch.searchsorted(cum, pids, right=True).clamp_(max=R - 1)  # spare programs -> last row
        # A spare program's query block lies past its (last) row's queries, so it reads and writes nothing.
        prog_qblock = pids - (cum - blocks_per_row)[prog_row]
        prog_row = prog_row.to(torch.int32)
        prog_qblock = prog_qblock.to(torch.int32)

    if num_splits is None:
        num_splits = _auto_splits(
            q.device, grid_m * kv_heads, block_q, block_m, block_tables.shape[1] * block_size, block_n
        )
    if num_splits > 1:
        m_part = torch.empty(grid_m, kv_heads, num_splits, block_m, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(*m_part.shape, block_d, dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # never touched
    _paged_attention_kernel[(grid_m * kv_heads, num_splits)](
        q, kv_cache, out, qsl, seq_lens, block_tables, prog_row, prog_qblock, m_part, l_part, acc_part,
        out if kv_scale is None else kv_scale, float(scale), group, block_size, head_dim, kv_heads,
        *q.stride(), *kv_cache.stride(), *out.stride(), *block_tables.stride(),
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=num_splits > 1,
        NATIVE_DOT=q.dtype != torch.float32 and not _interpreted(), FP8=kv_scale is not None, num_warps=num_warps,
        num_stages=DECODE_STAGES if _decode_like(block_q, block_m) else PREFILL_STAGES, **pdl(q),
    )  # fmt: skip
    if num_splits > 1:
        _combine_splits_kernel[(grid_m, kv_heads)](
            out, qsl, seq_lens, prog_row, prog_qblock, m_part, l_part, acc_part,
            group, head_dim, num_splits, *out.stride(),
            BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps,
            **pdl(q),
        )  # fmt: skip
    return out
