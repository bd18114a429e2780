"""Triton Gated DeltaNet kernels (decode, verify by replay, varlen prefill) and the norm-then-gate RMSNorm against
their torch references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: TRITON_INTERPRET must be set before the kernel
modules are imported (their `@triton.jit` reads it at decoration time), so it is set at the very top of this module.
The `gpu` tests run the compiled kernels at Qwen3.5-27B's sizes (Hk 16, Hv 48, Dk = Dv = 128, chunk 64).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import functools  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
from torch import Tensor  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (the Makefile's CPU install must add it)")
pytestmark = pytest.mark.interpreter  # CPU tensors through the interpreter; the `gpu` tests run compiled

from baton.engine.ops.gated_delta.kernel import (  # noqa: E402
    gated_delta_decode_triton,
    gated_delta_verify_triton,
)
from baton.engine.ops.gated_delta.kernel_prefill import chunked, gated_delta_prefill_varlen_triton  # noqa: E402
from baton.engine.ops.gated_delta.reference import (  # noqa: E402
    gated_delta_decode,
    gated_delta_prefill_varlen,
    gated_delta_verify,
)
from baton.engine.ops.gated_delta.tuning import DECODE_LAUNCH  # noqa: E402
from baton.engine.ops.norm.kernel_norm_gate import norm_gate_triton  # noqa: E402
from baton.engine.ops.norm.reference import norm_gate_reference  # noqa: E402

SMALL = dict(Hk=2, Hv=4, Dk=16, Dv=8)
FULL = dict(Hk=16, Hv=48, Dk=128, Dv=128)
NUM_SLOTS = 12
CHUNK = 16
FULL_CHUNK = 64
PENDING = 4  # L: recorded positions per slot (>= the largest T here)
SLOTS = [5, 0, 11]
BATCH = len(SLOTS)

# (input dtype, pool dtype, atol, rtol): the kernels' fp32 math differs from torch's by a few ulps (the order of the
# sums over Dk), so a rounding to bf16 can land one ulp apart.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 2e-5, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 2e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 2e-2, id="bf16-bf16state"),
    pytest.param(torch.float32, torch.bfloat16, 3e-2, 2e-2, id="fp32-bf16state"),
]


def t64(values, device="cpu") -> Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def make_params(Hv: int, seed: int = 0, device: str = "cpu") -> dict[str, Tensor]:
    """A_log and dt_bias [Hv] giving per-token decays exp(g) of about 0.6 .. 0.99: a state carries over a row."""
    g = torch.Generator().manual_seed(seed)
    A_log = torch.empty(Hv).uniform_(math.log(0.05), math.log(1.0), generator=g)
    dt_bias = torch.empty(Hv).uniform_(-3.0, 0.0, generator=g)
    return dict(A_log=A_log.to(device), dt_bias=dt_bias.to(device))


def make_tokens(lead: tuple[int, ...], dtype: torch.dtype, Hk: int, Hv: int, Dk: int, Dv: int, seed: int = 1,
                device: str = "cpu") -> dict[str, Tensor]:  # fmt: skip
    """Raw inputs with leading dims `lead`: q, k [*, Hk, Dk], v [*, Hv, Dv], a, b [*, Hv]."""
    g = torch.Generator().manual_seed(seed)
    out = dict(
        q=torch.randn(*lead, Hk, Dk, generator=g),
        k=torch.randn(*lead, Hk, Dk, generator=g),
        v=torch.randn(*lead, Hv, Dv, generator=g),
        a=torch.randn(*lead, Hv, generator=g),
        b=torch.randn(*lead, Hv, generator=g),
    )
    return {n: x.to(device=device, dtype=dtype) for n, x in out.items()}


def make_pool(state_dtype: torch.dtype, Hv: int, Dk: int, Dv: int, slots: int = NUM_SLOTS, seed: int = 2,
              device: str = "cpu") -> Tensor:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(slots, Hv, Dk, Dv, generator=g)).to(device=device, dtype=state_dtype)


def make_pending(dtype: torch.dtype, shape: dict, length: int = PENDING, slots: int = NUM_SLOTS, seed: int = 3,
                 device: str = "cpu") -> dict[str, Tensor]:  # fmt: skip
    """Recorded raw inputs of each slot's last verify: k [S, L, Hk, Dk], v [S, L, Hv, Dv], a, b [S, L, Hv]."""
    tok = make_tokens((slots, length), dtype, **shape, seed=seed, device=device)
    return {n: tok[n] for n in ("k", "v", "a", "b")}


