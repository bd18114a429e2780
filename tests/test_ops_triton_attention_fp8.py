"""FP8 KV cache (float8_e4m3fn with per-layer K and V scales): the Triton attention and KV-write kernels against
their torch references, and the references against attention over the unquantized cache.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET set before the kernels are
imported, as in `test_ops_triton_attention.py`, whose cases these reuse). The `gpu` tests run the compiled kernels
at the 8b-like model's attention size (Hq=32, Hkv=8, D=128, block 16) with bf16 queries: prefill, decode, verify and
split-K paths, the host-built program map the runner sends, and a decode step (write + attention) replayed as a
CUDA graph, as the engine's decode graphs run it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter

from baton.engine.ops.attention.kernel import build_attention_meta, paged_attention_triton  # noqa: E402
from baton.engine.ops.attention.kernel_kv_write import write_kv_triton  # noqa: E402
from baton.engine.ops.attention.reference import (  # noqa: E402
    FP8_KV_DTYPE,
    paged_attention,
    quantize_kv,
    write_kv,
)
from tests.test_ops_triton_attention import (  # noqa: E402
    CONFIGS,
    DECODE_ROWS,
    FULL,
    MIXED_ROWS,
    SPLIT_DECODE_ROWS,
    SPLIT_MIXED_ROWS,
    VERIFY_ROWS,
    make_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Scales that put the random K and V (unit normal) well inside e4m3's range, and unequal, so that a kernel that
# swapped or dropped them would be far off.
SCALES = (0.02, 0.05)
# The kernel folds the K scale into the score scale and the V scale into the accumulator where the reference
# multiplies every element: the same math, rounded apart in fp32; 16-bit queries round as in the 16-bit tests.
DTYPES = [
    pytest.param(torch.float32, 2e-5, 2e-5, id="fp32"),
    pytest.param(torch.bfloat16, 2e-2, 2e-2, id="bf16"),
    pytest.param(torch.float16, 3e-3, 3e-3, id="fp16"),
]
# e4m3 keeps 3 mantissa bits: a stored normal value is within 2**-4 of the scaled one, relative.
E4M3_REL = 2.0**-4


def fp8_case(rows, hq, hkv, d, block_size, dtype, seed=0, scales=SCALES):
    """`make_case`'s batch with its cache quantized: (q, fp8 cache, kv_scale, the unquantized cache, metadata)."""
    q, cache, qsl, seq_lens, bt = make_case(rows, hq, hkv, d, block_size, dtype, seed=seed, device=DEVICE)
    kv_scale = torch.tensor(scales, dtype=torch.float32, device=DEVICE)
    fp8 = torch.stack([quantize_kv(cache[:, 0], kv_scale[0]), quantize_kv(cache[:, 1], kv_scale[1])], dim=1)
    return q, fp8, kv_scale, cache, qsl, seq_lens, bt


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,block_size", CONFIGS)
@pytest.mark.parametrize("rows", [MIXED_ROWS, DECODE_ROWS, VERIFY_ROWS], ids=["mixed", "decode", "verify"])
def test_fp8_kernel_matches_reference(rows, hq, hkv, d, block_size, dtype, atol, rtol):
    check_kernel(rows, None, hq, hkv, d, block_size, dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("rows,splits", [(SPLIT_MIXED_ROWS, 3), (SPLIT_DECODE_ROWS, 4)], ids=["mixed", "decode"])
def test_fp8_split_k_matches_reference(rows, splits, dtype, atol, rtol):
    """Split-K partials carry the V scale in their accumulators; the merge is linear in them."""
    check_kernel(rows, splits, 4, 2, 16, 4, dtype, atol, rtol)


def check_kernel(rows, splits, hq, hkv, d, block_size, dtype, atol, rtol):
    q, fp8, kv_scale, _, qsl, seq_lens, bt = fp8_case(rows, hq, hkv, d, block_size, dtype)
    assert fp8.dtype == FP8_KV_DTYPE
    scale = d**-0.5
    ref = paged_attention(q, fp8, qsl, seq_lens, bt, scale, kv_scale=kv_scale)
    out = paged_attention_triton(q, fp8, qsl, seq_lens, bt, scale, num_splits=splits, kv_scale=kv_scale)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    # The scales are read, not assumed: other scales over the same stored values give another result.
    other = paged_attention_triton(q, fp8, qsl, seq_lens, bt, scale, num_splits=splits, kv_scale=kv_scale * 2)
    assert (other.float() - ref.float()).abs().max() > 10 * atol


@pytest.mark.parametrize("rows", [MIXED_ROWS, VERIFY_ROWS], ids=["mixed", "verify"])
def test_fp8_attention_stays_within_e4m3_precision_of_the_unquantized(rows):
    """Attention over the dequantized cache against attention over the fp32 one: each stored K and V is within
    E4M3_REL of its value, so the output moves by about that much of |V| (through V directly and through the
    softmax weights); bounded at twice that, and well above the rounding of fp32 itself."""
    q, fp8, kv_scale, cache, qsl, seq_lens, bt = fp8_case(rows, 4, 2, 16, 4, torch.float32, seed=5)
    scale = 16**-0.5
    exact = paged_attention(q, cache, qsl, seq_lens, bt, scale)
    got = paged_attention(q, fp8, qsl, seq_lens, bt, scale, kv_scale=kv_scale)
    err = (got - exact).abs().max().item()
    vmax = cache[:, 1].nan_to_num().abs().max().item()
    assert err <= 2 * E4M3_REL * vmax
    assert err > 1e-4  # it did quantize
    # Relative to the output's own spread the error is small: the quantization is not noise.
    assert err <= 0.1 * exact.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_write_equals_reference_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(7)
    T, hkv, d, block_size, blocks = 37, 2, 16, 8, 9
    # Values across e4m3's range once scaled: subnormals, normals, and past +-448 (clamped), and signed zeros.
    mag = torch.logspace(-6, 3.5, T * hkv * d).reshape(T, hkv, d)
    k = (mag * torch.randn(T, hkv, d, generator=g).sign()).to(dtype).to(DEVICE)
    v = (torch.randn(T, hkv, d, generator=g) * 3).to(dtype).to(DEVICE)
    k[0, 0, :2] = torch.tensor([0.0, -0.0], dtype=dtype)
    slots = torch.randperm(blocks * block_size, generator=g)[:T].to(DEVICE)
    kv_scale = torch.tensor([0.37, 0.011], device=DEVICE)
    ref = torch.full((blocks, 2, block_size, hkv, d), float("nan"), device=DEVICE).to(FP8_KV_DTYPE)
    got = ref.clone()
    write_kv(k, v, ref, slots, kv_scale=kv_scale)
    write_kv_triton(k, v, got, slots, kv_scale=kv_scale)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))  # NaN bytes where nothing was written, too
    assert ref.float().nan_to_num().abs().max() == 448.0  # the clamp was exercised
    assert ref.element_size() == 1


