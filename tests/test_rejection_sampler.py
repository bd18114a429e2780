"""RejectionSampler: greedy argmax-chain semantics, speculative sampling's output distribution, filtering,
per-request reproducibility, device-resident counts and argument checks."""

from __future__ import annotations

import pytest
import torch

from baton.engine.counter_noise import ACCEPT, DRAW, uniform
from baton.engine.logits_processing import RowHistory, logits_inputs
from baton.engine.ops.kernels import resolve_kernels
from baton.engine.ops.tempered_verify.reference import stochastic_decisions
from baton.engine.rejection_sampler import RejectionSampler
from baton.engine.sampling import probs
from baton.engine.sampling_params import SamplingParams
from tests.test_sampling import CHI2_999, chi_square

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
GREEDY = SamplingParams()


def assert_distributed_as(tokens: torch.Tensor, p: torch.Tensor) -> None:
    stat, dof = chi_square(tokens, p)  # also: no draw outside the support of p
    if dof == 0:
        return  # a one-token support (tight top-p): the support check is the whole test
    assert stat < CHI2_999[dof], f"chi2={stat:.1f} with {dof} dof, counts {torch.bincount(tokens, minlength=len(p))}"


def filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The non-speculative sampler's distribution for logits [..., V] (the reference p)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return probs(flat.float(), [params] * flat.shape[0]).view(logits.shape)


def ints(values: list[int] | int, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def one_hot_logits(ids: list[int], V: int, seed: int = 0) -> torch.Tensor:
    """[len(ids), V] logits whose argmax is ids, with small noise elsewhere."""
    x = torch.randn(len(ids), V, generator=torch.Generator().manual_seed(seed)) * 0.1
    x[torch.arange(len(ids)), ids] = 5.0
    return x


# ---- greedy ---------------------------------------------------------------------------------------------

def test_greedy_hand_made_cases() -> None:
    V, Kmax = 6, 3
    # Per row: target argmax at positions 0..3, drafts (padded with -1 beyond K), K.
    cases = [
        ([1, 2, 3, 4], [1, 2, 3], 3),     # all accepted -> bonus token 4 from position 3
        ([1, 2, 3, 4], [1, 5, 3], 3),     # mismatch at 1 -> 1, then the target's 2
        ([0, 5, 4, 4], [0, -1, -1], 1),   # K=1 accepted -> bonus from position 1, not Kmax
        ([2, 0, 0, 0], [-1, -1, -1], 0),  # K=0 -> plain greedy step
        ([3, 1, 1, 1], [4, 1, 1], 2),     # mismatch at 0 -> nothing accepted
        ([1, 2, 3, 0], [1, 2, 3], 2),     # the padding draft matches position 2 but is beyond K: not taken
    ]
    logits = torch.stack([one_hot_logits(a, V, seed=i) for i, (a, _, _) in enumerate(cases)])  # [R, 4, V]
    drafts = torch.tensor([d for _, d, _ in cases])
    nd = torch.tensor([k for _, _, k in cases])
    R = len(cases)
    res = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", "cpu")).verify(logits, drafts, None, nd, [GREEDY] * R)
    assert res.accepted_counts.tolist() == [3, 1, 1, 0, 0, 2]
    assert res.num_emitted.tolist() == [4, 2, 2, 1, 1, 3]
    assert res.output_token_ids.tolist() == [
        [1, 2, 3, 4], [1, 2, -1, -1], [0, 5, -1, -1], [2, -1, -1, -1], [3, -1, -1, -1], [1, 2, 3, -1]]


def test_greedy_matches_the_argmax_chain_on_random_batches() -> None:
    g = torch.Generator().manual_seed(3)
    R, Kmax, V = 64, 4, 7
    logits = torch.randn(R, Kmax + 1, V, generator=g)
    argmax = logits.argmax(dim=-1)
    corrupt = torch.rand(R, Kmax, generator=g) < 0.25
    drafts = torch.where(corrupt, torch.randint(V, (R, Kmax), generator=g), argmax[:, :Kmax])
    nd = torch.randint(Kmax + 1, (R,), generator=g)
    q = torch.rand(R, Kmax, V, generator=g).softmax(-1)  # greedy rows ignore q
    res = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", "cpu")).verify(logits, drafts, q, nd, [GREEDY] * R)
    for r in range(R):
        # Reference: non-speculative greedy emits argmax[k] at each step; drafts only say how far we get.
        emitted = []
        for k in range(nd[r] + 1):
            emitted.append(argmax[r, k].item())
            if k == nd[r] or drafts[r, k] != argmax[r, k]:
                break
        assert res.num_emitted[r].item() == len(emitted)
        assert res.accepted_counts[r].item() == len(emitted) - 1
        assert res.output_token_ids[r].tolist() == emitted + [-1] * (Kmax + 1 - len(emitted))
    assert 0 < res.accepted_counts.sum() < nd.sum()  # both outcomes occur


# ---- stochastic: the output distribution is the target's ------------------------------------------------

V5 = 5
N = 20_000
P_LOGITS0 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0])
P_LOGITS1 = torch.randn(V5, V5, generator=torch.Generator().manual_seed(10)) * 1.2  # row = previous token
P_LOGITS2 = torch.randn(V5, V5, generator=torch.Generator().manual_seed(11)) * 1.2
Q0 = torch.tensor([0.05, 0.40, 0.25, 0.10, 0.20])  # deliberately unlike p0
Q1 = torch.rand(V5, V5, generator=torch.Generator().manual_seed(12)) ** 3 + 0.02
Q1 = Q1 / Q1.sum(-1, keepdim=True)  # q1 given the previous draft


