"""Causal attention over a paged KV cache, for prefill chunks and decode rows alike (torch reference).

The cache of one attention layer is `kv_cache [num_blocks, 2, block_size, Hkv, D]` (index 0 = K,
1 = V). A sequence's token at position p lives in block `block_tables[r, p // block_size]` at offset
`p % block_size`; its flat slot is `block_id * block_size + offset`. NemotronH attention has no
rotary embedding, so keys are stored exactly as projected.

A step first writes its own tokens' K and V (`write_kv`), then attends (`paged_attention`): query i
of row r sits at absolute position ctx + i, ctx = seq_len - q_len, and sees keys 0 .. ctx + i.
Query head h reads KV head h // (Hq // Hkv) (grouped-query attention). Scores and softmax in fp32.

An FP8 cache (float8_e4m3fn, `engine.kv_cache_dtype`) comes with `kv_scale` [2] fp32 (K, V): a write stores
clamp(x / scale, -448, 448) rounded to nearest even, a read takes the stored value times the scale.
"""

import torch
from torch import Tensor

from baton.engine.ops.checks import check_shape
from baton.engine.quant_config import FP8_MAX

FP8_KV_DTYPE = torch.float8_e4m3fn


def _check_cache(fn: str, kv_cache: Tensor) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"{fn}: kv_cache expected shape [num_blocks, 2, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
        )


def check_kv_scale(fn: str, kv_cache: Tensor, kv_scale: Tensor | None) -> None:
    """An FP8 cache takes its [2] fp32 (K, V) scales, a cache in another dtype none: ValueError otherwise."""
    if kv_cache.dtype != FP8_KV_DTYPE:
        if kv_scale is not None:
            raise ValueError(f"{fn}: kv_scale expected None for a {kv_cache.dtype} kv_cache, got a tensor")
        return
    if kv_scale is None:
        raise ValueError(f"{fn}: kv_scale expected a [2] float32 (K, V) tensor for a float8_e4m3fn kv_cache, got None")
    check_shape(fn, "kv_scale", kv_scale, "[2]", (2,))
    if kv_scale.dtype != torch.float32 or kv_scale.device != kv_cache.device:
        raise ValueError(f"{fn}: kv_scale expected float32 on {kv_cache.device}, got {kv_scale.dtype} on "
                         f"{kv_scale.device}")


