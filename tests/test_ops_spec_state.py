"""Speculative-verify state ops against T calls of the single-token ops (R4: one state slot per position)."""

import math

import pytest
import torch
from torch import Tensor

from baton.engine.ops.causal_conv1d import causal_conv1d_update
from baton.engine.ops.selective_state_update import selective_state_update
from baton.engine.ops.spec_state_update import causal_conv1d_update_multi, selective_state_update_multi

H, P, N, G = 4, 8, 16, 2
CHANNELS, WIDTH = 24, 4
NUM_SLOTS = 24
DT_MIN = 1e-3
BATCH = 3
SCRATCH = [16, 17, 18]  # slots a reference run may scribble on

# (input dtype, pool dtype). Every comparison is bit for bit, bf16 included: each verify position runs
# the single-token op's computation on the same batch and reads the state rounded as the pool holds it.
SSM_DTYPES = [
    pytest.param(torch.float32, torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-fp32state"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-bf16state"),
]
CONV_DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def assert_same(actual: Tensor, expected: Tensor) -> None:
    assert actual.dtype == expected.dtype and torch.equal(actual, expected), (actual - expected).abs().max()


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


def ssm_multi(pool, tok, params, src, dst, num_tokens=None) -> Tensor:
    return selective_state_update_multi(
        pool, tok["x"], tok["dt"], params["A"], tok["B"], tok["C"], params["D"], params["dt_bias"],
        torch.tensor(src), torch.tensor(dst), DT_MIN,
        None if num_tokens is None else torch.tensor(num_tokens),
    )  # fmt: skip


def ssm_reference(pool: Tensor, tok, params, src: list[int], num_tokens: list[int]):
    """Single-token op once per position on a copy of the pool; returns y [B, T, H, P] (zero past
    num_tokens) and the state after each valid step. All rows step every time, as in the op: on CPU an
    elementwise exp may round differently with the batch size, and the claim is equality per batch."""
    pool = pool.clone()
    batch, T = tok["x"].shape[:2]
    y = torch.zeros_like(tok["x"])
    states: dict[tuple[int, int], Tensor] = {}
    for t in range(T):
        y[:, t] = selective_state_update(
            pool, tok["x"][:, t], tok["dt"][:, t], params["A"], tok["B"][:, t], tok["C"][:, t],
            params["D"], params["dt_bias"], torch.tensor(src), DT_MIN,
        )  # fmt: skip
        for b in range(batch):
            if t < num_tokens[b]:
                states[b, t] = pool[src[b]].clone()
            else:
                y[b, t] = 0
    return y, states


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_single_token_equals_existing_op(dtype, state_dtype):
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, 1, dtype), ssm_pool(state_dtype)
    src, dst = [5, 0, 11], [[7], [0], [3]]  # row 1 writes its own source slot
    ref_pool = pool.clone()
    y_ref = selective_state_update(
        ref_pool, tok["x"][:, 0], tok["dt"][:, 0], params["A"], tok["B"][:, 0], tok["C"][:, 0],
        params["D"], params["dt_bias"], torch.tensor(src), DT_MIN,
    )  # fmt: skip
    y = ssm_multi(pool, tok, params, src, dst)
    assert y.shape == (BATCH, 1, H, P) and y.dtype == dtype
    assert_same(y[:, 0], y_ref)
    for b in range(BATCH):
        assert_same(pool[dst[b][0]], ref_pool[src[b]])


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_ssm_equals_repeated_single_token(T, dtype, state_dtype):
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, T, dtype, seed=T), ssm_pool(state_dtype)
    src = [20, 21, 22]
    dst = [[b * T + t for t in range(T)] for b in range(BATCH)]
    y_ref, states = ssm_reference(pool, tok, params, src, [T] * BATCH)
    y = ssm_multi(pool, tok, params, src, dst)
    assert_same(y, y_ref)
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_src_slot_among_dst_slots(dtype, state_dtype):
    T = 4
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, T, dtype), ssm_pool(state_dtype)
    # The source is overwritten by position 0, a middle position and the last position respectively.
    src = [2, 9, 15]
    dst = [[2, 3, 4, 5], [8, 9, 10, 11], [12, 13, 14, 15]]
    y_ref, states = ssm_reference(pool, tok, params, src, [T] * BATCH)
    y = ssm_multi(pool, tok, params, src, dst)
    assert_same(y, y_ref)
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)