def clone_all(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: x.clone() for n, x in d.items()}


def close(actual: Tensor, expected: Tensor, atol: float, rtol: float) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def assert_same(actual: Tensor, expected: Tensor) -> None:
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


def decode(fn, pool, tok, params, slots) -> Tensor:
    return fn(pool, tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], params["A_log"], params["dt_bias"],
              t64(slots, pool.device))  # fmt: skip


def verify(fn, pool, pend, tok, params, slots, replay, num_tokens=None) -> Tensor:
    dev = pool.device
    return fn(
        pool, pend["k"], pend["v"], pend["a"], pend["b"], tok["q"], tok["k"], tok["v"], tok["a"], tok["b"],
        params["A_log"], params["dt_bias"], t64(slots, dev), t64(replay, dev),
        None if num_tokens is None else t64(num_tokens, dev),
    )  # fmt: skip


def prefill(fn, pool, tok, params, lengths, slots, has_init, chunk=CHUNK) -> Tensor:
    dev = pool.device
    bounds = t64([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dev)
    return fn(pool, tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], params["A_log"], params["dt_bias"], bounds,
              t64(slots, dev), torch.tensor(has_init, device=dev), chunk)  # fmt: skip


# ---- decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_decode_matches_reference_and_leaves_other_slots(dtype, state_dtype, atol, rtol):
    params, tok = make_params(4), make_tokens((BATCH,), dtype, **SMALL)
    pool = make_pool(state_dtype, 4, 16, 8)
    before, ref_pool = pool.clone(), pool.clone()
    o = decode(gated_delta_decode_triton, pool, tok, params, SLOTS)
    o_ref = decode(gated_delta_decode, ref_pool, tok, params, SLOTS)
    close(o, o_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])


@pytest.mark.parametrize("tiles,stream", [(2, False), (3, True), (8, False)])
def test_decode_several_tiles_per_program_and_stream_hints(tiles, stream):
    """A program walking several tiles (the next tile's read issued early), the tile count not dividing the grid's
    (its last program runs past the end and must touch nothing), and the L2 hints: the same results."""
    params, tok = make_params(4), make_tokens((BATCH,), torch.float32, **SMALL)
    pool = make_pool(torch.float32, 4, 16, 8)
    before, ref_pool = pool.clone(), pool.clone()
    run = functools.partial(gated_delta_decode_triton, tile=64, tiles=tiles, stream=stream)  # 2 tiles per head
    o = decode(run, pool, tok, params, SLOTS)
    o_ref = decode(gated_delta_decode, ref_pool, tok, params, SLOTS)
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])


def test_decode_odd_sizes_and_strided_inputs():
    """Dk and Dv not powers of two (masked tile edges), Hk = 1; q, k, v views with non-unit strides."""
    shape = dict(Hk=1, Hv=3, Dk=12, Dv=6)
    params = make_params(3)
    wide = make_tokens((BATCH,), torch.float32, Hk=1, Hv=3, Dk=24, Dv=12)
    tok = dict(q=wide["q"][..., ::2], k=wide["k"][..., 12:], v=wide["v"][..., ::2], a=wide["a"], b=wide["b"])
    pool = make_pool(torch.float32, shape["Hv"], shape["Dk"], shape["Dv"])
    ref_pool = pool.clone()
    o = decode(gated_delta_decode_triton, pool, tok, params, [4, 1, 7])
    o_ref = decode(gated_delta_decode, ref_pool, tok, params, [4, 1, 7])
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)


