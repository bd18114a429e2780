"""Gated DeltaNet ops (decode, varlen chunked prefill, verify by replay) against HF Qwen3.5's torch recurrences, and
the norm-then-gate RMSNorm against HF's `Qwen3_5RMSNormGated`.

The comparisons with HF are within per-dtype tolerances (HF gets the same fp32 g and beta). Verify against decode is
bit for bit on CPU: each replayed or verified position runs the decode op's computation on the same batch rows and
reads the state rounded as the pool holds it.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from baton.engine.ops.gated_delta.reference import (
    gated_delta_decode,
    gated_delta_prefill_varlen,
    gated_delta_verify,
)
from baton.engine.ops.norm.reference import norm_gate_reference

HK, HV, DK, DV = 2, 4, 8, 6
NUM_SLOTS = 16
CHUNK = 4
# Row lengths around the chunk size: 1, 2, chunk-1, chunk, chunk+1, 2*chunk+3.
LENGTHS = [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]
ROW_SLOTS = [7, 2, 9, 0, 4, 5]
HAS_INIT = [True, False, True, False, True, True]
BATCH = 3
SLOTS = [5, 0, 11]  # the decode / verify rows' slots
PLAIN = [12, 13, 14]  # a non-speculative run's slots
SCRATCH = [8, 9, 10]  # slots a reference decode may scribble on (rows with nothing left to feed)
PENDING = 4  # L: recorded positions per slot (>= the largest T used with verify)

# (input dtype, pool dtype, atol, rtol): bf16 rounds the inputs HF also sees, then the output (and a bf16 pool
# the state) once more.
DTYPES = [
    pytest.param(torch.float32, torch.float32, 2e-5, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, 2e-2, 2e-2, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, 3e-2, 2e-2, id="bf16-bf16state"),
    pytest.param(torch.float32, torch.bfloat16, 3e-2, 2e-2, id="fp32-bf16state"),
]
# (input dtype, pool dtype) of the bit-exact verify tests; the pending inputs are kept in the input dtype.
VERIFY_DTYPES = [pytest.param(p.values[0], p.values[1], id=p.id) for p in DTYPES]


def t64(values) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


def assert_same(actual: Tensor, expected: Tensor) -> None:
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


def assert_close(actual: Tensor, expected: Tensor, atol: float, rtol: float) -> None:
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=atol, rtol=rtol)


def make_params(seed: int = 0) -> dict[str, Tensor]:
    """A_log and dt_bias [Hv] giving per-token decays exp(g) of about 0.6 .. 0.99: a state carries over a row."""
    g = torch.Generator().manual_seed(seed)
    A_log = torch.empty(HV).uniform_(math.log(0.05), math.log(1.0), generator=g)
    dt_bias = torch.empty(HV).uniform_(-3.0, 0.0, generator=g)
    return dict(A_log=A_log, dt_bias=dt_bias)


def make_tokens(lead: tuple[int, ...], dtype: torch.dtype, seed: int = 1) -> dict[str, Tensor]:
    """Raw inputs with leading dims `lead`: q, k [*, Hk, Dk], v [*, Hv, Dv], a, b [*, Hv]."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        q=torch.randn(*lead, HK, DK, generator=g).to(dtype),
        k=torch.randn(*lead, HK, DK, generator=g).to(dtype),
        v=torch.randn(*lead, HV, DV, generator=g).to(dtype),
        a=torch.randn(*lead, HV, generator=g).to(dtype),
        b=torch.randn(*lead, HV, generator=g).to(dtype),
    )


def make_pool(state_dtype: torch.dtype, seed: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(NUM_SLOTS, HV, DK, DV, generator=g)).to(state_dtype)  # [S, Hv, Dk, Dv]


def make_pending(dtype: torch.dtype, length: int = PENDING, seed: int = 3) -> dict[str, Tensor]:
    """Recorded raw inputs of each slot's last verify: k [S, L, Hk, Dk], v [S, L, Hv, Dv], a, b [S, L, Hv]."""
    tok = make_tokens((NUM_SLOTS, length), dtype, seed)
    return {n: tok[n] for n in ("k", "v", "a", "b")}


def clone_all(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: v.clone() for n, v in d.items()}