def spec_batch(deterministic_drafts: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """N rows with K=2: drafts drawn from q (or fixed argmax drafts) and target logits conditioned on them,
    as a real target would be: position 1 scores the token after x0, position 2 the token after x1."""
    gd = torch.Generator().manual_seed(2024)
    if deterministic_drafts:
        # A greedy drafter that agrees with the target's mode (else acceptance would be too rare to test).
        x0 = torch.full((N,), int(P_LOGITS0.argmax()))
        x1 = P_LOGITS1[x0].argmax(-1)
        q = None
    else:
        x0 = torch.multinomial(Q0, N, replacement=True, generator=gd)
        x1 = torch.multinomial(Q1[x0], 1, generator=gd).squeeze(1)
        q = torch.stack([Q0.expand(N, V5), Q1[x0]], dim=1)  # [N, 2, V]
    logits = torch.stack([P_LOGITS0.expand(N, V5), P_LOGITS1[x0], P_LOGITS2[x1]], dim=1)  # [N, 3, V]
    return logits, torch.stack([x0, x1], dim=1), q


STOCHASTIC = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),  # q puts mass on tokens top-k removes from p
    SamplingParams(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("params", STOCHASTIC)
@pytest.mark.parametrize(("deterministic_drafts", "one_seed"), [(False, False), (False, True), (True, False)])
def test_emitted_tokens_are_distributed_as_the_target(params: SamplingParams, deterministic_drafts: bool,
                                                      one_seed: bool) -> None:
    logits, drafts, q = spec_batch(deterministic_drafts)
    # A seed per row at one position, or one seed at a position per row: the noise must be fresh either way.
    seeds = torch.full((N,), 99) if one_seed else torch.arange(N) * 7919 + 5
    positions = torch.arange(N) * 3 + 17 if one_seed else torch.full((N,), 17)
    res = RejectionSampler(max_draft=2, kernels=resolve_kernels("auto", "cpu")).verify(logits, drafts, q, torch.full((N,), 2), [params] * N, seeds,
                                               positions)
    out, emitted = res.output_token_ids, res.num_emitted
    assert ((res.accepted_counts == 0) | (out[:, 0] == drafts[:, 0])).all()
    assert ((res.accepted_counts < 2) | (out[:, 1] == drafts[:, 1])).all()
    assert 0.1 < (emitted > 1).float().mean() < 0.9  # drafts are sometimes accepted, sometimes not

    # First token: a plain draw from p0, whatever q was.
    assert_distributed_as(out[:, 0], filtered(P_LOGITS0, params))
    # Second token, given the first (emitted in this step when x0 was accepted): a draw from p1(. | t0).
    # Third (bonus) token, given the second: a draw from p2(. | t1).
    tested = 0
    for pos, table in ((1, P_LOGITS1), (2, P_LOGITS2)):
        for prev in range(V5):
            sel = (emitted > pos) & (out[:, pos - 1] == prev)
            if sel.sum() >= 1000:  # enough draws for the chi-square approximation to be sound
                assert_distributed_as(out[sel, pos], filtered(table[prev], params))
                tested += 1
    assert tested >= 2


def test_q_equal_to_p_accepts_every_draft() -> None:
    R, V = 256, 9
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.9)
    logits = torch.randn(R, 4, V, generator=g)
    q = filtered(logits[:, :3], params)  # the drafter is the target: q == p exactly
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(R, 3)
    nd = torch.randint(4, (R,), generator=g)
    res = RejectionSampler(max_draft=3, kernels=resolve_kernels("auto", "cpu")).verify(logits, drafts, q, nd, [params] * R, torch.arange(R), ints(R * [0]))
    assert res.accepted_counts.tolist() == nd.tolist()