def test_decode_empty_batch_and_bad_shapes():
    params, pool = make_params(4), make_pool(torch.float32, 4, 16, 8)
    before = pool.clone()
    tok = make_tokens((0,), torch.float32, **SMALL)
    assert decode(gated_delta_decode_triton, pool, tok, params, []).shape == (0, 4, 8)
    assert_same(pool, before)
    tok = make_tokens((BATCH,), torch.float32, **SMALL)
    with pytest.raises(ValueError, match=r"gated_delta_decode_triton: k expected shape \[B, Hk, Dk\]"):
        decode(gated_delta_decode_triton, pool, dict(tok, k=tok["k"][..., :3]), params, SLOTS)
    with pytest.raises(ValueError, match="multiple of Hk"):
        decode(gated_delta_decode_triton, pool, make_tokens((BATCH,), torch.float32, 3, 4, 16, 8), params, SLOTS)


# ---- verify ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("T", [1, 3])
def test_verify_matches_reference(T, dtype, state_dtype, atol, rtol):
    """Replays of 0 .. L positions, short rows, untouched slots untouched, this step's inputs recorded."""
    params, tok = make_params(4), make_tokens((BATCH, T), dtype, **SMALL, seed=T)
    pool, pend = make_pool(state_dtype, 4, 16, 8), make_pending(dtype, SMALL)
    before, ref_pool, ref_pend = pool.clone(), pool.clone(), clone_all(pend)
    replay, num_tokens = [T, 0, PENDING], [T, max(1, T - 1), 1]
    o = verify(gated_delta_verify_triton, pool, pend, tok, params, SLOTS, replay, num_tokens)
    o_ref = verify(gated_delta_verify, ref_pool, ref_pend, tok, params, SLOTS, replay, num_tokens)
    close(o, o_ref, atol, rtol)
    for b, n in enumerate(num_tokens):
        assert (o[b, n:] == 0).all()
    close(pool, ref_pool, atol, rtol)
    # Row 1 replays nothing: its slot is not written; nor is any slot outside the rows'.
    untouched = [s for s in range(NUM_SLOTS) if s not in (SLOTS[0], SLOTS[2])]
    assert_same(pool[untouched], before[untouched])
    for n in pend:
        assert_same(pend[n], ref_pend[n])


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_verify_every_replay_count_matches_reference(dtype, state_dtype):
    """Replay counts 0 .. L on one batch, all T tokens (num_tokens None)."""
    T = 3
    slots = [9, 3, 0, 6, 1]
    params, tok = make_params(4), make_tokens((len(slots), T), dtype, **SMALL)
    pool, pend = make_pool(state_dtype, 4, 16, 8), make_pending(dtype, SMALL)
    ref_pool, ref_pend = pool.clone(), clone_all(pend)
    replay = list(range(PENDING + 1))
    o = verify(gated_delta_verify_triton, pool, pend, tok, params, slots, replay)
    o_ref = verify(gated_delta_verify, ref_pool, ref_pend, tok, params, slots, replay)
    close(o, o_ref, 2e-5 if dtype == torch.float32 else 3e-2, 1e-4 if dtype == torch.float32 else 2e-2)
    close(pool, ref_pool, 2e-5 if state_dtype == torch.float32 else 3e-2, 2e-2)
    for n in pend:
        assert_same(pend[n], ref_pend[n])


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])  # fmt: skip
def test_verify_chain_equals_decode_kernel(dtype, state_dtype):
    """R4 on the kernels themselves: step n+1 replays the a+1 positions step n accepted and commits bit for bit the
    decode kernel's state over the same tokens; each accepted position's o is the decode kernel's, bit for bit."""
    K = 2
    T = 1 + K
    plain, scratch = [7, 8, 9], [2, 3, 4]
    params, pool, pend = make_params(4), make_pool(state_dtype, 4, 16, 8), make_pending(dtype, SMALL, length=T)
    pool[plain] = pool[SLOTS]
    replay = [0] * BATCH
    for n in range(T + 1):
        tok = make_tokens((BATCH, T), dtype, **SMALL, seed=100 + n)
        o = verify(gated_delta_verify_triton, pool, pend, tok, params, SLOTS, replay)
        for b in range(BATCH):
            assert_same(pool[SLOTS[b]], pool[plain[b]])
        accepted = [(n + b) % T for b in range(BATCH)]
        for t in range(T):
            rows = [plain[b] if t <= accepted[b] else scratch[b] for b in range(BATCH)]
            o_plain = decode(gated_delta_decode_triton, pool, {n: x[:, t] for n, x in tok.items()}, params, rows)
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(o[b, t], o_plain[b])
        replay = [a + 1 for a in accepted]


