"""Speculative-verify state ops (by replay) against the single-token decode ops (R3/R4).

A verify step first replays `replay[b]` recorded positions of the slot's last verify into its state
(stored once), then runs its T tokens from there without storing any per-position state, and records its
own inputs as the slot's pending ones. Every comparison here is bit for bit on CPU: each replayed or
verified position runs the single-token op's computation on the same batch and reads the state rounded
as the pool holds it.
"""

import math

import pytest
import torch
from torch import Tensor

from baton.engine.ops.conv.reference import causal_conv1d_update, causal_conv1d_update_verify
from baton.engine.ops.ssm_update.reference import selective_state_update, selective_state_update_verify

H, P, N, G = 4, 8, 16, 2
CHANNELS, WIDTH = 24, 4
NUM_SLOTS = 24
PENDING = 6  # L: recorded positions per slot (>= the largest T used here)
DT_MIN = 1e-3
BATCH = 3
SLOTS = [5, 0, 11]  # the verify rows' slots
PLAIN = [20, 21, 22]  # a non-speculative run's slots
SCRATCH = [16, 17, 18]  # slots a reference decode may scribble on (rows with nothing left to feed)

# (input dtype, pool dtype); the pending inputs are kept in the input dtype, as the engine's pools are.
SSM_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-bf16state"),
    pytest.param(torch.float16, torch.float32, id="fp16-fp32state"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32-bf16state"),
]
CONV_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]


def assert_same(actual: Tensor, expected: Tensor) -> None:
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


def t64(values) -> Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---- SSM -----------------------------------------------------------------------------------------


def ssm_params(seed: int = 0) -> dict[str, Tensor]:
    """Like a trained Mamba2 layer: dt around 1e-3 .. 1e-1 after softplus, A in [-16, -1]."""
    g = torch.Generator().manual_seed(seed)
    A = -torch.exp(torch.rand(H, generator=g) * math.log(16.0))  # [H]
    dt0 = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-1), generator=g))
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))  # [H], inverse softplus of dt0
    D = torch.randn(H, generator=g)  # [H]
    return dict(A=A, D=D, dt_bias=dt_bias)


def ssm_tokens(batch: int, T: int, dtype: torch.dtype, seed: int = 1) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, T, H, P, generator=g).to(dtype),  # [B, T, H, P]
        dt=torch.randn(batch, T, H, generator=g).to(dtype),  # [B, T, H]
        B=torch.randn(batch, T, G, N, generator=g).to(dtype),  # [B, T, G, N]
        C=torch.randn(batch, T, G, N, generator=g).to(dtype),  # [B, T, G, N]
    )


def ssm_pool(dtype: torch.dtype, seed: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(NUM_SLOTS, H, P, N, generator=g).to(dtype)  # [S, H, P, N]


def ssm_pending(dtype: torch.dtype, length: int = PENDING, seed: int = 3) -> dict[str, Tensor]:
    """Recorded inputs of each slot's last verify: x [S, L, H, P], B [S, L, G, N], raw dt [S, L, H]."""
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(NUM_SLOTS, length, H, P, generator=g).to(dtype),
        B=torch.randn(NUM_SLOTS, length, G, N, generator=g).to(dtype),
        dt=torch.randn(NUM_SLOTS, length, H, generator=g).to(dtype),
    )


def ssm_case(T: int, dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 1):
    """Params, tokens [B, T, ...], a pool and recorded inputs (in the input dtype)."""
    return ssm_params(), ssm_tokens(BATCH, T, dtype, seed=seed), ssm_pool(state_dtype), ssm_pending(dtype)


def clone_all(d: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in d.items()}


def ssm_verify(pool, pend, tok, params, slots, replay, num_tokens=None) -> Tensor:
    return selective_state_update_verify(
        pool, pend["x"], pend["B"], pend["dt"], tok["x"], tok["dt"], params["A"], tok["B"], tok["C"],
        params["D"], params["dt_bias"], t64(slots), t64(replay), DT_MIN,
        None if num_tokens is None else t64(num_tokens),
    )  # fmt: skip