def qsl(lengths: list[int]) -> Tensor:
    return t64([0, *torch.tensor(lengths).cumsum(0).tolist()])


def hf(tok: dict[str, Tensor], params: dict[str, Tensor], initial: Tensor | None, chunked: bool):
    """HF's recurrence over tok [1, L, ...] (one row) from `initial` [Hv, Dk, Dv]: (o [L, Hv, Dv], final state)."""
    g = -params["A_log"].float().exp() * F.softplus(tok["a"].float() + params["dt_bias"])
    beta = tok["b"].float().sigmoid()
    init = None if initial is None else initial.float()[None]
    fn = torch_chunk_gated_delta_rule if chunked else torch_recurrent_gated_delta_rule
    extra = dict(chunk_size=CHUNK) if chunked else {}
    o, state = fn(tok["q"], tok["k"], tok["v"], g, beta, initial_state=init, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, **extra)
    return o[0], state[0]


def decode(pool: Tensor, tok: dict[str, Tensor], params: dict[str, Tensor], slots) -> Tensor:
    return gated_delta_decode(pool, tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], params["A_log"],
                              params["dt_bias"], t64(slots))


def prefill(pool: Tensor, tok: dict[str, Tensor], params: dict[str, Tensor], lengths, slots, has_init,
            chunk: int = CHUNK) -> Tensor:
    return gated_delta_prefill_varlen(pool, tok["q"], tok["k"], tok["v"], tok["a"], tok["b"], params["A_log"],
                                      params["dt_bias"], qsl(lengths), t64(slots), torch.tensor(has_init), chunk)


def step(tok: dict[str, Tensor], t: int) -> dict[str, Tensor]:
    return {n: v[:, t] for n, v in tok.items()}


# ---- decode ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_decode_matches_hf_and_leaves_other_slots(dtype, state_dtype, atol, rtol):
    params, tok, pool = make_params(), make_tokens((BATCH,), dtype), make_pool(state_dtype)
    before = pool.clone()
    o = decode(pool, tok, params, SLOTS)
    assert o.shape == (BATCH, HV, DV) and o.dtype == dtype
    for r, s in enumerate(SLOTS):
        o_ref, state_ref = hf({n: v[r : r + 1, None] for n, v in tok.items()}, params, before[s], chunked=False)
        assert_close(o[r], o_ref[0], atol, rtol)
        assert_close(pool[s], state_ref, atol, rtol)
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])


FN_DECODE = "gated_delta_decode"


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("k", (BATCH, HK, DK + 1), "k"),
        ("v", (BATCH, HV, DV + 1), "state"),
        ("a", (BATCH, HV + 1), "a"),
        ("b", (BATCH - 1, HV), "b"),
        ("A_log", (HV, 1), "A_log"),
        ("dt_bias", (HV + 1,), "dt_bias"),
        ("state_slots", (BATCH + 1,), "state_slots"),
        ("state", (NUM_SLOTS, HV, DK + 1, DV), "state"),
        ("q", (BATCH, HK, DK, 1), "expected q"),
        ("q", (BATCH, 3, DK), "Hk"),  # Hv = 4 is no multiple of Hk = 3 (k alike)
    ],
)
def test_decode_bad_shapes_raise(name, shape, match):
    params, tok, pool = make_params(), make_tokens((BATCH,), torch.float32), make_pool(torch.float32)
    args = dict(state=pool, **tok, A_log=params["A_log"], dt_bias=params["dt_bias"], state_slots=t64(SLOTS))
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    if name == "q" and shape[1] == 3:
        args["k"] = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"{FN_DECODE}: .*\b{match}\b.*got"):
        gated_delta_decode(**args)


@pytest.mark.parametrize(
    "slots,match",
    [([5, 0, NUM_SLOTS], f"state_slots expected values in \\[0, {NUM_SLOTS}\\), got"),
     ([5, -1, 11], "state_slots expected values in"),
     ([5, 0, 5], "state_slots expected distinct slots, got \\[5, 0, 5\\]")],
)  # fmt: skip
def test_decode_bad_slots_raise(slots, match):
    params, tok, pool = make_params(), make_tokens((BATCH,), torch.float32), make_pool(torch.float32)
    before = pool.clone()
    with pytest.raises(ValueError, match=f"{FN_DECODE}: {match}"):
        decode(pool, tok, params, slots)
    assert_same(pool, before)