def test_drafts_outside_the_target_filter_are_never_accepted_or_emitted() -> None:
    R, V = 2000, 6
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0, -2.0]).expand(R, 2, V).contiguous()
    params = SamplingParams(temperature=2.0, top_k=3)  # keeps ids 0, 1, 2
    drafts = torch.arange(R)[:, None] % V  # [R, 1]: half of the drafts are filtered out by top-k
    res = RejectionSampler(max_draft=1, kernels=resolve_kernels("auto", "cpu")).verify(logits, drafts, None, torch.ones(R, dtype=torch.long),
                                               [params] * R, torch.arange(R), torch.full((R,), 4))
    assert (res.accepted_counts[drafts[:, 0] >= 3] == 0).all()
    assert set(res.output_token_ids[:, 0].tolist()) == {0, 1, 2}
    kept_bonus = res.output_token_ids[res.accepted_counts == 1, 1]
    assert kept_bonus.numel() > 0 and set(kept_bonus.tolist()) <= {0, 1, 2}


# ---- reproducibility ------------------------------------------------------------------------------------

def test_noise_is_a_function_of_seed_position_and_stream() -> None:
    seeds = torch.tensor([0, 1, -5, 2**62 + 3, 2**40])
    pos = torch.tensor([0, 7, 7, 2**31, 100])
    u = uniform(seeds, pos, ACCEPT)
    assert u.dtype == torch.float32 and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u, uniform(seeds.clone(), pos.clone(), ACCEPT))  # no hidden state
    assert (u != uniform(seeds, pos, DRAW)).all()
    assert (u != uniform(seeds + 1, pos, ACCEPT)).all()
    assert (u != uniform(seeds, pos + 1, ACCEPT)).all()
    assert (u != uniform(seeds + 2**32, pos, ACCEPT)).all()  # the seed's high half counts
    # One seed along 100k positions: uniform enough (8 bins, chi-square at 99.9 %) and no repeats.
    many = uniform(torch.tensor(42), torch.arange(100_000), DRAW)
    assert many.unique().numel() > 99_000
    assert_distributed_as((many * 8).long(), torch.full((8,), 1 / 8))
    with pytest.raises(ValueError, match=r"seeds, positions: expected int64 tensors, got torch.int32"):
        uniform(seeds.int(), pos, ACCEPT)
    with pytest.raises(ValueError, match=r"stream: expected ACCEPT \(0\) or DRAW \(1\), got 2"):
        uniform(seeds, pos, 2)