def test_ssm_unnamed_slots_untouched():
    T = 3
    params, tok = ssm_params(), ssm_tokens(BATCH, T, torch.float32)
    src = [1, 6, 12]
    dst = [[1, 2, 3], [7, 8, 9], [13, 14, 15]]
    pool = torch.full((NUM_SLOTS, H, P, N), float("nan"))
    pool[src] = ssm_pool(torch.float32)[src]
    y = ssm_multi(pool, tok, params, src, dst)
    named = {s for row in dst for s in row} | set(src)
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        assert torch.isfinite(pool[s]).all() if s in named else torch.isnan(pool[s]).all(), s


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_short_rows_leave_later_slots_untouched(dtype, state_dtype):
    T = 4
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, T, dtype), ssm_pool(state_dtype)
    src, num_tokens = [20, 21, 22], [1, 4, 2]
    # Padding past num_tokens: -1 (never read) or real slots that must keep their contents.
    dst = [[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, 10, 11]]
    before = pool.clone()
    y_ref, states = ssm_reference(pool, tok, params, src, num_tokens)
    y = ssm_multi(pool, tok, params, src, dst, num_tokens)
    assert_same(y, y_ref)
    assert (y[0, 1:] == 0).all() and (y[2, 2:] == 0).all()
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)
    assert torch.equal(pool[[10, 11]], before[[10, 11]])
    assert torch.equal(pool[12:], before[12:])


@pytest.mark.parametrize("dtype,state_dtype", SSM_DTYPES)
def test_ssm_resume_from_last_accepted_slot(dtype, state_dtype):
    """R4 over several verify rounds: each request owns 1+K slots, resumes from the slot of its last
    accepted position, and ends bit-identical to a non-speculative decode over the accepted tokens."""
    K, rounds = 3, 4
    T = 1 + K
    params, pool = ssm_params(), ssm_pool(state_dtype)
    owned = [[b * T + t for t in range(T)] for b in range(BATCH)]  # 1+K slots per request
    plain_slots = [20, 21, 22]  # the non-speculative run's slots
    pool[plain_slots] = pool[[owned[b][0] for b in range(BATCH)]]
    src = [owned[b][0] for b in range(BATCH)]
    g = torch.Generator().manual_seed(7)
    for r in range(rounds):
        tok = ssm_tokens(BATCH, T, dtype, seed=100 + r)
        y = ssm_multi(pool, tok, params, src, owned)
        accepted = torch.randint(0, T, (BATCH,), generator=g).tolist()  # drafts accepted, 0..K
        # The plain decode feeds each request its accepted tokens one step at a time, the whole batch
        # per step; a request with nothing left steps into a scratch slot (ignored).
        for t in range(T):
            slots = [plain_slots[b] if t <= accepted[b] else SCRATCH[b] for b in range(BATCH)]
            y_plain = selective_state_update(
                pool, tok["x"][:, t], tok["dt"][:, t], params["A"], tok["B"][:, t], tok["C"][:, t],
                params["D"], params["dt_bias"], torch.tensor(slots), DT_MIN,
            )  # fmt: skip
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(y[b, t], y_plain[b])
        for b in range(BATCH):
            src[b] = owned[b][accepted[b]]
            assert_same(pool[src[b]], pool[plain_slots[b]])


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
        ("src", (BATCH + 1,), "src_slots"),
        ("dst", (BATCH, 3), "dst_slots"),
        ("num_tokens", (BATCH, 1), "num_tokens"),
        ("pool", (NUM_SLOTS, H, P), "expected x"),
    ],
)
def test_ssm_bad_shapes_raise(name, shape, match):
    T = 2
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, T, torch.float32), ssm_pool(torch.float32)
    args = dict(
        ssm_state=pool, x=tok["x"], dt=tok["dt"], A=params["A"], B=tok["B"], C=tok["C"], D=params["D"],
        dt_bias=params["dt_bias"], src_slots=torch.tensor([20, 21, 22]),
        dst_slots=torch.arange(BATCH * T).view(BATCH, T), dt_min=DT_MIN, num_tokens=torch.full((BATCH,), T),
    )  # fmt: skip
    key = {"src": "src_slots", "dst": "dst_slots", "pool": "ssm_state"}.get(name, name)
    args[key] = torch.zeros(shape, dtype=args[key].dtype)
    with pytest.raises(ValueError, match=rf"selective_state_update_multi: .*\b{match}\b"):
        selective_state_update_multi(**args)