# ---- prefill ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_prefill_matches_hf_per_row(dtype, state_dtype, atol, rtol):
    """Each row of one varlen batch equals HF's chunked rule on that row alone, from its slot's state or from
    zeros (a new row's slot holds garbage that must never be read)."""
    params, tok, pool = make_params(), make_tokens((sum(LENGTHS),), dtype), make_pool(state_dtype)
    for s, init in zip(ROW_SLOTS, HAS_INIT, strict=True):
        if not init:
            pool[s] = float("nan")
    before = pool.clone()
    o = prefill(pool, tok, params, LENGTHS, ROW_SLOTS, HAS_INIT)
    assert o.shape == (sum(LENGTHS), HV, DV) and o.dtype == dtype
    bounds = qsl(LENGTHS).tolist()
    for r, (s, init) in enumerate(zip(ROW_SLOTS, HAS_INIT, strict=True)):
        lo, hi = bounds[r], bounds[r + 1]
        o_ref, state_ref = hf({n: v[None, lo:hi] for n, v in tok.items()}, params, before[s] if init else None,
                              chunked=True)
        assert_close(o[lo:hi], o_ref, atol, rtol)
        assert_close(pool[s], state_ref, atol, rtol)
    others = [s for s in range(NUM_SLOTS) if s not in ROW_SLOTS]
    assert_same(pool[others], before[others])


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("split", [1, CHUNK, 6])
def test_prefill_split_in_two_calls_equals_one(split, dtype, state_dtype, atol, rtol):
    """A row prefilled as two chunks (the second from the first's stored state) equals one call."""
    length, slot = 2 * CHUNK + 3, 3
    params, tok, pool = make_params(), make_tokens((length,), dtype), make_pool(state_dtype)
    one = pool.clone()
    o_one = prefill(one, tok, params, [length], [slot], [True])
    first = {n: v[:split] for n, v in tok.items()}
    second = {n: v[split:] for n, v in tok.items()}
    o_a = prefill(pool, first, params, [split], [slot], [True])
    o_b = prefill(pool, second, params, [length - split], [slot], [True])
    assert_close(torch.cat([o_a, o_b]), o_one, atol, rtol)
    assert_close(pool, one, atol, rtol)