def ssm_decode(pool, x, dt, B, C, params, slots) -> Tensor:
    A, D, dt_bias = params["A"], params["D"], params["dt_bias"]
    return selective_state_update(pool, x, dt, A, B, C, D, dt_bias, t64(slots), DT_MIN)


def ssm_replay_by_decode(pool, pend, params, slots, replay) -> None:
    """Feed each row's first replay[b] recorded positions through the decode op, the whole batch per step;
    a row with nothing left steps into a scratch slot (ignored)."""
    for j in range(max(replay)):
        rows = [s if j < r else SCRATCH[b] for b, (s, r) in enumerate(zip(slots, replay, strict=True))]
        idx = t64(slots)
        C = torch.zeros(len(slots), G, N)
        ssm_decode(pool, pend["x"][idx, j], pend["dt"][idx, j], pend["B"][idx, j], C, params, rows)


def ssm_decode_tokens(pool, tok, params, slots) -> Tensor:
    """T decode steps of every row from pool[slots]: y [B, T, H, P]."""
    return torch.stack([ssm_decode(pool, tok["x"][:, t], tok["dt"][:, t], tok["B"][:, t], tok["C"][:, t],
                                   params, slots) for t in range(tok["x"].shape[1])], dim=1)  # fmt: skip


def assert_ssm_recorded(pend, before, tok, slots, T) -> None:
    """pending[slots, :T] holds this step's inputs; all else in the pending tensors is unchanged."""
    expected = clone_all(before)
    for k in ("x", "B", "dt"):
        expected[k][t64(slots), :T] = tok[k].to(expected[k].dtype)
        assert_same(pend[k], expected[k])


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_single_token_equals_decode(dtype, state_dtype):
    """replay 0, T = 1: the decode op's y, nothing stored; the next step's replay of 1 commits exactly the
    decode op's state."""
    params, tok, pool, pend = ssm_case(1, dtype, state_dtype)
    before, pend_before, ref_pool = pool.clone(), clone_all(pend), pool.clone()
    y_ref = ssm_decode_tokens(ref_pool, tok, params, SLOTS)[:, 0]
    y = ssm_verify(pool, pend, tok, params, SLOTS, [0] * BATCH)
    assert y.shape == (BATCH, 1, H, P) and y.dtype == dtype
    assert_same(y[:, 0], y_ref)
    assert_same(pool, before)
    assert_ssm_recorded(pend, pend_before, tok, SLOTS, 1)
    ssm_verify(pool, pend, ssm_tokens(BATCH, 1, dtype, seed=9), params, SLOTS, [1] * BATCH)
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_ssm_equals_repeated_single_token(T, dtype, state_dtype):
    params, tok, pool, pend = ssm_case(T, dtype, state_dtype, seed=T)
    before, pend_before = pool.clone(), clone_all(pend)
    y_ref = ssm_decode_tokens(pool.clone(), tok, params, SLOTS)
    y = ssm_verify(pool, pend, tok, params, SLOTS, [0] * BATCH)
    assert_same(y, y_ref)
    assert_same(pool, before)  # no per-position state is stored
    assert_ssm_recorded(pend, pend_before, tok, SLOTS, T)


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
@pytest.mark.parametrize("replay", [[1, 1, 1], [2, 0, 3], [PENDING, 1, 0]], ids=["r1", "r203", "rL10"])
def test_ssm_replay_equals_decode_then_continues(replay, dtype, state_dtype):
    T = 3
    params, tok, pool, pend = ssm_case(T, dtype, state_dtype)
    before, pend_before, ref_pool = pool.clone(), clone_all(pend), pool.clone()
    ssm_replay_by_decode(ref_pool, pend, params, SLOTS, replay)
    committed = ref_pool.clone()
    y_ref = ssm_decode_tokens(ref_pool, tok, params, SLOTS)
    y = ssm_verify(pool, pend, tok, params, SLOTS, replay)
    assert_same(y, y_ref)
    assert_same(pool[SLOTS], committed[SLOTS])  # the replayed state, stored once
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])
    assert_ssm_recorded(pend, pend_before, tok, SLOTS, T)


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_chain_equals_decode_of_accepted_tokens(dtype, state_dtype):
    """R4 over verify rounds: step n+1 replays the a+1 positions step n accepted and commits bit for bit
    the state of a non-speculative decode over those tokens, for every a in 0..K (row b accepts (n+b) % T
    at step n)."""
    K = 3
    T = 1 + K
    params, pool, pend = ssm_params(), ssm_pool(state_dtype), ssm_pending(dtype, length=T)
    pool[PLAIN] = pool[SLOTS]
    replay = [0] * BATCH
    for n in range(T + 1):
        tok = ssm_tokens(BATCH, T, dtype, seed=100 + n)
        y = ssm_verify(pool, pend, tok, params, SLOTS, replay)
        for b in range(BATCH):
            assert_same(pool[SLOTS[b]], pool[PLAIN[b]])
        accepted = [(n + b) % T for b in range(BATCH)]
        for t in range(T):
            rows = [PLAIN[b] if t <= accepted[b] else SCRATCH[b] for b in range(BATCH)]
            step = {k: v[:, t : t + 1] for k, v in tok.items()}
            y_plain = ssm_decode_tokens(pool, step, params, rows)[:, 0]
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(y[b, t], y_plain[b])
        replay = [a + 1 for a in accepted]


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_short_rows(dtype, state_dtype):
    """num_tokens < T: y is zero past it and equals the full row's y before it; the state and the
    recorded inputs (all T positions) are those of the full rows."""
    T = 4
    params, tok, pool, pend = ssm_case(T, dtype, state_dtype)
    replay, num_tokens = [2, 0, 1], [1, 4, 2]
    full_pool, full_pend = pool.clone(), clone_all(pend)
    y_full = ssm_verify(full_pool, full_pend, tok, params, SLOTS, replay)
    y = ssm_verify(pool, pend, tok, params, SLOTS, replay, num_tokens)
    for b, n in enumerate(num_tokens):
        assert_same(y[b, :n], y_full[b, :n])
        assert (y[b, n:] == 0).all()
    assert_same(pool, full_pool)
    for k in pend:
        assert_same(pend[k], full_pend[k])