def quantize_kv(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale clamped to float8_e4m3fn's finite range, in float8_e4m3fn (round to nearest even)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def check_write_kv(fn: str, k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> int:
    """Shapes of a KV write (`write_kv` and its Triton kernel): ValueError naming the argument; returns T."""
    _check_cache(fn, kv_cache)
    _, _, _, kv_heads, head_dim = kv_cache.shape
    if k.dim() != 3:
        raise ValueError(f"{fn}: k expected shape [T, Hkv, D], got {tuple(k.shape)}")
    T = k.shape[0]
    check_shape(fn, "k", k, "[T, Hkv, D]", (T, kv_heads, head_dim))
    check_shape(fn, "v", v, "[T, Hkv, D]", (T, kv_heads, head_dim))
    check_shape(fn, "slot_mapping", slot_mapping, "[T]", (T,))
    return T


def write_kv(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor, kv_scale: Tensor | None = None) -> None:
    """Store each token's K and V at its flat slot `block_id * block_size + offset`.

    k, v [T, Hkv, D]; kv_cache [num_blocks, 2, block_size, Hkv, D], written in place at the given
    slots only; slot_mapping [T] int; kv_scale [2] fp32 (K, V) for a float8_e4m3fn cache, else None.
    """
    fn = "write_kv"
    T = check_write_kv(fn, k, v, kv_cache, slot_mapping)
    check_kv_scale(fn, kv_cache, kv_scale)
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[2]
    slots = slot_mapping.long()
    # Range-checked on the host only for CPU tensors: on the GPU the check would be a sync per layer (the
    # scheduler's block ids are in range by construction).
    if T > 0 and not slots.is_cuda and (int(slots.min()) < 0 or int(slots.max()) >= num_blocks * block_size):
        raise ValueError(
            f"{fn}: slot_mapping expected values in [0, {num_blocks * block_size}), "
            f"got min {int(slots.min())}, max {int(slots.max())}"
        )
    blocks, offsets = slots // block_size, slots % block_size
    if kv_scale is not None:
        k, v = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def paged_attention(
    q: Tensor,
    kv_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    kv_scale: Tensor | None = None,
) -> Tensor:
    """Causal attention of every row's queries over its sequence's cached keys and values.

    q [T, Hq, D]; kv_cache [num_blocks, 2, block_size, Hkv, D], already holding this step's K/V;
    query_start_loc [R+1]; seq_lens [R] tokens of the sequence including this step's; block_tables
    [R, max_blocks] int, entries past a row's last block are ignored; kv_scale [2] fp32 (K, V) for a
    float8_e4m3fn cache, else None. Returns [T, Hq, D] in q.dtype.
    """
    fn = "paged_attention"
    _check_cache(fn, kv_cache)
    check_kv_scale(fn, kv_cache, kv_scale)
    num_blocks, _, block_size, kv_heads, head_dim = kv_cache.shape
    if q.dim() != 3 or block_tables.dim() != 2:
        raise ValueError(
            f"{fn}: expected q [T, Hq, D], block_tables [R, max_blocks], got q {tuple(q.shape)}, "
            f"block_tables {tuple(block_tables.shape)}"
        )
    T, q_heads = q.shape[0], q.shape[1]
    R, max_blocks = block_tables.shape
    check_shape(fn, "q", q, "[T, Hq, D]", (T, q_heads, head_dim))
    check_shape(fn, "query_start_loc", query_start_loc, "[R+1]", (R + 1,))
    check_shape(fn, "seq_lens", seq_lens, "[R]", (R,))
    if q_heads % kv_heads != 0:
        raise ValueError(f"{fn}: expected Hq a multiple of Hkv = {kv_heads}, got Hq = {q_heads}")
    bounds = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"{fn}: query_start_loc expected non-decreasing from 0 to T = {T}, got {bounds}")
    q_lens = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    too_short = any(n < m for n, m in zip(lens, q_lens, strict=True))
    if too_short or any(-(-n // block_size) > max_blocks for n in lens):
        raise ValueError(
            f"{fn}: seq_lens expected >= each row's query length {q_lens} and <= max_blocks * block_size "
            f"= {max_blocks * block_size}, got {lens}"
        )

    group = q_heads // kv_heads
    out = torch.empty(T, q_heads, head_dim, dtype=q.dtype, device=q.device)
    for r in range(R):
        lo, hi, seq_len = bounds[r], bounds[r + 1], lens[r]
        q_len = hi - lo
        if q_len == 0:
            continue
        block_ids = block_tables[r, : -(-seq_len // block_size)].long()
        if int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks:
            raise ValueError(
                f"{fn}: block_tables[{r}] expected block ids in [0, {num_blocks}), got {block_ids.tolist()}"
            )
        # Gather the row's blocks in sequence order and drop the unused tail of the last block.
        kv = kv_cache[block_ids].transpose(0, 1).reshape(2, -1, kv_heads, head_dim)[:, :seq_len].float()
        keys, values = kv[0], kv[1]  # [S, Hkv, D]
        if kv_scale is not None:
            keys, values = keys * kv_scale[0], values * kv_scale[1]

        queries = q[lo:hi].float().view(q_len, kv_heads, group, head_dim)  # [L, Hkv, g, D]
        scores = torch.einsum("lhgd,shd->hgls", queries, keys) * scale  # [Hkv, g, L, S]
        # Query i is at absolute position ctx + i and may see keys at positions <= ctx + i.
        ctx = seq_len - q_len
        query_pos = torch.arange(ctx, seq_len, device=q.device)[:, None]  # [L, 1]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]  # [1, S]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, g, L, S]
        row_out = torch.einsum("hgls,shd->lhgd", probs, values)  # [L, Hkv, g, D]
        out[lo:hi] = row_out.reshape(q_len, q_heads, head_dim).to(q.dtype)
    return out
