"""Triton paged attention kernel against its torch reference (`paged_attention`).

Without CUDA the kernel runs in Triton's interpreter on CPU tensors: TRITON_INTERPRET must be set before
`baton.engine.ops.attention.kernel` is imported (its `@triton.jit` reads it at decoration time), so it is
set at the very top of this module. The `gpu` tests run the compiled kernel at the full model size
(Hq=32, Hkv=8, D=128, block 16), and `bench_attention` times it (a benchmark script may call it).
"""

import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.attention.kernel import (  # noqa: E402
    PREFILL_BLOCK_M,
    PREFILL_WARPS,
    SHORT_BLOCK_M,
    WIDE_DECODE_ROWS,
    _launch_config,
    build_attention_meta,
    paged_attention_triton,
)
from baton.engine.ops.attention.reference import paged_attention, write_kv  # noqa: E402
from tests.cuda_timing import time_call_ms  # noqa: E402

# (context tokens already cached, query tokens this step) per row: a whole-sequence prefill, a decode step
# with a long context, a prefill chunk after a prefix, a one-token prompt, a decode step right after a
# block boundary, verify-like rows (2..5 queries after a prefix), an empty row (no queries this step), a
# chunk ending exactly on a block boundary.
MIXED_ROWS = [(0, 9), (50, 1), (6, 5), (0, 1), (8, 1), (20, 2), (7, 0), (13, 3), (31, 4), (3, 5), (0, 16)]
DECODE_ROWS = [(0, 1), (3, 1), (40, 1), (7, 1), (16, 1)]
# With rows long enough for several 64-key tiles, so that more than one split holds keys.
SPLIT_MIXED_ROWS = [(300, 1), *MIXED_ROWS, (150, 4), (0, 140)]
SPLIT_DECODE_ROWS = [(400, 1), *DECODE_ROWS, (130, 1)]

# (Hq, Hkv, D, block_size): GQA groups of 2 and 3 (not a power of two) and plain multi-head attention.
CONFIGS = [
    pytest.param(4, 2, 16, 4, id="gqa2-d16-b4"),
    pytest.param(4, 4, 32, 8, id="mha-d32-b8"),
    pytest.param(6, 2, 16, 8, id="gqa3-d16-b8"),
]

# The kernel rounds P to bf16/fp16 before P @ V (the reference keeps it in fp32), and in the interpreter
# that cast truncates: a bf16 output may land an ulp or two apart.
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
    pytest.param(torch.float16, 3e-3, 3e-3, id="fp16"),
]