@pytest.mark.parametrize(
    "src,dst,num_tokens,match",
    [
        ([20, 21, 22], [[0, 1], [1, 2], [3, 4]], [2, 2, 2], "distinct"),
        ([20, 21, 22], [[0, 1], [2, 3], [4, 4]], [2, 2, 1], None),  # duplicate only in padding: fine
        ([20, 21, 22], [[0, 21], [2, 3], [4, 5]], [2, 2, 2], "overlap"),
        ([20, 21, NUM_SLOTS], [[0, 1], [2, 3], [4, 5]], [2, 2, 2], "src_slots"),
        ([20, 21, 22], [[0, 1], [2, -1], [4, 5]], [2, 2, 2], "dst_slots"),
        ([20, 21, 22], [[0, 1], [2, 3], [4, 5]], [2, 0, 2], "num_tokens"),
        ([20, 21, 22], [[0, 1], [2, 3], [4, 5]], [2, 3, 2], "num_tokens"),
    ],
)
def test_ssm_bad_slots_raise(src, dst, num_tokens, match):
    params, tok, pool = ssm_params(), ssm_tokens(BATCH, 2, torch.float32), ssm_pool(torch.float32)
    if match is None:
        ssm_multi(pool, tok, params, src, dst, num_tokens)
        return
    with pytest.raises(ValueError, match=match):
        ssm_multi(pool, tok, params, src, dst, num_tokens)


# ---- conv ----------------------------------------------------------------------------------------


def conv_layer(dtype: torch.dtype, width: int = WIDTH, with_bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(CHANNELS, width, generator=g) / width**0.5).to(dtype)  # [C, K]
    bias = torch.randn(CHANNELS, generator=g).to(dtype) if with_bias else None  # [C]
    return weight, bias


def conv_inputs(batch: int, T: int, dtype: torch.dtype, width: int = WIDTH, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, T, CHANNELS, generator=g).to(dtype)  # [B, T, C]
    pool = torch.randn(NUM_SLOTS, CHANNELS, width - 1, generator=g).to(dtype)  # [S, C, K-1]
    return x, pool


def conv_multi(x, weight, bias, pool, src, dst, num_tokens=None) -> Tensor:
    nt = None if num_tokens is None else torch.tensor(num_tokens)
    return causal_conv1d_update_multi(x, weight, bias, pool, torch.tensor(src), torch.tensor(dst), nt)


def conv_reference(x, weight, bias, pool, src: list[int], num_tokens: list[int]):
    pool = pool.clone()
    batch, T = x.shape[:2]
    y = torch.zeros_like(x)
    states: dict[tuple[int, int], Tensor] = {}
    for t in range(T):
        y[:, t] = causal_conv1d_update(x[:, t], weight, bias, pool, torch.tensor(src))
        for b in range(batch):
            if t < num_tokens[b]:
                states[b, t] = pool[src[b]].clone()
            else:
                y[b, t] = 0
    return y, states


@pytest.mark.parametrize("dtype", CONV_DTYPES)
@pytest.mark.parametrize("width,with_bias", [(WIDTH, True), (WIDTH, False), (2, True), (1, True)])
def test_conv_single_token_equals_existing_op(dtype, width, with_bias):
    weight, bias = conv_layer(dtype, width, with_bias)
    x, pool = conv_inputs(BATCH, 1, dtype, width)
    src, dst = [5, 0, 11], [[7], [0], [3]]
    ref_pool = pool.clone()
    y_ref = causal_conv1d_update(x[:, 0], weight, bias, ref_pool, torch.tensor(src))
    y = conv_multi(x, weight, bias, pool, src, dst)
    assert y.shape == (BATCH, 1, CHANNELS) and y.dtype == dtype
    assert_same(y[:, 0], y_ref)
    for b in range(BATCH):
        assert_same(pool[dst[b][0]], ref_pool[src[b]])


@pytest.mark.parametrize("dtype", CONV_DTYPES)
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5])
def test_conv_equals_repeated_single_token(T, dtype):
    weight, bias = conv_layer(dtype)
    x, pool = conv_inputs(BATCH, T, dtype, seed=T)
    src = [20, 21, 22]
    dst = [[b * T + t for t in range(T)] for b in range(BATCH)]
    y_ref, states = conv_reference(x, weight, bias, pool, src, [T] * BATCH)
    y = conv_multi(x, weight, bias, pool, src, dst)
    assert_same(y, y_ref)
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)


@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_conv_src_slot_among_dst_slots(dtype):
    T = 4
    weight, bias = conv_layer(dtype)
    x, pool = conv_inputs(BATCH, T, dtype)
    src = [2, 9, 15]
    dst = [[2, 3, 4, 5], [8, 9, 10, 11], [12, 13, 14, 15]]
    y_ref, states = conv_reference(x, weight, bias, pool, src, [T] * BATCH)
    y = conv_multi(x, weight, bias, pool, src, dst)
    assert_same(y, y_ref)
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)


