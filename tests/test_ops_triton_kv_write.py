"""Triton KV write (`ops.attention.kernel_kv_write`) against the torch reference `write_kv`: the same cache, bit for bit.

Without CUDA the kernel runs under TRITON_INTERPRET=1 on CPU tensors; the `gpu` test runs it compiled at an
8b-like attention layer's size.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first import of triton

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install lacks it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.attention.kernel_kv_write import write_kv_triton  # noqa: E402
from baton.engine.ops.attention.reference import write_kv  # noqa: E402
from baton.engine.ops.attention.tuning import KV_WRITE_BLOCK as BLOCK  # noqa: E402
from baton.engine.ops.kernels import resolve_kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def case(T, hkv, d, block_size, num_blocks, dtype, kv_dtype=None, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, hkv, d, generator=g).to(dtype).to(device)
    v = torch.randn(T, hkv, d, generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T].to(device)  # scattered, distinct
    cache = torch.full((num_blocks, 2, block_size, hkv, d), float("nan"), dtype=kv_dtype or dtype, device=device)
    return k, v, slots, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T, hkv, d, block_size", [(1, 1, 8, 4), (13, 2, 16, 8), (40, 4, 300, 16), (3, 2, BLOCK, 4)])
def test_write_kv_equals_reference_bit_for_bit(dtype, T, hkv, d, block_size):
    k, v, slots, cache = case(T, hkv, d, block_size, num_blocks=T + 5, dtype=dtype, seed=T)
    ref = cache.clone()
    write_kv(k, v, ref, slots)
    write_kv_triton(k, v, cache, slots)
    assert torch.equal(cache.isnan(), ref.isnan())  # only the given slots written
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())


def test_write_kv_casts_like_the_reference_and_takes_split_projections():
    k, v, slots, cache = case(9, 2, 16, 4, 6, torch.float32, kv_dtype=torch.bfloat16, seed=1)
    ref = cache.clone()
    write_kv(k, v, ref, slots)
    write_kv_triton(k, v, cache, slots)
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())  # fp32 -> bf16 rounded to nearest even
    # k and v as views of one fused projection output (a row stride of 3 * Hkv * D)
    qkv = torch.randn(9, 3 * 32, device=DEVICE)
    k2, v2 = qkv[:, 32:64].view(9, 2, 16), qkv[:, 64:].view(9, 2, 16)
    ref2, got2 = torch.zeros(6, 2, 4, 2, 16, device=DEVICE), torch.zeros(6, 2, 4, 2, 16, device=DEVICE)
    write_kv(k2, v2, ref2, slots)
    write_kv_triton(k2, v2, got2, slots)
    assert torch.equal(got2, ref2)


def test_negative_slots_write_nothing_and_errors():
    k, v, slots, cache = case(6, 2, 8, 4, 4, torch.float32, seed=2)
    slots[1] = slots[4] = -1
    write_kv_triton(k, v, cache, slots)
    keep = slots >= 0
    ref = torch.full_like(cache, float("nan"))
    write_kv(k[keep], v[keep], ref, slots[keep])
    assert torch.equal(cache.isnan(), ref.isnan()) and torch.equal(cache.nan_to_num(), ref.nan_to_num())
    write_kv_triton(k[:0], v[:0], cache, slots[:0])  # an empty step writes nothing, launches nothing
    with pytest.raises(ValueError, match="kv_cache expected shape"):
        write_kv_triton(k, v, cache[:, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_triton(k, v, cache, slots[:3])
    with pytest.raises(ValueError, match="expected"):
        write_kv_triton(k[:, :1], v, cache, slots)


def test_dispatch_picks_by_mode():
    t = torch.zeros(1)
    assert resolve_kernels("triton", t.device).write_kv is write_kv_triton
    assert resolve_kernels("torch", t.device).write_kv is write_kv


@pytest.mark.gpu
def test_gpu_8b_like_layer_write():
    k, v, slots, cache = case(2048, 8, 128, 16, 4096, torch.bfloat16, seed=3, device="cuda")
    ref = cache.clone()
    write_kv(k, v, ref, slots)
    write_kv_triton(k, v, cache, slots)
    assert torch.equal(cache.nan_to_num(), ref.nan_to_num())