def make_case(rows, hq, hkv, d, block_size, dtype, seed=0, device="cpu", num_blocks=None):
    """A NaN-filled cache holding every row's tokens on scattered blocks, plus queries and metadata.

    Returns (q, kv_cache, query_start_loc, seq_lens, block_tables) on `device`.
    """
    g = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + n) // block_size) for ctx, n in rows]
    num_blocks = num_blocks or sum(need) + 7
    # Blocks handed out in a shuffled order, so no row's blocks are contiguous or ascending.
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(need) + 2
    # Padding past a row's blocks alternates between -1 and an out-of-range id: neither may be read.
    block_tables = torch.tensor([[-1 if r % 2 else 10**6] * max_blocks for r in range(len(rows))])
    for r, nb in enumerate(need):
        for i in range(nb):
            block_tables[r, i] = free.pop()
    # NaN everywhere no token was written: reading any stray block or slot poisons the output.
    kv_cache = torch.full((num_blocks, 2, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    slots = []
    for r, (ctx, n) in enumerate(rows):
        pos = torch.arange(ctx + n)
        slots.append(block_tables[r, pos // block_size] * block_size + pos % block_size)
    slots = torch.cat(slots)
    S = slots.numel()
    # Values drawn where they live: the full-size cases hold gigabytes of keys.
    gd = torch.Generator(device=device).manual_seed(seed)
    k = torch.randn(S, hkv, d, generator=gd, device=device).to(dtype)
    v = torch.randn(S, hkv, d, generator=gd, device=device).to(dtype)
    write_kv(k, v, kv_cache, slots.to(device))

    T = sum(n for _, n in rows)
    q = torch.randn(T, hq, d, generator=gd, device=device).to(dtype)
    lens = torch.tensor([n for _, n in rows])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(
        device=device, dtype=torch.int32
    )
    seq_lens = torch.tensor([ctx + n for ctx, n in rows], dtype=torch.int32, device=device)
    return q, kv_cache, query_start_loc, seq_lens, block_tables.to(device=device, dtype=torch.int32)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", CONFIGS)
def test_mixed_batch_matches_reference(hq, hkv, d, block_size, dtype, atol, rtol):
    q, kv_cache, qsl, seq_lens, block_tables = make_case(MIXED_ROWS, hq, hkv, d, block_size, dtype)
    scale = d**-0.5
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, scale)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS, [(5, 3), (0, 0)], [(0, 40)], [(4, 2)] * 3],
                         ids=["mixed", "decode", "empty-last", "one-row", "verify-like"])
@pytest.mark.parametrize("hq,hkv,d,block_size", CONFIGS)
def test_host_built_program_map_equals_the_device_built_one(rows, hq, hkv, d, block_size):
    # The runner builds the mapping once per step from host ints; every layer's kernel then uses it. The
    # same mapping gives the same programs, so the output is bit for bit the device-built path's.
    q, kv_cache, qsl, seq_lens, block_tables = make_case(rows, hq, hkv, d, block_size, torch.float32, seed=3)
    host_qsl = qsl.tolist()
    meta = build_attention_meta(host_qsl, qsl, hq, hkv, d)
    assert meta.prog_row.dtype == meta.prog_qblock.dtype == torch.int32 and meta.prog_row.numel() == meta.grid_m
    assert meta.max_query_len == max(max(n for _, n in rows), 1)
    # The device-built path with the same bound on the rows' lengths tiles the batch the same way.
    ref = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, d**-0.5, max_query_len=meta.max_query_len)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, d**-0.5, attention_meta=meta)
    assert torch.equal(out, ref)
    # Given with another query_start_loc (a batch derived with other rows), or built for another batch
    # shape, it is refused rather than silently misread.
    with pytest.raises(ValueError, match="attention_meta expected to be built for this query_start_loc"):
        paged_attention_triton(q, kv_cache, qsl.clone(), seq_lens, block_tables, d**-0.5, attention_meta=meta)
    one = torch.tensor([0, 1], dtype=qsl.dtype)
    other = build_attention_meta([0, 1], one, hq, hkv, d)
    with pytest.raises(ValueError, match="attention_meta expected for BLOCK_Q"):
        paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, d**-0.5,
                               attention_meta=dataclasses.replace(other, query_start_loc=qsl))


# Verify steps: rows of 1+K queries after long contexts (K = 1..4), several 64-key tiles each.
VERIFY_ROWS = [(130, 2), (200, 5), (67, 3), (300, 4), (5, 2)]