def test_verify_unnamed_slots_untouched_and_pending_views():
    """Slots outside the rows (NaN here) are neither read nor written; pending tensors are per-layer views of one
    [S, layers, L, ...] allocation, as the engine's pools hand them out."""
    T = 3
    params, tok = make_params(4), make_tokens((BATCH, T), torch.float32, **SMALL)
    real_pool = make_pool(torch.float32, 4, 16, 8)
    layers = make_tokens((NUM_SLOTS, 2, PENDING), torch.float32, **SMALL, seed=5)
    pend = {n: layers[n][:, 1] for n in ("k", "v", "a", "b")}
    real_pend = clone_all(pend)
    pool = torch.full_like(real_pool, float("nan"))
    pool[SLOTS] = real_pool[SLOTS]
    for n in pend:
        pend[n].fill_(float("nan"))
        pend[n][SLOTS] = real_pend[n][SLOTS]
    ref_pool, ref_pend = pool.clone(), clone_all(pend)
    replay, num_tokens = [3, 0, PENDING], [2, 3, 1]
    o = verify(gated_delta_verify_triton, pool, pend, tok, params, SLOTS, replay, num_tokens)
    o_ref = verify(gated_delta_verify, ref_pool, ref_pend, tok, params, SLOTS, replay, num_tokens)
    assert torch.isfinite(o).all()
    close(o, o_ref, 2e-5, 1e-4)
    for s in range(NUM_SLOTS):
        tensors = [pool[s]] + [x[s] for x in pend.values()]
        assert all(torch.isfinite(x).all() if s in SLOTS else torch.isnan(x).all() for x in tensors), s
    assert torch.isnan(layers["k"][:, 0]).sum() == 0


def test_verify_empty_batch_and_bad_shapes():
    params, pool, pend = make_params(4), make_pool(torch.float32, 4, 16, 8), make_pending(torch.float32, SMALL)
    before, pend_before = pool.clone(), clone_all(pend)
    tok = make_tokens((0, 2), torch.float32, **SMALL)
    assert verify(gated_delta_verify_triton, pool, pend, tok, params, [], []).shape == (0, 2, 4, 8)
    assert_same(pool, before)
    assert all(torch.equal(pend[n], pend_before[n]) for n in pend)
    fn = "gated_delta_verify_triton"
    tok = make_tokens((BATCH, PENDING + 1), torch.float32, **SMALL)
    with pytest.raises(ValueError, match=f"{fn}: pending_k expected a pending length L >= T = 5, got L = 4"):
        verify(gated_delta_verify_triton, pool, pend, tok, params, SLOTS, [0] * BATCH)
    tok = make_tokens((BATCH, 2), torch.float32, **SMALL)
    with pytest.raises(ValueError, match=rf"{fn}: replay expected shape \[B\]"):
        verify(gated_delta_verify_triton, pool, pend, tok, params, SLOTS, [0, 0])
    with pytest.raises(ValueError, match=rf"{fn}: pending_v expected shape \[S, L, Hv, Dv\]"):
        verify(gated_delta_verify_triton, pool, dict(pend, v=pend["v"][..., :3]), tok, params, SLOTS, [0] * BATCH)