def test_rows_without_drafts_draw_from_the_target() -> None:
    """K = 0 rows (and the bonus position) draw the token by inverse CDF: distributed as p, never a filtered id."""
    params = SamplingParams(temperature=1.1, top_k=4, top_p=0.95)
    logits = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, 1.5]).expand(N, 1, 6).contiguous()
    res = RejectionSampler(max_draft=0, kernels=resolve_kernels("auto", "cpu")).verify(logits, torch.zeros(N, 0, dtype=torch.long), None,
                                               torch.zeros(N, dtype=torch.long), [params] * N,
                                               torch.full((N,), 3), torch.arange(N))
    assert_distributed_as(res.output_token_ids[:, 0], filtered(logits[0, 0], params))


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_alone_or_in_a_batch(device: str) -> None:
    steps, V, K, max_draft = 30, 16, 2, 4
    g = torch.Generator().manual_seed(6)
    target = SamplingParams(temperature=1.2, top_k=12, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.8), GREEDY,
              SamplingParams(temperature=2.0, seed=42)]
    rs = RejectionSampler(max_draft=max_draft, kernels=resolve_kernels("auto", device))
    alone, batched, differs = [], [], []
    pos = 30  # the position of the token column 0 decides: the emitted tokens' positions follow on
    for _ in range(steps):
        logits = (torch.randn(K + 1, V, generator=g) * 2).to(device)
        q_host = torch.rand(K, V, generator=g).softmax(-1)
        q = q_host.to(device)
        x = torch.multinomial(q_host, 1, generator=g).squeeze(1).to(device)
        res = rs.verify(logits[None], x[None], q[None], torch.tensor([K]), [target], ints([42], device),
                        ints([pos], device))
        alone.append(res.output_token_ids[0, :res.num_emitted[0]].tolist())
        res = rs.verify(logits[None], x[None], q[None], torch.tensor([K]), [target], ints([43], device),
                        ints([pos], device))
        differs.append(res.output_token_ids[0, :res.num_emitted[0]].tolist())

        # The same request at row 2 of 5, in a batch with Kmax = 4 and rows of other K.
        big_logits = (torch.randn(5, max_draft + 1, V, generator=g) * 2).to(device)
        big_q = torch.rand(5, max_draft, V, generator=g).softmax(-1).to(device)
        big_x = torch.randint(V, (5, max_draft), generator=g).to(device)
        big_logits[2, :K + 1], big_q[2, :K], big_x[2, :K] = logits, q, x
        big_x[2, K:] = -1
        nd = torch.tensor([4, 0, K, 3, 1], device=device)  # num_draft may also live on the device
        # Other rows share the seed or the position, not both.
        res = rs.verify(big_logits, big_x, big_q, nd, [*others[:2], target, *others[2:]],
                        ints([7, 42, 42, 5, 42], device), ints([pos, pos + 1, pos, pos, pos - 1], device))
        batched.append(res.output_token_ids[2, :res.num_emitted[2]].tolist())
        pos += len(alone[-1])
    assert batched == alone
    assert differs != alone
    assert len({len(t) for t in alone}) > 1  # the test means something only if acceptance varies


@pytest.mark.parametrize("device", DEVICES)
def test_16_bit_target_logits_verify_as_their_float32_copy(device: str) -> None:
    """The verify step hands over the lm_head's bf16 logits: greedy and seeded stochastic rows must accept and
    emit exactly what the float32 copy of the same values gives."""
    R, Kmax, V = 6, 3, 40
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(R, Kmax + 1, V, generator=g) * 3).to(torch.bfloat16)
    drafts = logits.float().argmax(-1)[:, :Kmax].clone()  # greedy rows accept until a draft is changed
    drafts[0, 1] = (drafts[0, 1] + 1) % V
    logits[2, 0, [3, 17]] = 50.0  # a tie: the lowest id wins
    drafts[2, 0] = 3
    logits, drafts = logits.to(device), drafts.to(device)
    params = [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.6, top_k=8, seed=2), SamplingParams(temperature=1.4, top_p=0.9, seed=3)]
    nd = torch.tensor([3, 3, 2, 3, 1, 2])
    rs = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", device))
    seeds, pos = ints([0, 0, 0, 1, 2, 3], device), ints([5] * R, device)
    got = rs.verify(logits, drafts, None, nd, params, seeds, pos)
    want = rs.verify(logits.float(), drafts, None, nd, params, seeds, pos)
    assert got.output_token_ids.tolist() == want.output_token_ids.tolist()
    assert got.accepted_counts.tolist()[:3] == [1, 3, 2]