def test_verify_rows_take_short_decode_like_tiles():
    """A batch whose rows hold a few queries each (a verify step) runs tiles of at most SHORT_BLOCK_M rows with
    4 warps, as decode does, instead of the prefill tile of PREFILL_BLOCK_M rows and its 8 warps; and the
    runner's host-built map carries the bound that picks them."""
    group, d = 4, 128
    for k in (1, 2, 4, 7):
        t = 1 + k
        block_q, block_m, block_n, _, warps = _launch_config(group, d, t, 8 * t, 8)
        block_m_want = max(16, 1 << (t * group - 1).bit_length())
        # The tile holds block_m // group queries, at least t (fewer launch variants than one per t).
        assert (block_q, block_m, block_n, warps) == (block_m_want // group, block_m_want, 64, 4)
        assert block_q >= t and block_m <= SHORT_BLOCK_M
        host = list(range(0, 8 * t + 1, t))
        meta = build_attention_meta(host, torch.tensor(host), 32, 8, d)
        assert (meta.max_query_len, meta.block_q) == (t, block_q)
    # Nine queries of a group of 4 no longer fit a short tile: the prefill tile and warps.
    assert _launch_config(group, d, 9, 72, 8)[1] > SHORT_BLOCK_M
    assert _launch_config(group, d, 9, 72, 8)[4] == PREFILL_WARPS
    # Without a bound the batch is taken for a prefill one (the device-built path of an unknown batch).
    assert _launch_config(group, d, None, 16, 8)[0] == PREFILL_BLOCK_M // group


@pytest.mark.parametrize("group", [1, 2, 3, 4, 6, 8, 16])
def test_short_rows_take_few_block_q_values(group):
    """BLOCK_Q, a constexpr, takes one value per tile size (a compile each on a GPU), not one per distinct
    longest row: every batch of rows up to PREFILL_BLOCK_M queries long meets at most 5 of them (tiles of 16 to
    256 rows); each tile holds the longest row's queries."""
    seen = set()
    for longest in range(2, PREFILL_BLOCK_M + 1):
        block_q, block_m, *_ = _launch_config(group, 64, longest, 4 * longest, 4)
        assert min(longest, PREFILL_BLOCK_M // group) <= block_q and block_q * group <= block_m
        seen.add(block_q)
    assert len(seen) <= 5, sorted(seen)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_rows_in_short_split_tiles_match_reference(num_splits, dtype, atol, rtol):
    """Short tiles of 2..5 queries per row, their keys split into parts (as on a GPU, where few programs
    split), equal the reference; the tiles follow the host-built map's bound."""
    hq, hkv, d, block_size = 8, 2, 16, 4
    q, kv_cache, qsl, seq_lens, block_tables = make_case(VERIFY_ROWS, hq, hkv, d, block_size, dtype, seed=7)
    meta = build_attention_meta(qsl.tolist(), qsl, hq, hkv, d)
    assert meta.max_query_len == 5 and meta.block_q == 8  # a tile of 32 rows: 8 queries of 4 heads
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.25)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 0.25, attention_meta=meta,
                                 num_splits=num_splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_m,block_n", [(None, None), (32, 16)], ids=["default", "small-tiles"])
def test_prefill_tiles_below_the_diagonal_match_reference(block_m, block_n, monkeypatch):
    """Prefill key tiles that every query of the block sees whole run without the causal mask: long rows with and
    without prefixes put whole tiles below the diagonal (at small tiles many per program), one row ends a tile
    exactly on its first query, and the last tiles near the diagonal stay masked."""
    from baton.engine.ops.attention import kernel as ta
    if block_m is not None:
        monkeypatch.setattr(ta, "PREFILL_BLOCK_M", block_m)
        monkeypatch.setattr(ta, "PREFILL_BLOCK_N", block_n)
    rows = [(130, 70), (0, 200), (64, 64), (1, 127), (47, 1)]
    for dtype, atol, rtol in (param.values for param in DTYPES):
        q, kv_cache, qsl, seq_lens, block_tables = make_case(rows, 4, 2, 16, 16, dtype, seed=8)
        ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.25)
        out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 0.25, max_query_len=200)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("max_query_len", [None, 1, 3, 16])