@pytest.mark.parametrize("dtype,state_dtype,atol,rtol", DTYPES)
def test_prefill_then_decode_equals_hf(dtype, state_dtype, atol, rtol):
    """Prefill of n tokens, then one decode step: HF's rule over the n+1 tokens from zeros (R1's h(N-1) hand-off)."""
    n, slot = CHUNK + 1, 6
    params, tok, pool = make_params(), make_tokens((n + 1,), dtype), make_pool(state_dtype)
    prefill(pool, {k: v[:n] for k, v in tok.items()}, params, [n], [slot], [False])
    o = decode(pool, {k: v[n:] for k, v in tok.items()}, params, [slot])
    o_ref, state_ref = hf({k: v[None] for k, v in tok.items()}, params, None, chunked=True)
    assert_close(o[0], o_ref[n], atol, rtol)
    assert_close(pool[slot], state_ref, atol, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_equal_prefill(dtype):
    """T tokens decoded one by one equal one prefill of the T tokens (fp32 pool, fp32 tolerance)."""
    T = 2 * CHUNK + 1
    params, tok, pool = make_params(), make_tokens((BATCH, T), dtype), make_pool(torch.float32)
    stepped = pool.clone()
    o_steps = torch.stack([decode(stepped, step(tok, t), params, SLOTS) for t in range(T)], dim=1)
    o = prefill(pool, {n: v.flatten(0, 1) for n, v in tok.items()}, params, [T] * BATCH, SLOTS, [True] * BATCH)
    atol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: the outputs' own rounding
    assert_close(o.view(BATCH, T, HV, DV), o_steps, atol, 1e-4)
    assert_close(pool, stepped, 2e-5, 1e-4)


def test_prefill_empty_rows():
    """A row with no tokens keeps its slot's state (or zeroes it, when new) and outputs nothing."""
    params, tok, pool = make_params(), make_tokens((3,), torch.float32), make_pool(torch.float32)
    before = pool.clone()
    o = prefill(pool, tok, params, [0, 3, 0], [1, 2, 3], [True, True, False])
    assert o.shape == (3, HV, DV)
    assert_same(pool[1], before[1])
    assert (pool[3] == 0).all()


def test_prefill_bad_rows_raise():
    params, tok, pool = make_params(), make_tokens((5,), torch.float32), make_pool(torch.float32)
    fn = "gated_delta_prefill_varlen"
    with pytest.raises(ValueError, match=f"{fn}: query_start_loc expected non-decreasing from 0 to T = 5"):
        prefill(pool, tok, params, [2, 2], [0, 1], [True, True])
    with pytest.raises(ValueError, match=f"{fn}: state_slots expected distinct slots"):
        prefill(pool, tok, params, [2, 3], [1, 1], [True, True])
    with pytest.raises(ValueError, match=f"{fn}: state_slots expected values in"):
        prefill(pool, tok, params, [2, 3], [1, NUM_SLOTS], [True, True])
    with pytest.raises(ValueError, match=rf"{fn}: has_initial_state expected shape \[R\]"):
        prefill(pool, tok, params, [2, 3], [1, 2], [True])
    with pytest.raises(ValueError, match=rf"{fn}: v expected shape \[T, Hv, Dv\]"):
        prefill(pool, {**tok, "v": tok["v"][:4]}, params, [2, 3], [1, 2], [True, True])
    with pytest.raises(ValueError, match=f"{fn}: expected chunk_size > 0, got 0"):
        prefill(pool, tok, params, [2, 3], [1, 2], [True, True], chunk=0)


# ---- verify ----------------------------------------------------------------------------------------


def verify(pool, pend, tok, params, slots, replay, num_tokens=None) -> Tensor:
    return gated_delta_verify(
        pool, pend["k"], pend["v"], pend["a"], pend["b"], tok["q"], tok["k"], tok["v"], tok["a"], tok["b"],
        params["A_log"], params["dt_bias"], t64(slots), t64(replay), None if num_tokens is None else t64(num_tokens),
    )  # fmt: skip


def decode_tokens(pool, tok, params, slots) -> Tensor:
    """T decode steps of every row from pool[slots]: o [B, T, Hv, Dv]."""
    return torch.stack([decode(pool, step(tok, t), params, slots) for t in range(tok["v"].shape[1])], dim=1)


def replay_by_decode(pool, pend, params, slots, replay) -> None:
    """Feed each row's first replay[b] recorded positions through the decode op, the whole batch per step; a row
    with nothing left steps into a scratch slot (ignored)."""
    idx = t64(slots)
    for j in range(max(replay)):
        rows = [s if j < r else SCRATCH[b] for b, (s, r) in enumerate(zip(slots, replay, strict=True))]
        tok = {n: v[idx, j] for n, v in pend.items()}
        decode(pool, {**tok, "q": tok["k"]}, params, rows)


def assert_recorded(pend, before, tok, slots, T) -> None:
    """pending[slots, :T] holds this step's inputs; all else in the pending tensors is unchanged."""
    for n in ("k", "v", "a", "b"):
        expected = before[n].clone()
        expected[t64(slots), :T] = tok[n].to(expected.dtype)
        assert_same(pend[n], expected)


def verify_case(T: int, dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 1):
    return make_params(), make_tokens((BATCH, T), dtype, seed), make_pool(state_dtype), make_pending(dtype)


@pytest.mark.parametrize("dtype,state_dtype", VERIFY_DTYPES)
def test_verify_single_token_equals_decode(dtype, state_dtype):
    """replay 0, T = 1: the decode op's o, nothing stored; the next step's replay of 1 commits exactly the decode
    op's state."""
    params, tok, pool, pend = verify_case(1, dtype, state_dtype)
    before, pend_before, ref_pool = pool.clone(), clone_all(pend), pool.clone()
    o_ref = decode_tokens(ref_pool, tok, params, SLOTS)
    o = verify(pool, pend, tok, params, SLOTS, [0] * BATCH)
    assert o.shape == (BATCH, 1, HV, DV) and o.dtype == dtype
    assert_same(o, o_ref)
    assert_same(pool, before)
    assert_recorded(pend, pend_before, tok, SLOTS, 1)
    verify(pool, pend, make_tokens((BATCH, 1), dtype, seed=9), params, SLOTS, [1] * BATCH)
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("dtype,state_dtype", VERIFY_DTYPES)
@pytest.mark.parametrize("replay", [[0, 0, 0], [2, 0, 3], [PENDING, 1, 0]], ids=["r0", "r203", "rL10"])
def test_verify_replay_equals_decode_then_continues(replay, dtype, state_dtype):
    T = 3
    params, tok, pool, pend = verify_case(T, dtype, state_dtype)
    before, pend_before, ref_pool = pool.clone(), clone_all(pend), pool.clone()
    replay_by_decode(ref_pool, pend, params, SLOTS, replay)
    committed = ref_pool.clone()
    o_ref = decode_tokens(ref_pool, tok, params, SLOTS)
    o = verify(pool, pend, tok, params, SLOTS, replay)
    assert_same(o, o_ref)
    assert_same(pool[SLOTS], committed[SLOTS])  # the replayed state, stored once
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])
    assert_recorded(pend, pend_before, tok, SLOTS, T)


