"""Triton kernel that stores a step's K and V into the paged cache: one launch per attention layer.

Same effect as the torch reference `write_kv` (`reference.py`): token t's K and V go to the cache
at its flat slot `block_id * block_size + offset` (kv_cache [num_blocks, 2, block_size, Hkv, D], index 0 =
K, 1 = V), cast to the cache's dtype (rounded to nearest even). The reference takes four device ops for
this (the slot's block and offset, two indexed stores); here one program per (token, tile of Hkv * D)
reads its slot and copies both rows.

An FP8 cache (float8_e4m3fn) takes `kv_scale` [2] fp32 (K, V) on the device: K and V are divided by their
scale (correctly rounded, as torch divides), clamped to +-448 and rounded to nearest even, as the reference does.

A negative slot writes nothing (a padding token). Other slot values are the caller's contract, unchecked
(no host reads: the reference checks them on CPU tensors, the scheduler's block ids satisfy it by
construction); an out-of-range slot is an out-of-bounds store. Graph-capturable.
"""

import triton
import triton.language as tl
from torch import Tensor

from baton.engine.ops.attention.reference import check_kv_scale, check_write_kv
from baton.engine.ops.attention.tuning import KV_WRITE_BLOCK
from baton.engine.ops.triton_common import cdiv, pdl, pdl_wait, round_to


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, scale_ptr, block_size, width, stride_kt, stride_vt, stride_cb,
                     stride_ckv, stride_cs, BLOCK: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = cols < tl.where(slot >= 0, width, 0)  # a negative slot masks the whole row
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + cols
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + cols, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8:
        k = tl.clamp(tl.math.div_rn(k, tl.load(scale_ptr)), -448.0, 448.0)
        v = tl.clamp(tl.math.div_rn(v, tl.load(scale_ptr + 1)), -448.0, 448.0)
    tl.store(dst, round_to(k, cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, round_to(v, cache_ptr.dtype.element_ty), mask=mask)


def _token_rows(t: Tensor, width: int) -> Tensor:
    """[T, Hkv, D] -> [T, Hkv * D] with unit stride inside a token (a view for the projections' outputs)."""
    t2 = t.reshape(t.shape[0], width)
    return t2 if t2.stride(1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def write_kv_triton(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor,
                    kv_scale: Tensor | None = None) -> None:
    """k, v [T, Hkv, D]; kv_cache [num_blocks, 2, block_size, Hkv, D] written in place at the given slots
    only (negative slots: not at all); slot_mapping [T] int; kv_scale [2] fp32 (K, V) for a float8_e4m3fn
    cache, else None."""
    fn = "write_kv_triton"
    T = check_write_kv(fn, k, v, kv_cache, slot_mapping)
    check_kv_scale(fn, kv_cache, kv_scale)
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    if kv_cache.stride(4) != 1 or kv_cache.stride(3) != head_dim:
        raise ValueError(f"{fn}: kv_cache expected [Hkv, D] contiguous within a slot, got strides "
                         f"{kv_cache.stride()}")
    if T == 0:
        return
    width = kv_heads * head_dim
    k2, v2 = _token_rows(k, width), _token_rows(v, width)
    _write_kv_kernel[(T, cdiv(width, KV_WRITE_BLOCK))](
        k2, v2, kv_cache, slot_mapping, kv_cache if kv_scale is None else kv_scale, block_size, width, k2.stride(0),
        v2.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), BLOCK=KV_WRITE_BLOCK,
        FP8=kv_scale is not None, num_warps=4, **pdl(k2),
    )