def test_ssm_unnamed_slots_untouched():
    T = 3
    params, tok = ssm_params(), ssm_tokens(BATCH, T, torch.float32)
    real_pool, real_pend = ssm_pool(torch.float32), ssm_pending(torch.float32)
    pool = torch.full_like(real_pool, float("nan"))
    pend = {k: torch.full_like(v, float("nan")) for k, v in real_pend.items()}
    pool[SLOTS] = real_pool[SLOTS]
    for k in pend:
        pend[k][SLOTS] = real_pend[k][SLOTS]
    y = ssm_verify(pool, pend, tok, params, SLOTS, [3, 0, PENDING], [2, 3, 1])
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        tensors = [pool[s]] + [v[s] for v in pend.values()]
        assert all(torch.isfinite(v).all() if s in SLOTS else torch.isnan(v).all() for v in tensors), s


FN_SSM = "selective_state_update_verify"


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("x", (BATCH, 2, H, P + 1), "ssm_state"),
        ("dt", (BATCH, 2, H + 1), "dt"),
        ("B", (BATCH, 3, G, N), "B"),
        ("C", (BATCH, 2, G, N + 1), "C"),
        ("A", (H + 1,), "A"),
        ("D", (H, 1), "D"),
        ("dt_bias", (H - 1,), "dt_bias"),
        ("slots", (BATCH + 1,), "slots"),
        ("replay", (BATCH, 1), "replay"),
        ("num_tokens", (BATCH, 1), "num_tokens"),
        ("pending_x", (NUM_SLOTS, PENDING, H, P + 1), "pending_x"),
        ("pending_B", (NUM_SLOTS, PENDING - 1, G, N), "pending_B"),
        ("pending_dt", (NUM_SLOTS + 1, PENDING, H), "pending_dt"),
        ("pending_x", (NUM_SLOTS, 1, H, P), "pending_x"),  # L = 1 < T = 2
        ("ssm_state", (NUM_SLOTS, H, P), "expected x"),
    ],
)
def test_ssm_bad_shapes_raise(name, shape, match):
    T = 2
    params, tok, pool, pend = ssm_case(T, torch.float32, torch.float32)
    args = dict(
        ssm_state=pool, pending_x=pend["x"], pending_B=pend["B"], pending_dt=pend["dt"], x=tok["x"],
        dt=tok["dt"], A=params["A"], B=tok["B"], C=tok["C"], D=params["D"], dt_bias=params["dt_bias"],
        slots=t64([20, 21, 22]), replay=t64([0, 1, 2]), dt_min=DT_MIN, num_tokens=torch.full((BATCH,), T),
    )  # fmt: skip
    if name == "pending_x" and shape[1] < T:  # a pending length below T, every pending tensor alike
        args["pending_B"], args["pending_dt"] = pend["B"][:, :1], pend["dt"][:, :1]
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=rf"{FN_SSM}: .*\b{match}\b.*got"):
        selective_state_update_verify(**args)