@pytest.mark.parametrize("dtype,state_dtype", VERIFY_DTYPES)
def test_verify_chain_equals_decode_of_accepted_tokens(dtype, state_dtype):
    """R4 over verify rounds: step n+1 replays the a+1 positions step n accepted and commits bit for bit the state
    of a non-speculative decode over those tokens, for random a in 0..K."""
    K = 3
    T = 1 + K
    params, pool, pend = make_params(), make_pool(state_dtype), make_pending(dtype, length=T)
    pool[PLAIN] = pool[SLOTS]
    gen = torch.Generator().manual_seed(7)
    replay = [0] * BATCH
    for n in range(4):
        tok = make_tokens((BATCH, T), dtype, seed=100 + n)
        o = verify(pool, pend, tok, params, SLOTS, replay)
        assert_same(pool[SLOTS], pool[PLAIN])
        accepted = torch.randint(0, T, (BATCH,), generator=gen).tolist()
        for t in range(T):
            rows = [PLAIN[b] if t <= accepted[b] else SCRATCH[b] for b in range(BATCH)]
            o_plain = decode(pool, step(tok, t), params, rows)
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(o[b, t], o_plain[b])
        replay = [a + 1 for a in accepted]
    verify(pool, pend, make_tokens((BATCH, T), dtype, seed=99), params, SLOTS, replay)
    assert_same(pool[SLOTS], pool[PLAIN])


@pytest.mark.parametrize("dtype,state_dtype", VERIFY_DTYPES)
def test_verify_short_rows(dtype, state_dtype):
    """num_tokens < T: o is zero past it and equals the full row's o before it; the state and the recorded inputs
    (all T positions) are those of the full rows."""
    T = 4
    params, tok, pool, pend = verify_case(T, dtype, state_dtype)
    replay, num_tokens = [2, 0, 1], [1, 4, 2]
    pend_before, full_pool, full_pend = clone_all(pend), pool.clone(), clone_all(pend)
    o_full = verify(full_pool, full_pend, tok, params, SLOTS, replay)
    o = verify(pool, pend, tok, params, SLOTS, replay, num_tokens)
    for b, n in enumerate(num_tokens):
        assert_same(o[b, :n], o_full[b, :n])
        assert (o[b, n:] == 0).all()
    assert_same(pool, full_pool)
    assert_recorded(pend, pend_before, tok, SLOTS, T)


def test_verify_unnamed_slots_untouched():
    T = 3
    params, tok = make_params(), make_tokens((BATCH, T), torch.float32)
    real_pool, real_pend = make_pool(torch.float32), make_pending(torch.float32)
    pool = torch.full_like(real_pool, float("nan"))
    pend = {n: torch.full_like(v, float("nan")) for n, v in real_pend.items()}
    pool[SLOTS] = real_pool[SLOTS]
    for n in pend:
        pend[n][SLOTS] = real_pend[n][SLOTS]
    o = verify(pool, pend, tok, params, SLOTS, [3, 0, PENDING], [2, 3, 1])
    assert torch.isfinite(o).all()
    for s in range(NUM_SLOTS):
        tensors = [pool[s]] + [v[s] for v in pend.values()]
        assert all(torch.isfinite(v).all() if s in SLOTS else torch.isnan(v).all() for v in tensors), s