# ---- prefill ---------------------------------------------------------------------------------------

# Row lengths around the chunk size, with and without an initial state (a new row's slot holds NaN: never read).
LENGTHS = [1, CHUNK - 1, CHUNK, CHUNK + 1, 0]
ROW_SLOTS = [7, 2, 9, 0, 4]
HAS_INIT = [True, False, True, False, True]


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_prefill_matches_reference(dtype, state_dtype, atol, rtol):
    params = make_params(4)
    tok = make_tokens((sum(LENGTHS),), dtype, **SMALL)
    pool = make_pool(state_dtype, 4, 16, 8)
    for s, init in zip(ROW_SLOTS, HAS_INIT, strict=True):
        if not init:
            pool[s] = float("nan")
    before, ref_pool = pool.clone(), pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, LENGTHS, ROW_SLOTS, HAS_INIT)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, LENGTHS, ROW_SLOTS, HAS_INIT)
    close(o, o_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    others = [s for s in range(NUM_SLOTS) if s not in ROW_SLOTS]
    assert_same(pool[others], before[others])


@pytest.mark.parametrize("chunk", [4, 24, CHUNK, 32, 64])
def test_prefill_each_algorithm_matches_reference(chunk):
    """Power-of-two chunks of at least 16 run the chunk-parallel (WY) kernels, other chunk sizes the token-by-token
    one; a row of several chunks carries its state from chunk to chunk, a row shorter than the chunk is one padded
    chunk (the prep holds a chunk as one, two or four sub-blocks)."""
    assert chunked(chunk) == (chunk in (CHUNK, 32, 64))
    lengths, slots, has_init = [2 * chunk + 3, 5, chunk], [3, 8, 10], [True, False, True]
    params, tok = make_params(4), make_tokens((sum(lengths),), torch.float32, **SMALL, seed=6)
    pool = make_pool(torch.float32, 4, 16, 8)
    ref_pool = pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init, chunk)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init, chunk)
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)


def test_prefill_odd_sizes_strided_inputs_and_empty_rows():
    """Dk != Dv, neither a power of two; q, k, v views of one wider projection; empty rows keep their state or
    zero it (new rows); no rows at all."""
    shape = dict(Hk=1, Hv=2, Dk=12, Dv=6)
    params = make_params(2)
    lengths, slots, has_init = [0, 5, 0, 3], [1, 2, 3, 6], [True, False, False, True]
    T = sum(lengths)
    g = torch.Generator().manual_seed(4)
    proj = torch.randn(T, 2 * 12 + 2 * 6 + 5, generator=g)  # [T, q | k | v | extra]
    tok = dict(q=proj[:, :12].view(T, 1, 12), k=proj[:, 12:24].view(T, 1, 12), v=proj[:, 24:36].view(T, 2, 6),
               a=torch.randn(T, 2, generator=g), b=proj[:, 36:38])  # fmt: skip
    pool = make_pool(torch.float32, 2, 12, 6)
    ref_pool = pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init)
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)
    assert (pool[3] == 0).all()
    empty, after = make_tokens((0,), torch.float32, **shape), pool.clone()
    assert prefill(gated_delta_prefill_varlen_triton, pool, empty, params, [], [], []).shape == (0, 2, 6)
    assert_same(pool, after)