INDEX_CASES = [
    ([20, 21, 22], [0, 1, 2], [2, 0, 2], "num_tokens expected values in \\[1, 2\\], got \\[2, 0, 2\\]"),
    ([20, 21, 22], [0, 1, 2], [2, 3, 2], "num_tokens expected values in \\[1, 2\\]"),
    ([20, 21, NUM_SLOTS], [0, 1, 2], [2, 2, 2], f"slots expected values in \\[0, {NUM_SLOTS}\\), got"),
    ([20, -1, 22], [0, 1, 2], [2, 2, 2], "slots expected values in"),
    ([20, 21, 20], [0, 1, 2], [2, 2, 2], "slots expected distinct slots, got \\[20, 21, 20\\]"),
    ([20, 21, 22], [0, -1, 2], [2, 2, 2], f"replay expected values in \\[0, {PENDING}\\], got"),
    ([20, 21, 22], [0, PENDING + 1, 2], [2, 2, 2], "replay expected values in"),
    ([20, 21, 22], [0, PENDING, 2], [2, 1, 2], None),  # replay = L and a short row: fine
]


@pytest.mark.parametrize("slots,replay,num_tokens,match", INDEX_CASES)
def test_ssm_bad_indices_raise(slots, replay, num_tokens, match):
    params, tok, pool, pend = ssm_case(2, torch.float32, torch.float32)
    before = pool.clone()
    if match is None:
        ssm_verify(pool, pend, tok, params, slots, replay, num_tokens)
        return
    with pytest.raises(ValueError, match=f"{FN_SSM}: {match}"):
        ssm_verify(pool, pend, tok, params, slots, replay, num_tokens)
    assert_same(pool, before)  # checked before anything is written


# ---- conv ----------------------------------------------------------------------------------------


def conv_layer(dtype: torch.dtype, width: int = WIDTH, with_bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(CHANNELS, width, generator=g) / width**0.5).to(dtype)  # [C, K]
    bias = torch.randn(CHANNELS, generator=g).to(dtype) if with_bias else None  # [C]
    return weight, bias