def test_fp8_cache_and_scales_are_checked():
    q, fp8, kv_scale, cache, qsl, seq_lens, bt = fp8_case(DECODE_ROWS, 4, 2, 16, 4, torch.float32)
    k = torch.zeros(1, 2, 16, device=DEVICE)
    slot = torch.zeros(1, dtype=torch.long, device=DEVICE)
    for fn in (paged_attention, paged_attention_triton):
        with pytest.raises(ValueError, match="kv_scale expected a \\[2\\] float32 .* got None"):
            fn(q, fp8, qsl, seq_lens, bt, 0.25)
        with pytest.raises(ValueError, match="kv_scale expected None for a torch.float32 kv_cache"):
            fn(q, cache, qsl, seq_lens, bt, 0.25, kv_scale=kv_scale)
        with pytest.raises(ValueError, match="kv_scale expected shape \\[2\\]"):
            fn(q, fp8, qsl, seq_lens, bt, 0.25, kv_scale=kv_scale[:1])
    for fn in (write_kv, write_kv_triton):
        with pytest.raises(ValueError, match="kv_scale expected a \\[2\\] float32 .* got None"):
            fn(k, k, fp8, slot)
        with pytest.raises(ValueError, match="kv_scale expected float32"):
            fn(k, k, fp8, slot, kv_scale=kv_scale.double())


# --- the 8b-like attention size on CUDA --------------------------------------------------------------------------

# bf16 queries over the FP8 cache, against the torch reference over the same stored bytes (the 16-bit tests' bound).
GPU_ATOL = GPU_RTOL = 2e-2
SIZE = (FULL["hq"], FULL["hkv"], FULL["d"], FULL["block_size"])
SCALE = FULL["d"] ** -0.5


def _meta(qsl):
    """The program map the runner builds from the host's query starts (`build_attention_meta`)."""
    return build_attention_meta(qsl.tolist(), qsl, FULL["hq"], FULL["hkv"], FULL["d"])


def _rows(batch, max_ctx, q_len, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx, (batch,), generator=g).tolist()
    ctx[0] = max_ctx - 1  # always one row at the longest context
    return [(c, q_len) for c in ctx]