def test_prefill_then_decode_kernels_equal_reference():
    """Prefill of n tokens then one decode step, both kernels, equal the references' hand-off (R1)."""
    n, slot = CHUNK + 1, 6
    params, tok = make_params(4), make_tokens((n + 1,), torch.float32, **SMALL)
    pool = make_pool(torch.float32, 4, 16, 8)
    ref_pool = pool.clone()
    head, last = {k: x[:n] for k, x in tok.items()}, {k: x[n:] for k, x in tok.items()}
    prefill(gated_delta_prefill_varlen_triton, pool, head, params, [n], [slot], [False])
    o = decode(gated_delta_decode_triton, pool, last, params, [slot])
    prefill(gated_delta_prefill_varlen, ref_pool, head, params, [n], [slot], [False])
    o_ref = decode(gated_delta_decode, ref_pool, last, params, [slot])
    close(o, o_ref, 2e-5, 1e-4)
    close(pool, ref_pool, 2e-5, 1e-4)


def test_prefill_bad_shapes_raise():
    params, pool = make_params(4), make_pool(torch.float32, 4, 16, 8)
    tok = make_tokens((5,), torch.float32, **SMALL)
    fn = "gated_delta_prefill_varlen_triton"
    with pytest.raises(ValueError, match=rf"{fn}: has_initial_state expected shape \[R\]"):
        prefill(gated_delta_prefill_varlen_triton, pool, tok, params, [2, 3], [1, 2], [True])
    with pytest.raises(ValueError, match=f"{fn}: expected chunk_size > 0, got 0"):
        prefill(gated_delta_prefill_varlen_triton, pool, tok, params, [2, 3], [1, 2], [True, True], chunk=0)


# ---- norm then gate ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,w_dtype,atol,rtol",
    [(torch.float32, torch.float32, 1e-5, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2, 1e-2),
     (torch.bfloat16, torch.float32, 2e-2, 1e-2), (torch.float16, torch.float16, 2e-3, 2e-3)],
)  # fmt: skip
@pytest.mark.parametrize("width", [16, 12])
def test_norm_gate_matches_reference(dtype, w_dtype, atol, rtol, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, width, generator=g).to(dtype)
    wide = torch.randn(5, 3, 2 * width, generator=g).to(dtype)
    gate = wide[..., width:]  # a split of a wider tensor
    weight = (1.0 + 0.1 * torch.randn(width, generator=g)).to(w_dtype)
    y = norm_gate_triton(x, gate, weight, 1e-6)
    close(y, norm_gate_reference(x, gate, weight, 1e-6), atol, rtol)


def test_norm_gate_empty_and_bad_shapes():
    x = torch.zeros(0, 8)
    assert norm_gate_triton(x, x, torch.ones(8), 1e-6).shape == (0, 8)
    with pytest.raises(ValueError, match="gate: expected shape"):
        norm_gate_triton(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 1e-6)


# ---- full size (compiled, on a GPU) -----------------------------------------------------------------

GPU_DTYPES = [
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 2e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 2e-2, id="bf16-bf16state"),
    pytest.param(torch.float32, torch.float32, 1e-4, 1e-3, id="fp32"),
]
GPU_SLOTS = 64