def test_conv_unnamed_slots_untouched():
    T = 3
    weight, bias = conv_layer(torch.float32)
    x, real = conv_inputs(BATCH, T, torch.float32)
    src = [1, 6, 12]
    dst = [[1, 2, 3], [7, 8, 9], [13, 14, 15]]
    pool = torch.full_like(real, float("nan"))
    pool[src] = real[src]
    y = conv_multi(x, weight, bias, pool, src, dst)
    named = {s for row in dst for s in row} | set(src)
    assert torch.isfinite(y).all()
    for s in range(NUM_SLOTS):
        assert torch.isfinite(pool[s]).all() if s in named else torch.isnan(pool[s]).all(), s


@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_conv_short_rows_leave_later_slots_untouched(dtype):
    T = 4
    weight, bias = conv_layer(dtype)
    x, pool = conv_inputs(BATCH, T, dtype)
    src, num_tokens = [20, 21, 22], [1, 4, 2]
    dst = [[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, 10, 11]]
    before = pool.clone()
    y_ref, states = conv_reference(x, weight, bias, pool, src, num_tokens)
    y = conv_multi(x, weight, bias, pool, src, dst, num_tokens)
    assert_same(y, y_ref)
    assert (y[0, 1:] == 0).all() and (y[2, 2:] == 0).all()
    for (b, t), state in states.items():
        assert_same(pool[dst[b][t]], state)
    assert torch.equal(pool[[10, 11]], before[[10, 11]])
    assert torch.equal(pool[12:], before[12:])


@pytest.mark.parametrize("dtype", CONV_DTYPES)
def test_conv_resume_from_last_accepted_slot(dtype):
    K, rounds = 3, 4
    T = 1 + K
    weight, bias = conv_layer(dtype)
    _, pool = conv_inputs(BATCH, T, dtype)
    owned = [[b * T + t for t in range(T)] for b in range(BATCH)]
    plain_slots = [20, 21, 22]
    pool[plain_slots] = pool[[owned[b][0] for b in range(BATCH)]]
    src = [owned[b][0] for b in range(BATCH)]
    g = torch.Generator().manual_seed(7)
    for r in range(rounds):
        x, _ = conv_inputs(BATCH, T, dtype, seed=100 + r)
        y = conv_multi(x, weight, bias, pool, src, owned)
        accepted = torch.randint(0, T, (BATCH,), generator=g).tolist()
        for t in range(T):
            slots = [plain_slots[b] if t <= accepted[b] else SCRATCH[b] for b in range(BATCH)]
            y_plain = causal_conv1d_update(x[:, t], weight, bias, pool, torch.tensor(slots))
            for b in range(BATCH):
                if t <= accepted[b]:
                    assert_same(y[b, t], y_plain[b])
        for b in range(BATCH):
            src[b] = owned[b][accepted[b]]
            assert_same(pool[src[b]], pool[plain_slots[b]])


@pytest.mark.parametrize(
    "name,shape,match",
    [
        ("x", (BATCH, 2), "expected x"),
        ("weight", (CHANNELS + 1, WIDTH), "weight"),
        ("bias", (CHANNELS + 1,), "bias"),
        ("conv_state", (NUM_SLOTS, CHANNELS, WIDTH), "conv_state"),
        ("src_slots", (BATCH, 1), "src_slots"),
        ("dst_slots", (BATCH, 3), "dst_slots"),
        ("num_tokens", (BATCH - 1,), "num_tokens"),
    ],
)
def test_conv_bad_shapes_raise(name, shape, match):
    T = 2
    weight, bias = conv_layer(torch.float32)
    x, pool = conv_inputs(BATCH, T, torch.float32)
    args = dict(
        x=x, weight=weight, bias=bias, conv_state=pool, src_slots=torch.tensor([20, 21, 22]),
        dst_slots=torch.arange(BATCH * T).view(BATCH, T), num_tokens=torch.full((BATCH,), T),
    )  # fmt: skip
    args[name] = torch.zeros(shape, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=rf"causal_conv1d_update_multi: .*\b{match}\b"):
        causal_conv1d_update_multi(**args)


def test_conv_bad_slots_raise():
    weight, bias = conv_layer(torch.float32)
    x, pool = conv_inputs(BATCH, 2, torch.float32)
    with pytest.raises(ValueError, match="distinct"):
        conv_multi(x, weight, bias, pool, [20, 21, 22], [[0, 1], [1, 2], [3, 4]])
    with pytest.raises(ValueError, match="overlap"):
        conv_multi(x, weight, bias, pool, [20, 21, 22], [[0, 22], [2, 3], [4, 5]])