def _verify_rows(R: int, Kmax: int, V: int, seed: int):
    """(the generator, then on: bf16 logits [R, Kmax+1, V], drafts [R, Kmax] (60 % the argmax, so that some are
    accepted), draft counts [R] in 0..Kmax)."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, Kmax + 1, V, generator=g) * 2).to(torch.bfloat16)
    drafts = torch.where(torch.rand(R, Kmax, generator=g) < 0.6, logits.float().argmax(-1)[:, :Kmax],
                         torch.randint(V, (R, Kmax), generator=g))
    return g, logits, drafts, torch.randint(Kmax + 1, (R,), generator=g)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_tempered_equals_verify_of_the_same_rows(device: str) -> None:
    """What a verify graph runs (temperatures, seeds and positions as tensors, no host list) decides every row as
    `verify` does with the rows' SamplingParams: greedy rows by argmax, the others sampled at their temperature."""
    R, Kmax, V = 96, 3, 11
    g, logits, drafts, nd = _verify_rows(R, Kmax, V, seed=21)
    temps = [0.0 if i % 3 == 0 else (0.5, 1.0, 1.7, 1e-4)[i % 4] for i in range(R)]
    params = [SamplingParams(temperature=t) for t in temps]
    seeds, pos = torch.randint(2**62, (R,), generator=g), torch.randint(1000, (R,), generator=g)
    logits, drafts, seeds, pos = logits.to(device), drafts.to(device), seeds.to(device), pos.to(device)
    rs = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", device))
    want = rs.verify(logits, drafts, None, nd, params, seeds, pos)
    got = rs.verify_tempered(logits, drafts, nd.to(device), torch.tensor(temps, device=device), seeds, pos)
    assert got.output_token_ids.tolist() == want.output_token_ids.tolist()
    assert got.accepted_counts.tolist() == want.accepted_counts.tolist()
    sampled = torch.tensor(temps) > 0.1
    acc = want.accepted_counts.cpu()
    assert 0 < acc[sampled].sum() < nd[sampled].sum()  # sampled rows accept some drafts and reject others
    with pytest.raises(ValueError, match=r"temperature: expected a torch.float32 tensor of shape \[R\] = \(96,\)"):
        rs.verify_tempered(logits, drafts, nd, torch.tensor(temps, dtype=torch.float64, device=device), seeds, pos)
    with pytest.raises(ValueError, match=r"positions: expected a torch.int64 tensor of shape \[R\] = \(96,\)"):
        rs.verify_tempered(logits, drafts, nd, torch.tensor(temps, device=device), seeds, pos[:3])


# ---- outputs and arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_outputs_are_int64_on_the_logits_device(device: str) -> None:
    R, Kmax, V = 3, 2, 10
    logits = torch.randn(R, Kmax + 1, V, device=device, dtype=torch.bfloat16)
    drafts = torch.randint(V, (R, Kmax), device=device, dtype=torch.int32)
    params = [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=1)]
    res = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", device)).verify(logits, drafts, None, torch.tensor([2, 1, 0]), params,
                                                  ints([0, 1, 1], device), ints([9, 9, 9], device))
    for t, shape in ((res.accepted_counts, (R,)), (res.num_emitted, (R,)), (res.output_token_ids, (R, Kmax + 1))):
        assert t.dtype == torch.int64 and t.device.type == torch.device(device).type and tuple(t.shape) == shape
    assert (res.num_emitted == res.accepted_counts + 1).all()


def test_empty_batch() -> None:
    res = RejectionSampler(max_draft=2, kernels=resolve_kernels("auto", "cpu")).verify(torch.zeros(0, 3, 4), torch.zeros(0, 2, dtype=torch.long), None,
                                               torch.zeros(0, dtype=torch.long), [])
    assert res.output_token_ids.shape == (0, 3) and res.accepted_counts.shape == (0,)