def conv_inputs(batch: int, T: int, dtype: torch.dtype, width: int = WIDTH, seed: int = 1):
    """x [B, T, C], a pool [S, C, K-1] and recorded inputs [S, L, C], all in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, CHANNELS, generator=g).to(dtype)  # [B, T, C]
    pool = torch.randn(NUM_SLOTS, CHANNELS, width - 1, generator=g).to(dtype)  # [S, C, K-1]
    pending = torch.randn(NUM_SLOTS, PENDING, CHANNELS, generator=g).to(dtype)  # [S, L, C]
    return x, pool, pending


def conv_verify(x, weight, bias, pool, pending, slots, replay, num_tokens=None) -> Tensor:
    nt = None if num_tokens is None else t64(num_tokens)
    return causal_conv1d_update_verify(x, weight, bias, pool, pending, t64(slots), t64(replay), nt)


def conv_replay_by_decode(weight, bias, pool, pending, slots, replay) -> None:
    for j in range(max(replay)):
        rows = [s if j < r else SCRATCH[b] for b, (s, r) in enumerate(zip(slots, replay, strict=True))]
        causal_conv1d_update(pending[t64(slots), j], weight, bias, pool, t64(rows))


def conv_decode_tokens(x, weight, bias, pool, slots) -> Tensor:
    ys = [causal_conv1d_update(x[:, t], weight, bias, pool, t64(slots)) for t in range(x.shape[1])]
    return torch.stack(ys, dim=1)


def assert_conv_recorded(pending, before, x, slots, T) -> None:
    expected = before.clone()
    expected[t64(slots), :T] = x.to(expected.dtype)
    assert_same(pending, expected)


@pytest.mark.parametrize("dtype", CONV_DTYPES)
@pytest.mark.parametrize("width,with_bias", [(WIDTH, True), (WIDTH, False), (2, True), (1, True)])
def test_conv_single_token_equals_decode(dtype, width, with_bias):
    weight, bias = conv_layer(dtype, width, with_bias)
    x, pool, pending = conv_inputs(BATCH, 1, dtype, width)
    before, pend_before, ref_pool = pool.clone(), pending.clone(), pool.clone()
    y_ref = causal_conv1d_update(x[:, 0], weight, bias, ref_pool, t64(SLOTS))
    y = conv_verify(x, weight, bias, pool, pending, SLOTS, [0] * BATCH)
    assert y.shape == (BATCH, 1, CHANNELS) and y.dtype == dtype
    assert_same(y[:, 0], y_ref)
    assert_same(pool, before)
    assert_conv_recorded(pending, pend_before, x, SLOTS, 1)
    x_next = conv_inputs(BATCH, 1, dtype, width, seed=9)[0]
    conv_verify(x_next, weight, bias, pool, pending, SLOTS, [1] * BATCH)
    assert_same(pool, ref_pool)


@pytest.mark.parametrize("dtype", CONV_DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_conv_equals_repeated_single_token(T, dtype):
    weight, bias = conv_layer(dtype)
    x, pool, pending = conv_inputs(BATCH, T, dtype, seed=T)
    before, pend_before = pool.clone(), pending.clone()
    y_ref = conv_decode_tokens(x, weight, bias, pool.clone(), SLOTS)
    y = conv_verify(x, weight, bias, pool, pending, SLOTS, [0] * BATCH)
    assert_same(y, y_ref)
    assert_same(pool, before)
    assert_conv_recorded(pending, pend_before, x, SLOTS, T)


@pytest.mark.parametrize("dtype", CONV_DTYPES)
@pytest.mark.parametrize("width", [WIDTH, 2])
@pytest.mark.parametrize("replay", [[1, 1, 1], [2, 0, 3], [PENDING, 1, 0]], ids=["r1", "r203", "rL10"])
def test_conv_replay_equals_decode_then_continues(replay, width, dtype):
    T = 3
    weight, bias = conv_layer(dtype, width)
    x, pool, pending = conv_inputs(BATCH, T, dtype, width)
    before, pend_before, ref_pool = pool.clone(), pending.clone(), pool.clone()
    conv_replay_by_decode(weight, bias, ref_pool, pending, SLOTS, replay)
    committed = ref_pool.clone()
    y_ref = conv_decode_tokens(x, weight, bias, ref_pool, SLOTS)
    y = conv_verify(x, weight, bias, pool, pending, SLOTS, replay)
    assert_same(y, y_ref)
    assert_same(pool[SLOTS], committed[SLOTS])
    others = [s for s in range(NUM_SLOTS) if s not in SLOTS]
    assert_same(pool[others], before[others])
    assert_conv_recorded(pending, pend_before, x, SLOTS, T)


@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_conv_chain_equals_decode_of_accepted_tokens(dtype):
    K = 3
    T = 1 + K
    weight, bias = conv_layer(dtype)
    _, pool, pending = conv_inputs(BATCH, T, dtype)
    pending = pending[:, :T].clone()
    pool[PLAIN] = pool[SLOTS]
    replay = [0] * BATCH
    for n in range(T + 1):
        x = conv_inputs(BATCH, T, dtype, seed=100 + n)[0]
        y = conv_verify(x, weight, bias, pool, pending, SLOTS, replay)
        for b in range(BATCH):
            assert_same(pool[SLOTS[b]], pool[PLAIN[b]])
        accepted = [(n + b) % T for b in range(BATCH)]
        for t in range(T):
            rows = [PLAIN[b] if t <= accepted[b] else SCRATCH[b] for b in range(BATCH)]
            y_plain = causal_conv1d_update(x[:, t], weight, bias, pool, t64(rows))
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(y[b, t], y_plain[b])
        replay = [a + 1 for a in accepted]


@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_conv_short_rows(dtype):
    T = 4
    weight, bias = conv_layer(dtype)
    x, pool, pending = conv_inputs(BATCH, T, dtype)
    replay, num_tokens = [2, 0, 1], [1, 4, 2]
    full_pool, full_pending = pool.clone(), pending.clone()
    y_full = conv_verify(x, weight, bias, full_pool, full_pending, SLOTS, replay)
    y = conv_verify(x, weight, bias, pool, pending, SLOTS, replay, num_tokens)
    for b, n in enumerate(num_tokens):
        assert_same(y[b, :n], y_full[b, :n])
        assert (y[b, n:] == 0).all()
    assert_same(pool, full_pool)
    assert_same(pending, full_pending)


def test_conv_unnamed_slots_untouched():
    T = 3
    weight, bias = conv_layer(torch.float32)
    x, real_pool, real_pending = conv_inputs(BATCH, T, torch.float32)
    pool, pending = torch.full_like(real_pool, float("nan")), torch.full_like(real_pending, float("nan"))
    pool[SLOTS], pending[SLOTS] = real_pool[SLOTS], real_pending[SLOTS]
    y = conv_verify(x, weight, bias, pool, pending, SLOTS, [3, 0, PENDING], [2, 3, 1])
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        for v in (pool[s], pending[s]):
            assert torch.isfinite(v).all() if s in SLOTS else torch.isnan(v).all(), s


FN_CONV = "causal_conv1d_update_verify"


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("x", (BATCH, 2), "expected x"),
        ("weight", (CHANNELS + 1, WIDTH), "weight"),
        ("bias", (CHANNELS + 1,), "bias"),
        ("conv_state", (NUM_SLOTS, CHANNELS, WIDTH), "conv_state"),
        ("pending", (NUM_SLOTS, PENDING, CHANNELS + 1), "pending"),
        ("pending", (NUM_SLOTS + 1, PENDING, CHANNELS), "pending"),
        ("pending", (NUM_SLOTS, 1, CHANNELS), "pending"),  # L = 1 < T = 2
        ("slots", (BATCH, 1), "slots"),
        ("replay", (BATCH + 1,), "replay"),
        ("num_tokens", (BATCH - 1,), "num_tokens"),
    ],
)
def test_conv_bad_shapes_raise(name, shape, match):
    T = 2
    weight, bias = conv_layer(torch.float32)
    x, pool, pending = conv_inputs(BATCH, T, torch.float32)
    args = dict(
        x=x, weight=weight, bias=bias, conv_state=pool, pending=pending, slots=t64([20, 21, 22]),
        replay=t64([0, 1, 2]), num_tokens=torch.full((BATCH,), T),
    )  # fmt: skip
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=rf"{FN_CONV}: .*\b{match}\b.*got"):
        causal_conv1d_update_verify(**args)


@pytest.mark.parametrize("slots,replay,num_tokens,match", INDEX_CASES)
def test_conv_bad_indices_raise(slots, replay, num_tokens, match):
    weight, bias = conv_layer(torch.float32)
    x, pool, pending = conv_inputs(BATCH, 2, torch.float32)
    before = pool.clone()
    if match is None:
        conv_verify(x, weight, bias, pool, pending, slots, replay, num_tokens)
        return
    with pytest.raises(ValueError, match=f"{FN_CONV}: {match}"):
        conv_verify(x, weight, bias, pool, pending, slots, replay, num_tokens)
    assert_same(pool, before)