def check_gpu(rows, seed, splits=(None,), max_query_lens=(None,), meta=False):
    q, fp8, kv_scale, _, qsl, seq_lens, bt = fp8_case(rows, *SIZE, torch.bfloat16, seed=seed)
    ref = paged_attention(q, fp8, qsl, seq_lens, bt, SCALE, kv_scale=kv_scale)
    assert not ref.isnan().any()
    extra = {"attention_meta": _meta(qsl)} if meta else {}
    for num_splits in splits:
        for max_query_len in max_query_lens:
            out = paged_attention_triton(q, fp8, qsl, seq_lens, bt, SCALE, max_query_len=max_query_len,
                                         num_splits=num_splits, kv_scale=kv_scale, **extra)
            torch.testing.assert_close(out, ref, atol=GPU_ATOL, rtol=GPU_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 32, 256])
def test_gpu_fp8_decode_8b_like(batch):
    """Decode rows up to 8k keys: the auto split, one part and split-K over 7, with and without the host-built map."""
    rows = _rows(batch, 8192, 1, seed=batch)
    check_gpu(rows, batch, splits=(None, 1, 7), max_query_lens=(1,))
    check_gpu(rows, batch, splits=(None, 7), meta=True)


@pytest.mark.gpu
def test_gpu_fp8_prefill_and_mixed_8b_like():
    """Prefill chunks with and without a prefix, a whole prompt, verify rows and decode rows in one batch."""
    rows = [(0, 2048), (3000, 512), (8191, 1), (100, 4), (4095, 5), (0, 1), (777, 300)] + [(2048, 1)] * 16
    check_gpu(rows, 5, max_query_lens=(None, 2048))
    check_gpu(rows, 5, meta=True)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 4])
def test_gpu_fp8_verify_8b_like(k):
    """Verify steps (1 + K queries a row) take short tiles; their keys split into parts too."""
    rows = _rows(32, 4096, 1 + k, seed=10 + k)
    check_gpu(rows, 10 + k, splits=(None, 1, 4), meta=True)


@pytest.mark.gpu
def test_gpu_fp8_write_8b_like_equals_reference_bit_for_bit():
    g = torch.Generator(device="cuda").manual_seed(3)
    T, (_, hkv, d, bs), blocks = 8192, SIZE, 600
    k = (torch.randn(T, hkv, d, generator=g, device="cuda") * 4).to(torch.bfloat16)
    v = torch.randn(T, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(blocks * bs, generator=g, device="cuda")[:T]
    kv_scale = torch.tensor(SCALES, device="cuda")
    ref = torch.zeros(blocks, 2, bs, hkv, d, device="cuda").to(FP8_KV_DTYPE)
    got = ref.clone()
    write_kv(k, v, ref, slots, kv_scale=kv_scale)
    write_kv_triton(k, v, got, slots, kv_scale=kv_scale)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert ref.float().abs().max() == 448.0  # K at four times the unit normal clamps


@pytest.mark.gpu
def test_gpu_fp8_decode_step_replays_as_a_cuda_graph():
    """A decode step as the engine's graphs run it (the new tokens' K and V written, then attention with the program
    map built once), captured and replayed with new queries, keys, values and scales: equal to the eager reference
    on the same cache, the cache's bytes included (the scales are read on the device, not baked into the graph)."""
    rows = _rows(32, 4096, 1, seed=7)
    q, cache, kv_scale, _, qsl, seq_lens, bt = fp8_case(rows, *SIZE, torch.bfloat16, seed=7)
    bs, hkv, d = FULL["block_size"], FULL["hkv"], FULL["d"]
    pos = torch.tensor([c for c, _ in rows], device="cuda")
    slots = bt[torch.arange(len(rows), device="cuda"), pos // bs].long() * bs + pos % bs
    k, v = (torch.randn(len(rows), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    meta = _meta(qsl)

    def step():
        write_kv_triton(k, v, cache, slots, kv_scale=kv_scale)
        return paged_attention_triton(q, cache, qsl, seq_lens, bt, SCALE, attention_meta=meta, kv_scale=kv_scale)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    g = torch.Generator(device="cuda").manual_seed(8)
    for scales in ((0.03, 0.04), (0.01, 0.08)):
        before = cache.clone()
        for t in (q, k, v):
            t.copy_(torch.randn(t.shape, generator=g, device="cuda"))
        kv_scale.copy_(torch.tensor(scales))
        graph.replay()
        write_kv(k, v, before, slots, kv_scale=kv_scale)
        ref = paged_attention(q, before, qsl, seq_lens, bt, SCALE, kv_scale=kv_scale)
        torch.cuda.synchronize()
        assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
        torch.testing.assert_close(out, ref, atol=GPU_ATOL, rtol=GPU_RTOL)