FN_VERIFY = "gated_delta_verify"


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("k", (BATCH, 2, HK, DK + 1), "k"),
        ("v", (BATCH, 2, HV, DV + 1), "state"),
        ("a", (BATCH, 3, HV), "a"),
        ("b", (BATCH, 2, HV + 1), "b"),
        ("A_log", (HV + 1,), "A_log"),
        ("dt_bias", (HV, 1), "dt_bias"),
        ("slots", (BATCH + 1,), "slots"),
        ("replay", (BATCH, 1), "replay"),
        ("num_tokens", (BATCH, 1), "num_tokens"),
        ("pending_k", (NUM_SLOTS, PENDING, HK, DK + 1), "pending_k"),
        ("pending_v", (NUM_SLOTS, PENDING - 1, HV, DV), "pending_v"),
        ("pending_a", (NUM_SLOTS + 1, PENDING, HV), "pending_a"),
        ("pending_b", (NUM_SLOTS, PENDING, HV + 1), "pending_b"),
        ("pending_k", (NUM_SLOTS, 1, HK, DK), "pending_k"),  # L = 1 < T = 2
        ("state", (NUM_SLOTS, HV, DK), "expected q"),
    ],
)
def test_verify_bad_shapes_raise(name, shape, match):
    T = 2
    params, tok, pool, pend = verify_case(T, torch.float32, torch.float32)
    args = dict(
        state=pool, **{f"pending_{n}": v for n, v in pend.items()}, **tok, A_log=params["A_log"],
        dt_bias=params["dt_bias"], slots=t64(SLOTS), replay=t64([0, 1, 2]), num_tokens=torch.full((BATCH,), T),
    )  # fmt: skip
    if name == "pending_k" and shape[1] < T:  # a pending length below T, every pending tensor alike
        for n in ("v", "a", "b"):
            args[f"pending_{n}"] = pend[n][:, :1]
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=rf"{FN_VERIFY}: .*\b{match}\b.*got"):
        gated_delta_verify(**args)


@pytest.mark.parametrize(
    "slots,replay,num_tokens,match",
    [
        (SLOTS, [0, 1, 2], [2, 0, 2], "num_tokens expected values in \\[1, 2\\], got \\[2, 0, 2\\]"),
        (SLOTS, [0, 1, 2], [2, 3, 2], "num_tokens expected values in \\[1, 2\\]"),
        ([5, 0, NUM_SLOTS], [0, 1, 2], [2, 2, 2], f"slots expected values in \\[0, {NUM_SLOTS}\\), got"),
        ([5, 0, 5], [0, 1, 2], [2, 2, 2], "slots expected distinct slots, got \\[5, 0, 5\\]"),
        (SLOTS, [0, -1, 2], [2, 2, 2], f"replay expected values in \\[0, {PENDING}\\], got"),
        (SLOTS, [0, PENDING + 1, 2], [2, 2, 2], "replay expected values in"),
        (SLOTS, [0, PENDING, 2], [2, 1, 2], None),  # replay = L and a short row: fine
    ],
)
def test_verify_bad_indices_raise(slots, replay, num_tokens, match):
    params, tok, pool, pend = verify_case(2, torch.float32, torch.float32)
    before = pool.clone()
    if match is None:
        verify(pool, pend, tok, params, slots, replay, num_tokens)
        return
    with pytest.raises(ValueError, match=f"{FN_VERIFY}: {match}"):
        verify(pool, pend, tok, params, slots, replay, num_tokens)
    assert_same(pool, before)  # checked before anything is written


# ---- norm then gate --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_matches_hf(dtype):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, HV, DV, generator=g).to(dtype)
    gate = torch.randn(5, HV, DV, generator=g).to(dtype)
    module = Qwen3_5RMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.1 * torch.randn(DV, generator=g))
    module = module.to(dtype)
    with torch.no_grad():
        expected = module(x, gate)
    assert_same(norm_gate_reference(x, gate, module.weight.detach(), 1e-6), expected)