@pytest.mark.gpu
@pytest.mark.parametrize("launch", [None, *[tuple(launch) for _, *launch in DECODE_LAUNCH], (8192, 4, 4, True)])
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
def test_gpu_decode_full_size(dtype, state_dtype, atol, rtol, launch):
    """At the batch's own tuning and at every launch `DECODE_LAUNCH` may pick."""
    tile, warps, tiles, stream = launch or (None, None, None, None)
    slots = torch.randperm(GPU_SLOTS, generator=torch.Generator().manual_seed(0))[:40].tolist()
    params = make_params(FULL["Hv"], device="cuda")
    tok = make_tokens((len(slots),), dtype, **FULL, device="cuda")
    pool = make_pool(state_dtype, FULL["Hv"], FULL["Dk"], FULL["Dv"], slots=GPU_SLOTS, device="cuda")
    before, ref_pool = pool.clone(), pool.clone()
    run = functools.partial(gated_delta_decode_triton, tile=tile, num_warps=warps, tiles=tiles, stream=stream)
    o = decode(run, pool, tok, params, slots)
    o_ref = decode(gated_delta_decode, ref_pool, tok, params, slots)
    close(o, o_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    others = [s for s in range(GPU_SLOTS) if s not in slots]
    assert_same(pool[others], before[others])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
def test_gpu_verify_full_size(dtype, state_dtype, atol, rtol):
    T, L, rows = 4, 4, 16
    slots = torch.randperm(GPU_SLOTS, generator=torch.Generator().manual_seed(1))[:rows].tolist()
    params = make_params(FULL["Hv"], device="cuda")
    tok = make_tokens((rows, T), dtype, **FULL, device="cuda")
    pool = make_pool(state_dtype, FULL["Hv"], FULL["Dk"], FULL["Dv"], slots=GPU_SLOTS, device="cuda")
    pend = make_pending(dtype, FULL, length=L, slots=GPU_SLOTS, device="cuda")
    ref_pool, ref_pend = pool.clone(), clone_all(pend)
    replay, num_tokens = [r % (L + 1) for r in range(rows)], [1 + r % T for r in range(rows)]
    o = verify(gated_delta_verify_triton, pool, pend, tok, params, slots, replay, num_tokens)
    o_ref = verify(gated_delta_verify, ref_pool, ref_pend, tok, params, slots, replay, num_tokens)
    close(o, o_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)
    for n in pend:
        assert_same(pend[n], ref_pend[n])


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [FULL_CHUNK, FULL_CHUNK - 1], ids=["chunked", "token-by-token"])
@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", GPU_DTYPES)
def test_gpu_prefill_full_size(dtype, state_dtype, atol, rtol, chunk):
    lengths = [FULL_CHUNK - 1, FULL_CHUNK, FULL_CHUNK + 1, 1, 1000, 0, 3 * FULL_CHUNK]
    slots = torch.randperm(GPU_SLOTS, generator=torch.Generator().manual_seed(2))[: len(lengths)].tolist()
    has_init = [r % 2 == 0 for r in range(len(lengths))]
    params = make_params(FULL["Hv"], device="cuda")
    tok = make_tokens((sum(lengths),), dtype, **FULL, device="cuda")
    pool = make_pool(state_dtype, FULL["Hv"], FULL["Dk"], FULL["Dv"], slots=GPU_SLOTS, device="cuda")
    for s, init in zip(slots, has_init, strict=True):
        if not init:
            pool[s] = float("nan")
    ref_pool = pool.clone()
    o = prefill(gated_delta_prefill_varlen_triton, pool, tok, params, lengths, slots, has_init, chunk)
    o_ref = prefill(gated_delta_prefill_varlen, ref_pool, tok, params, lengths, slots, has_init, chunk)
    close(o, o_ref, atol, rtol)
    close(pool, ref_pool, atol, rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_norm_gate_full_size(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(512, FULL["Hv"], FULL["Dv"], generator=g, device="cuda").to(dtype)
    gate = torch.randn(512, FULL["Hv"], FULL["Dv"], generator=g, device="cuda").to(dtype)
    weight = (1.0 + 0.1 * torch.randn(FULL["Dv"], generator=g, device="cuda")).to(dtype)
    atol, rtol = (2e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5, 1e-5)
    close(norm_gate_triton(x, gate, weight, 1e-6), norm_gate_reference(x, gate, weight, 1e-6), atol, rtol)


def test_decode_launch_takes_the_last_entry_its_batch_reaches():
    from baton.engine.ops.gated_delta import tuning

    starts = [start for start, *_ in tuning.DECODE_LAUNCH]
    assert starts[0] == 1 and starts == sorted(set(starts))
    for i, (start, *launch) in enumerate(tuning.DECODE_LAUNCH):
        end = starts[i + 1] if i + 1 < len(starts) else start + 1000
        assert {tuning.decode_launch(b) for b in (start, end - 1)} == {tuning.DecodeLaunch(*launch)}