def _args(**over: object) -> dict[str, object]:
    R, Kmax, V = 2, 3, 5
    args: dict[str, object] = dict(target_logits=torch.zeros(R, Kmax + 1, V),
                                   draft_token_ids=torch.zeros(R, Kmax, dtype=torch.long),
                                   draft_probs=torch.full((R, Kmax, V), 0.2), num_draft=torch.tensor([3, 1]),
                                   params=[GREEDY, SamplingParams(temperature=1.0)], seeds=ints([1, 2]),
                                   positions=ints([3, 3]))
    args.update(over)
    return args


@pytest.mark.parametrize(("over", "match"), [
    ({"target_logits": torch.zeros(2, 5)}, r"target_logits: expected shape \[R, Kmax\+1, V\].*got \(2, 5\)"),
    ({"target_logits": torch.zeros(2, 0, 5)}, r"target_logits: expected .*got \(2, 0, 5\)"),
    ({"draft_token_ids": torch.zeros(2, 2, dtype=torch.long)}, r"draft_token_ids: expected shape .*\(2, 3\), got \(2, 2\)"),
    ({"draft_token_ids": torch.zeros(2, 3)}, r"draft_token_ids: expected an integer dtype, got torch.float32"),
    ({"draft_probs": torch.zeros(2, 3, 4)}, r"draft_probs: expected shape .*\(2, 3, 5\), got \(2, 3, 4\)"),
    ({"num_draft": torch.tensor([3])}, r"num_draft: expected shape \[R\] = \(2,\), got \(1,\)"),
    ({"num_draft": torch.tensor([3.0, 1.0])}, r"num_draft: expected an integer dtype, got torch.float32"),
    ({"num_draft": torch.tensor([4, 1])}, r"num_draft: expected values in \[0, Kmax=3\], got range \[1, 4\]"),
    ({"num_draft": torch.tensor([-1, 1])}, r"num_draft: expected values in \[0, Kmax=3\], got range \[-1, 1\]"),
    ({"params": [GREEDY]}, r"params: expected one SamplingParams per row \(2 rows\), got 1"),
    ({"seeds": None}, r"seeds: expected an int64 tensor of shape \[R\] = \(2,\) for the stochastic rows, got None"),
    ({"positions": ints([3])}, r"positions: expected an int64 tensor of shape \[R\] = \(2,\) on cpu, got torch.int64 \(1,\)"),
    ({"seeds": torch.tensor([1, 2], dtype=torch.int32)}, r"seeds: expected .* got torch.int32 \(2,\) on cpu"),
])
def test_invalid_arguments_name_the_argument(over: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RejectionSampler(max_draft=4, kernels=resolve_kernels("auto", "cpu")).verify(**_args(**over))


def test_more_drafts_than_max_draft_is_refused() -> None:
    with pytest.raises(ValueError, match=r"draft_token_ids: expected at most max_draft=2 columns, got 3"):
        RejectionSampler(max_draft=2, kernels=resolve_kernels("auto", "cpu")).verify(**_args())
    with pytest.raises(ValueError, match=r"max_draft: expected an integer >= 0, got -1"):
        RejectionSampler(max_draft=-1, kernels=resolve_kernels("auto", "cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_verify_tempered_with_filters_equals_verify_of_the_same_rows(device: str) -> None:
    """With top_k / top_p tensors (a verify graph's third variant) every row is decided as `verify` decides it:
    greedy rows by argmax, rows at a temperature alone by `tempered_decisions`, top-k / top-p rows by
    `filtered_decisions`, which computes FILTER_ROWS distributions at a time (here 96 x 4 of them)."""
    R, Kmax, V = 96, 3, 23
    g, logits, drafts, nd = _verify_rows(R, Kmax, V, seed=22)
    kinds = [dict(temperature=0.0), dict(temperature=0.9), dict(temperature=0.7, top_k=3),
             dict(temperature=1.2, top_p=0.8), dict(temperature=1.0, top_k=5, top_p=0.6), dict(temperature=1.5)]
    params = [SamplingParams(**kinds[i % len(kinds)]) for i in range(R)]
    seeds, pos = torch.randint(2**62, (R,), generator=g), torch.randint(1000, (R,), generator=g)
    logits, drafts, seeds, pos = logits.to(device), drafts.to(device), seeds.to(device), pos.to(device)
    rs = RejectionSampler(max_draft=Kmax, kernels=resolve_kernels("auto", device))
    want = rs.verify(logits, drafts, None, nd, params, seeds, pos)
    t = lambda vals, dtype: torch.tensor(vals, dtype=dtype, device=device)  # noqa: E731
    got = rs.verify_tempered(logits, drafts, nd.to(device), t([p.temperature for p in params], torch.float32), seeds,
                             pos, t([p.top_k for p in params], torch.int64), t([p.top_p for p in params], torch.float32))
    assert got.output_token_ids.tolist() == want.output_token_ids.tolist()
    # The filtered rows as `stochastic_decisions` decides them from the full distributions (`probs`).
    rows = [i for i, p in enumerate(params) if p.top_k or p.top_p < 1]
    idx = torch.tensor(rows, device=device)
    p = probs(logits[idx].float().reshape(len(rows) * (Kmax + 1), V),
                       [params[i] for i in rows for _ in range(Kmax + 1)]).view(len(rows), Kmax + 1, V)
    valid = torch.arange(Kmax)[None, :] < nd[rows][:, None]
    d = torch.where(valid.to(device), drafts[idx], 0)
    acc, final = stochastic_decisions(p, d, valid.to(device), None, seeds[idx], pos[idx])
    assert got.accepted_counts[idx].tolist() == acc.tolist()
    assert got.output_token_ids[idx].gather(1, acc[:, None]).squeeze(1).tolist() == final.tolist()
    assert 0 < acc.sum() < nd[rows].sum()
    # Top-k 3 rows draw only among their three most likely tokens at the decided position.
    acc_all = got.accepted_counts.cpu()
    for i in (i for i, p in enumerate(params) if p.top_k == 3):
        top3 = logits[i, acc_all[i]].float().topk(3).indices.tolist()
        assert got.output_token_ids[i, acc_all[i]].item() in top3
    with pytest.raises(ValueError, match="top_k, top_p: expected both or neither"):
        rs.verify_tempered(logits, drafts, nd, t([1.0] * R, torch.float32), seeds, pos,
                           t([0] * R, torch.int64), None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("filtered", ["none", "one", "all"], ids=["tempered", "with-a-top-p-row", "all-filtered"])
def test_sample_is_verify_without_drafts(device: str, filtered: str) -> None:
    """`sample` (every engine's next token) decides each row as `verify` does a row without drafts, by its own
    shortcuts: the argmax for greedy rows, `tempered_decisions` for temperature-only rows, `filtered_decisions`
    for top-k / top-p rows."""
    R, V = 24, 300
    g = torch.Generator().manual_seed(31)
    logits = (torch.randn(R, V, generator=g) * 3).to(torch.bfloat16).to(device)
    params = [SamplingParams(temperature=(0.0, 0.7, 1.0, 1.6)[i % 4], seed=i) for i in range(R)]
    if filtered == "one":
        params[5] = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    elif filtered == "all":
        params = [SamplingParams(temperature=(0.7, 1.0, 1.6)[i % 3], top_k=(0, 7)[i % 2], top_p=(0.8, 0.95, 0.5)[i % 3],
                                 seed=i) for i in range(R)]
    seeds, pos = ints(list(range(R)), device), ints([40 + i for i in range(R)], device)
    rs = RejectionSampler(max_draft=0, kernels=resolve_kernels("auto", device))
    got = rs.sample(logits, params, seeds, pos)
    want = rs.verify(logits[:, None], torch.zeros(R, 0, dtype=torch.long, device=device), None,
                     torch.zeros(R, dtype=torch.long), params, seeds, pos).output_token_ids[:, 0]
    assert got.tolist() == want.tolist()
    if filtered != "all":
        assert got[0::4].tolist() == logits[0::4].float().argmax(-1).tolist()
    assert (got != logits.float().argmax(-1)).any()  # the others draw
    with pytest.raises(ValueError, match="positions: expected an int64 tensor"):
        rs.sample(logits, params, seeds, None)


# ---- logits processing: penalties, min_p, logit_bias, min_tokens ----------------------------------------

PROCESSED = [
    SamplingParams(temperature=1.0, presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.4,
                   logit_bias={1: 1.5}, min_tokens=2, max_tokens=8),
    SamplingParams(temperature=0.8, min_p=0.15, repetition_penalty=0.7, top_k=4, max_tokens=8),
]
# Each row's request so far: a prompt and one output; stop id 0 is masked for its first min_tokens outputs.
HISTORY = RowHistory(prompt=[2, 4], outputs=[3], stop_ids=frozenset({0}))


def processed_target(z: torch.Tensor, params: SamplingParams, drafts_before: list[int]) -> torch.Tensor:
    """The non-speculative sampler's distribution after `drafts_before` were generated: processing by the per-row
    reference of tests/test_logits_processing.py, then temperature / top-k / top-p."""
    from tests.test_logits_processing import reference

    return filtered(reference(z, params, list(HISTORY.prompt), [*HISTORY.outputs, *drafts_before],
                              set(HISTORY.stop_ids)), params)


@pytest.mark.parametrize("params", PROCESSED)
@pytest.mark.parametrize("deterministic_drafts", [False, True])
def test_processed_rows_emit_the_processed_target_distribution(params: SamplingParams,
                                                               deterministic_drafts: bool) -> None:
    """Speculative sampling with penalties / min_p / logit_bias / min_tokens samples what a plain step after the
    accepted drafts would: position j's target counts drafts 0..j-1 as generated."""
    logits, drafts, q = spec_batch(deterministic_drafts)
    processing = logits_inputs([params] * N, [HISTORY] * N, torch.device("cpu"))
    res = RejectionSampler(max_draft=2, kernels=resolve_kernels("auto", "cpu")).verify(
        logits, drafts, q, torch.full((N,), 2), [params] * N, torch.arange(N) * 7919 + 5, torch.full((N,), 17),
        processing)
    out, emitted = res.output_token_ids, res.num_emitted
    assert (emitted > 1).any() and (emitted < 3).any()  # drafts are sometimes accepted, sometimes not
    assert_distributed_as(out[:, 0], processed_target(P_LOGITS0, params, []))
    tested = 0
    # The token at position j, given the accepted drafts before it (all of them: the counts depend on each).
    for pos, table in ((1, P_LOGITS1), (2, P_LOGITS2)):
        for before in {tuple(r) for r in out[emitted > pos, :pos].tolist()}:
            sel = (emitted > pos) & (out[:, :pos] == torch.tensor(before)).all(dim=1)
            if sel.sum() >= 1000:
                assert_distributed_as(out[sel, pos], processed_target(table[before[-1]], params, list(before)))
                tested += 1
    assert tested >= 1
    if params.min_tokens:
        assert (out[:, 0] != 0).all()  # the first output of a request with min_tokens=2 never stops


def test_greedy_processed_rows_take_the_processed_argmax_at_every_position() -> None:
    V, R = 6, 3
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0, -2.0, 1.0]]).expand(R, 3, V).contiguous()
    params = [SamplingParams(presence_penalty=1.5, max_tokens=8), SamplingParams(logit_bias={4: 10}, max_tokens=8),
              SamplingParams(min_tokens=3, max_tokens=8)]
    hist = [RowHistory([5], [], frozenset({0}))] * R
    rs = RejectionSampler(max_draft=2, kernels=resolve_kernels("auto", "cpu"))
    # Row 0: 0 is the argmax, then penalised below 1 once drafted; 1 then follows.
    drafts = torch.tensor([[0, 1], [4, 4], [1, 1]])
    res = rs.verify(logits, drafts, None, torch.full((R,), 2), params, processing=logits_inputs(params, hist, torch.device("cpu")))
    assert res.output_token_ids.tolist() == [[0, 1, 5], [4, 4, 4], [1, 1, 1]]