def test_tiling_does_not_change_the_result(max_query_len):
    """max_query_len only picks the query block; any value (even one below the truth) gives the same output."""
    q, kv_cache, qsl, seq_lens, block_tables = make_case(MIXED_ROWS, 4, 2, 16, 4, torch.float32, seed=1)
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.3)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 0.3, max_query_len=max_query_len)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("max_query_len", [None, 1])
def test_decode_batch_matches_reference(max_query_len, dtype, atol, rtol):
    q, kv_cache, qsl, seq_lens, block_tables = make_case(DECODE_ROWS, 4, 2, 32, 8, dtype, seed=2)
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.2)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 0.2, max_query_len=max_query_len)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", [DTYPES[0], DTYPES[1]])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_wide_decode_tiles_match_reference(num_splits, dtype, atol, rtol):
    """From WIDE_DECODE_ROWS decode rows on, keys go in tiles of 128 (8 blocks of 16 here, some rows ending
    mid-tile, one on a tile boundary, one longer than two tiles); fewer rows keep 64 and prefill tiles are
    unchanged."""
    ctx = [(7 * r) % 300 for r in range(WIDE_DECODE_ROWS)]
    ctx[:3] = [0, 127, 300]
    rows = [(c, 1) for c in ctx]
    assert _launch_config(2, 16, 1, len(rows), len(rows))[2] == 128
    assert _launch_config(2, 16, 1, len(rows) - 1, len(rows) - 1)[2] == 64
    assert _launch_config(2, 16, None, 4 * len(rows), len(rows))[2] == 64
    q, kv_cache, qsl, seq_lens, block_tables = make_case(rows, 4, 2, 16, 16, dtype, seed=6)
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.25)
    out = paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 0.25, max_query_len=1,
                                 num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize(
    "rows,max_query_len", [(SPLIT_MIXED_ROWS, None), (SPLIT_DECODE_ROWS, 1)], ids=["mixed", "decode"]
)
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_matches_reference(num_splits, rows, max_query_len, dtype, atol, rtol):
    """Keys split into parts merged by the second kernel. Splits are whole 64-key tiles: the long rows fill
    several, the short ones leave some empty."""
    q, kv_cache, qsl, seq_lens, block_tables = make_case(rows, 4, 2, 16, 4, dtype, seed=4)
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.25)
    out = paged_attention_triton(
        q, kv_cache, qsl, seq_lens, block_tables, 0.25, max_query_len=max_query_len, num_splits=num_splits
    )
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def test_prefill_chunks_equal_whole_prefill():
    """Attending chunk by chunk over the cached prefix equals attending to the whole prompt at once."""
    total = 37
    q, kv_cache, _, _, block_tables = make_case([(0, total)], 4, 2, 16, 4, torch.float32, seed=3)

    def run(lo, hi):
        return paged_attention_triton(
            q[lo:hi], kv_cache, torch.tensor([0, hi - lo]), torch.tensor([hi]), block_tables, 0.25
        )

    whole = run(0, total)
    chunks = torch.cat([run(lo, hi) for lo, hi in [(0, 7), (7, 8), (8, 30), (30, total)]])
    torch.testing.assert_close(chunks, whole, atol=1e-6, rtol=1e-6)


def test_empty_batch_and_non_contiguous_q():
    q, kv_cache, qsl, seq_lens, block_tables = make_case(DECODE_ROWS, 4, 2, 16, 4, torch.float32)
    out = paged_attention_triton(q[:0], kv_cache, qsl[:1], seq_lens[:0], block_tables[:0], 0.25)
    assert out.shape == (0, 4, 16)
    # q as a strided view (heads sliced out of a wider projection).
    wide = torch.cat([q, torch.full_like(q, float("nan"))], dim=1)[:, :4]
    assert not wide.is_contiguous()
    ref = paged_attention(q, kv_cache, qsl, seq_lens, block_tables, 0.25)
    torch.testing.assert_close(paged_attention_triton(wide, kv_cache, qsl, seq_lens, block_tables, 0.25), ref)


def test_shape_errors():
    q, kv_cache, qsl, seq_lens, block_tables = make_case(DECODE_ROWS, 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="kv_cache expected shape"):
        paged_attention_triton(q, kv_cache[:, :1], qsl, seq_lens, block_tables, 1.0)
    with pytest.raises(ValueError, match=r"expected Hq a multiple of Hkv"):
        paged_attention_triton(q[:, :3], kv_cache, qsl, seq_lens, block_tables, 1.0)
    with pytest.raises(ValueError, match=r"query_start_loc expected shape \[R\+1\]"):
        paged_attention_triton(q, kv_cache, qsl[:-1], seq_lens, block_tables, 1.0)
    with pytest.raises(ValueError, match=r"q expected shape \[T, Hq, D\]"):
        paged_attention_triton(q[..., :8], kv_cache, qsl, seq_lens, block_tables, 1.0)
    with pytest.raises(ValueError, match="kv_cache in q's dtype"):
        paged_attention_triton(q, kv_cache.double(), qsl, seq_lens, block_tables, 1.0)
    with pytest.raises(ValueError, match="max_query_len expected"):
        paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 1.0, max_query_len=0)
    with pytest.raises(ValueError, match="num_splits expected"):
        paged_attention_triton(q, kv_cache, qsl, seq_lens, block_tables, 1.0, num_splits=0)


