"""Paged attention and write_kv against dense causal attention on the gathered sequences."""

import pytest
import torch

from baton.engine.ops.attention.reference import paged_attention, write_kv

NUM_BLOCKS, BLOCK_SIZE = 64, 4
HQ, HKV, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM**-0.5
# (context tokens already cached, query tokens this step) per row: a whole-sequence prefill, a decode
# step with a long context, a prefill chunk after a prefix, a one-token prompt, a decode step right
# after a block boundary, a chunk ending exactly on one.
ROWS = [(0, 9), (50, 1), (6, 5), (0, 1), (8, 1), (3, 5)]

DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-5, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 1e-2, id="bf16"),
    pytest.param(torch.float16, 2e-3, 2e-3, id="fp16"),
]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def make_batch(dtype, seed=0):
    """Random sequences on scattered blocks; returns per-row K/V, queries and the block tables."""
    g = torch.Generator().manual_seed(seed)
    # Blocks handed out in a shuffled order, so no row's blocks are contiguous or ascending.
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = max(blocks_for(ctx + n) for ctx, n in ROWS) + 2
    # Padding past a row's blocks alternates between -1 and an out-of-range id: neither may be read.
    block_tables = torch.tensor([[-1 if r % 2 else 10**6] * max_blocks for r in range(len(ROWS))])
    keys, values, queries = [], [], []
    for r, (ctx, n) in enumerate(ROWS):
        for i in range(blocks_for(ctx + n)):
            block_tables[r, i] = free.pop()
        keys.append(torch.randn(ctx + n, HKV, HEAD_DIM, generator=g).to(dtype))  # [S, Hkv, D]
        values.append(torch.randn(ctx + n, HKV, HEAD_DIM, generator=g).to(dtype))  # [S, Hkv, D]
        queries.append(torch.randn(n, HQ, HEAD_DIM, generator=g).to(dtype))  # [L, Hq, D]
    return keys, values, queries, block_tables


def slots_of(block_table_row: torch.Tensor, positions: range) -> torch.Tensor:
    return torch.tensor([int(block_table_row[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in positions])


def dense_causal_attention(q, k, v, ctx):
    """fp64 attention of q [L, Hq, D] at positions ctx.. over k, v [S, Hkv, D], GQA by repetition."""
    k = k.double().repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]
    v = v.double().repeat_interleave(HQ // HKV, dim=1)  # [S, Hq, D]
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * SCALE  # [Hq, L, S]
    query_pos = torch.arange(q.shape[0])[:, None] + ctx
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(dim=-1), v)  # [L, Hq, D]


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_paged_attention_matches_dense(dtype, atol, rtol):
    keys, values, queries, block_tables = make_batch(dtype)
    # NaN everywhere no token was written: reading any stray block or slot poisons the output.
    kv_cache = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, HKV, HEAD_DIM), float("nan"), dtype=dtype)
    # Earlier steps cached the context; this step writes its own tokens, then attends.
    for r, (ctx, _) in enumerate(ROWS):
        write_kv(keys[r][:ctx], values[r][:ctx], kv_cache, slots_of(block_tables[r], range(ctx)))
    new_slots = torch.cat([slots_of(block_tables[r], range(ctx, ctx + n)) for r, (ctx, n) in enumerate(ROWS)])
    new_k = torch.cat([keys[r][ctx:] for r, (ctx, _) in enumerate(ROWS)])
    new_v = torch.cat([values[r][ctx:] for r, (ctx, _) in enumerate(ROWS)])
    write_kv(new_k, new_v, kv_cache, new_slots)

    q = torch.cat(queries)  # [T, Hq, D]
    query_start_loc = torch.tensor([0, *torch.tensor([n for _, n in ROWS]).cumsum(0).tolist()])
    seq_lens = torch.tensor([ctx + n for ctx, n in ROWS], dtype=torch.int32)
    out = paged_attention(q, kv_cache, query_start_loc, seq_lens, block_tables.to(torch.int32), SCALE)

    assert out.dtype == dtype and out.shape == q.shape
    for r, (ctx, _) in enumerate(ROWS):
        lo, hi = int(query_start_loc[r]), int(query_start_loc[r + 1])
        ref = dense_causal_attention(queries[r], keys[r], values[r], ctx)
        torch.testing.assert_close(out[lo:hi].double(), ref, atol=atol, rtol=rtol)


def test_prefill_chunks_equal_whole_prefill():
    """Attending chunk by chunk over the cached prefix equals attending to the whole prompt at once."""
    keys, values, queries, block_tables = make_batch(torch.float32)
    ctx, n = ROWS[1]
    total = ctx + n
    kv_cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HKV, HEAD_DIM)
    write_kv(keys[1], values[1], kv_cache, slots_of(block_tables[1], range(total)))
    q = torch.randn(total, HQ, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    table = block_tables[1:2]

    whole = paged_attention(q, kv_cache, torch.tensor([0, total]), torch.tensor([total]), table, SCALE)
    chunks = [
        paged_attention(q[lo:hi], kv_cache, torch.tensor([0, hi - lo]), torch.tensor([hi]), table, SCALE)
        for lo, hi in [(0, 7), (7, 8), (8, 30), (30, total)]
    ]
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_round_trip_touches_only_its_slots(dtype):
    g = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, HKV, HEAD_DIM, generator=g).to(dtype)
    before = kv_cache.clone()
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=g)[:11]
    k = torch.randn(11, HKV, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(11, HKV, HEAD_DIM, generator=g).to(dtype)

    write_kv(k, v, kv_cache, slots)

    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    assert torch.equal(kv_cache[blocks, 0, offsets], k)
    assert torch.equal(kv_cache[blocks, 1, offsets], v)
    written = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, dtype=torch.bool)
    written[blocks, offsets] = True
    assert torch.equal(kv_cache.transpose(1, 2)[~written], before.transpose(1, 2)[~written])


def test_shape_and_metadata_errors():
    keys, values, queries, block_tables = make_batch(torch.float32)
    kv_cache = torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, HKV, HEAD_DIM)
    q = queries[0]
    with pytest.raises(ValueError, match="kv_cache expected shape"):
        write_kv(keys[0], values[0], kv_cache[:, :1], torch.arange(9))
    with pytest.raises(ValueError, match=r"v expected shape \[T, Hkv, D\]"):
        write_kv(keys[0], values[0][:, :1], kv_cache, torch.arange(9))
    with pytest.raises(ValueError, match=r"slot_mapping expected values in \[0, 256\)"):
        write_kv(keys[0][:1], values[0][:1], kv_cache, torch.tensor([256]))
    with pytest.raises(ValueError, match=r"expected Hq a multiple of Hkv"):
        paged_attention(q[:, :5], kv_cache, torch.tensor([0, 9]), torch.tensor([9]), block_tables[:1], SCALE)
    with pytest.raises(ValueError, match=r"seq_lens expected >= each row's query length"):
        paged_attention(q, kv_cache, torch.tensor([0, 9]), torch.tensor([8]), block_tables[:1], SCALE)
    with pytest.raises(ValueError, match=r"block_tables\[0\] expected block ids"):
        paged_attention(q, kv_cache, torch.tensor([0, 9]), torch.tensor([9 + 4 * BLOCK_SIZE]), block_tables[:1], SCALE)
    with pytest.raises(ValueError, match=r"query_start_loc expected shape \[R\+1\]"):
        paged_attention(q, kv_cache, torch.tensor([0, 4, 9]), torch.tensor([9]), block_tables[:1], SCALE)