# --- full model size on CUDA -------------------------------------------------------------------------------

FULL = dict(hq=32, hkv=8, d=128, block_size=16)
GPU_DTYPES = [
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
    pytest.param(torch.float16, 3e-3, 3e-3, id="fp16"),
    pytest.param(torch.float32, 1e-4, 1e-4, id="fp32"),
]


def _decode_rows(batch: int, max_ctx: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (batch,), generator=g).tolist()
    ctx[0] = max_ctx - 1  # always one row at the longest context
    return [(c, 1) for c in ctx]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
@pytest.mark.parametrize("batch,max_ctx", [(1, 16384), (32, 16384), (256, 16384)])
def test_gpu_decode_full_size(batch, max_ctx, dtype, atol, rtol):
    rows = _decode_rows(batch, max_ctx, seed=batch)
    case = make_case(
        rows, FULL["hq"], FULL["hkv"], FULL["d"], FULL["block_size"], dtype, seed=batch, device="cuda"
    )
    ref = paged_attention(*case, 128**-0.5)
    for num_splits in (None, 1, 7):
        out = paged_attention_triton(*case, 128**-0.5, max_query_len=1, num_splits=num_splits)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol,rtol", GPU_DTYPES)
def test_gpu_mixed_full_size(dtype, atol, rtol):
    """Prefill chunks with and without a prefix, verify rows and decode rows in one batch."""
    rows = [(0, 512), (3000, 512), (16383, 1), (100, 4), (8191, 5), (0, 1), (777, 300)] + [(2048, 1)] * 16
    case = make_case(
        rows, FULL["hq"], FULL["hkv"], FULL["d"], FULL["block_size"], dtype, seed=5, device="cuda"
    )
    ref = paged_attention(*case, 128**-0.5)
    for max_query_len in (None, 512):
        out = paged_attention_triton(*case, 128**-0.5, max_query_len=max_query_len)
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def bench_attention(batch: int, ctx: int, q_len: int = 1, dtype: torch.dtype = torch.bfloat16,
                    num_splits: int | None = None, warmup: int = 10, iters: int = 100) -> tuple[float, float]:  # fmt: skip
    """Time one launch of the Triton kernel at the full model size (Hq=32, Hkv=8, D=128, block 16) on CUDA:
    `batch` rows of `q_len` queries (1: decode) each at context `ctx` (ctx + q_len keys per row), on
    shuffled blocks of a random cache.

    Returns (ms per call, GB/s of the KV bytes the rows must read: batch * (ctx + q_len) * 2 * Hkv * D *
    itemsize) from CUDA events.
    """
    hq, hkv, d, bs = FULL["hq"], FULL["hkv"], FULL["d"], FULL["block_size"]
    seq_len = ctx + q_len
    blocks_per_row = -(-seq_len // bs)
    num_blocks = batch * blocks_per_row
    kv_cache = torch.randn(num_blocks, 2, bs, hkv, d, device="cuda", dtype=dtype)
    block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, blocks_per_row)
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
    query_start_loc = torch.arange(batch + 1, device="cuda", dtype=torch.int32) * q_len
    seq_lens = torch.full((batch,), seq_len, device="cuda", dtype=torch.int32)

    def run():
        return paged_attention_triton(
            q,
            kv_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            d**-0.5,
            max_query_len=q_len,
            num_splits=num_splits,
        )

    ms = time_call_ms(run, warmup=warmup, iters=iters)
    kv_bytes = batch * seq_len * 2 * hkv * d * kv_cache.element_size()
    return ms, kv_bytes / (ms * 1e-3) / 1e9


@pytest.mark.gpu
def test_gpu_bench_attention_runs():
    ms, gbps = bench_attention(8, 1024, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
    ms, gbps = bench_attention(2, 512, q_len=64, num_splits=1, warmup=1, iters=3)
    assert ms > 0 and gbps > 0
