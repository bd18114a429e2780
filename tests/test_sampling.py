"""Sampling (`RejectionSampler.sample`: rows without drafts) and SamplingParams: filtering semantics, sampling
statistics, per-request reproducibility."""

from __future__ import annotations

import math

import pytest
import torch

from baton.engine.ops.kernels import resolve_kernels
from baton.engine.rejection_sampler import RejectionSampler
from baton.engine.sampling import request_seed
from baton.engine.sampling_params import SamplingParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# Upper 0.1% points of chi-square by degrees of freedom (no scipy in the dev deps). The draws below
# are seeded, so the test is deterministic; the threshold only says how far off a bug must be.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}



def sampler_for(device: torch.device | str) -> RejectionSampler:
    """A sampler on the ops an engine on `device` runs."""
    return RejectionSampler(0, resolve_kernels("auto", device))


sampler = sampler_for("cpu")


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int] | None = None,
           positions: list[int] | None = None) -> torch.Tensor:
    """One token per row of logits [R, V]: seeds default to each row's params seed (0 when None), positions to 0."""
    n, dev = logits.shape[0], logits.device
    seeds = [p.seed or 0 for p in params] if seeds is None else seeds
    positions = [0] * n if positions is None else positions
    t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
    return sampler_for(dev).sample(logits, params, t(seeds), t(positions))


def sample_many(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n draws for one row of logits [V], as a batch of n copies at n positions of one seed -> [n]."""
    return sample(logits.expand(n, -1), [params] * n, [seed] * n, list(range(n)))


def chi_square(tokens: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the support of expected_p, and its degrees of freedom."""
    counts = torch.bincount(tokens.cpu(), minlength=len(expected_p)).double()
    support = expected_p > 0
    assert counts[~support].sum() == 0, f"draws outside the support: {counts.tolist()}"
    exp = expected_p[support].double() * len(tokens)
    return float(((counts[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_ties_to_lowest_id(device: str) -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0)).to(device)
    logits[3, [7, 40, 90]] = 100.0  # a three-way tie for the max
    out = sampler_for(device).sample(logits, [SamplingParams()] * 8, None, None)
    assert out.dtype == torch.int64 and out.device.type == torch.device(device).type
    assert out.tolist() == logits.argmax(dim=-1).tolist()
    assert out[3].item() == 7
    # Beside a row that samples (noise inputs given), greedy rows are still the argmax.
    mixed = sample(logits, [SamplingParams()] * 7 + [SamplingParams(temperature=1.0, seed=3)])
    assert mixed[:7].tolist() == out[:7].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_16_bit_logits_sample_as_their_float32_copy(device: str) -> None:
    """The engine hands the sampler the lm_head's bf16 logits: greedy rows (ties included) and seeded draws
    must come out as from the float32 copy of the same values."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 300, generator=g) * 4).to(torch.bfloat16).to(device)
    logits[1, [5, 77, 299]] = 60.0  # a three-way tie for the max, exact in bf16
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.9, seed=11),
              SamplingParams(temperature=1.3, top_k=40, seed=12), SamplingParams(temperature=0.7, top_p=0.8, seed=13),
              SamplingParams()]
    got = sample(logits, params)
    want = sample(logits.float(), params)
    assert got.tolist() == want.tolist()
    assert got[1].item() == 5


@pytest.mark.parametrize("temperature", [0.05, 1.0, 20.0])
def test_top_k_1_is_greedy(temperature: float) -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=temperature, top_k=1)
    out = sample(logits, [p] * 16, list(range(16)))
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_support_is_the_k_largest() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    allowed = set(logits.topk(5).indices.tolist())
    drawn = set(sample_many(logits, SamplingParams(temperature=5.0, top_k=5), 4000).tolist())
    assert drawn == allowed  # never outside, and at temperature 5 every one of the five shows up


def test_top_k_ties_at_the_cut_keep_the_lowest_ids() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0, 3.0])
    drawn = set(sample_many(logits, SamplingParams(temperature=1.0, top_k=2), 2000).tolist())
    assert drawn == {1, 2}


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.4, {2}), (0.7, {2, 0}), (0.8, {2, 0, 4}), (0.95, {2, 0, 4, 1}),
                                               (1.0, {2, 0, 4, 1, 3})])
def test_top_p_support_is_the_nucleus(top_p: float, nucleus: set[int]) -> None:
    # Ranked by probability: id 2 (0.5), 0 (0.25), 4 (0.15), 1 (0.07), 3 (0.03). The nucleus is the
    # smallest prefix whose mass reaches top_p; the cut points sit away from float round-off.
    logits = torch.tensor([0.25, 0.07, 0.5, 0.03, 0.15]).log()
    drawn = set(sample_many(logits, SamplingParams(temperature=1.0, top_p=top_p), 6000).tolist())
    assert drawn == nucleus


def test_top_p_on_the_temperature_scaled_distribution() -> None:
    # At T=1 the nucleus for top_p=0.6 is {0, 1} (0.5, 0.3, 0.2); at T=0.25 id 0 alone holds > 0.6.
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    assert set(sample_many(logits, SamplingParams(temperature=1.0, top_p=0.6), 2000).tolist()) == {0, 1}
    assert set(sample_many(logits, SamplingParams(temperature=0.25, top_p=0.6), 2000).tolist()) == {0}


def _expected(logits: torch.Tensor, t: float, keep: list[int]) -> torch.Tensor:
    p = torch.zeros_like(logits)
    p[keep] = (logits[keep] / t).softmax(dim=-1)
    return p


LOGITS6 = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5])  # ranked by logit: 3, 0, 1, 4, 2, 5


@pytest.mark.parametrize(("params", "keep"), [
    (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=2.5), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=0.7), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=1.5, top_k=3), [3, 0, 1]),
    # T=1 probabilities: 3 .56, 0 .21, 1 .093, 4 .076, 2 .046, 5 .017 -> mass .56, .77, .86, .94
    (SamplingParams(temperature=1.0, top_p=0.8), [3, 0, 1]),
    # top-k first (keeps 3, 0, 1, 4), then top-p on that renormalised set: .60, .22 -> .82 >= .7
    (SamplingParams(temperature=1.0, top_k=4, top_p=0.7), [3, 0]),
])
@pytest.mark.parametrize("along", ["positions", "seeds"])
def test_sampling_frequencies_match_the_filtered_softmax(params: SamplingParams, keep: list[int], along: str) -> None:
    """20,000 draws: one seed along as many positions (a request's tokens), or as many seeds at one position
    (requests side by side)."""
    n = 20_000
    if along == "positions":
        tokens = sample_many(LOGITS6, params, n, seed=99)
    else:
        tokens = sample(LOGITS6.expand(n, -1), [params] * n, [99 * n + i for i in range(n)], [7] * n)
    stat, dof = chi_square(tokens, _expected(LOGITS6, params.temperature, keep))
    assert stat < CHI2_999[dof], f"chi2={stat:.1f} with {dof} dof"


@pytest.mark.parametrize("device", DEVICES)
def test_seed_reproducible_alone_or_in_a_batch(device: str) -> None:
    """A request's draws depend on its seed and the positions of its tokens only: alone or at row 3 of 5 beside
    seeded, unseeded and greedy requests (one with the same seed), the same tokens."""
    steps, V = 40, 64
    g0 = torch.Generator().manual_seed(5)
    target_logits = (torch.randn(steps, V, generator=g0) * 2).to(device)  # [steps, V]
    other_logits = (torch.randn(steps, 4, V, generator=g0) * 2).to(device)  # [steps, 4, V]
    target = SamplingParams(temperature=1.2, top_k=40, top_p=0.95, seed=42)
    plain = SamplingParams(temperature=1.1, seed=42)  # temperature alone: the fused path on a GPU
    for params in (target, plain):
        alone = [sample(target_logits[s][None], [params], positions=[100 + s]).item() for s in range(steps)]
        others = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0.8),
                  SamplingParams(), SamplingParams(temperature=2.0, top_p=0.5, seed=42)]
        seeds = [7, request_seed(None), 0, 42]
        batched = []
        for s in range(steps):
            rows = [other_logits[s, 0], other_logits[s, 1], other_logits[s, 2], target_logits[s], other_logits[s, 3]]
            out = sample(torch.stack(rows), [*others[:3], params, others[3]], [*seeds[:3], 42, seeds[3]],
                         [3, 9, 100 + s, 100 + s, 100 + s])
            batched.append(out[3].item())
        assert batched == alone
        assert len(set(alone)) > 10  # the test means something only if the draws actually vary
        differs = [sample(target_logits[s][None], [params], [43], [100 + s]).item() for s in range(steps)]
        assert differs != alone


def test_request_seed() -> None:
    assert request_seed(123) == 123 and request_seed(0) == 0
    fresh = {request_seed(None) for _ in range(8)}
    assert len(fresh) == 8 and all(0 <= s < 2**63 for s in fresh)


def test_tiny_temperature_is_finite_and_near_greedy() -> None:
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(4)) * 50
    p = SamplingParams(temperature=1e-30)
    out = sample(logits, [p] * 8, list(range(8)))
    assert out.tolist() == logits.argmax(dim=-1).tolist()


def test_sample_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one SamplingParams"):
        sampler.sample(torch.zeros(2, 5), [SamplingParams()], None, None)
    with pytest.raises(ValueError, match="one SamplingParams"):
        sample(torch.zeros(2, 5), [SamplingParams(temperature=1.0)], [1, 2], [0, 0])
    with pytest.raises(ValueError, match="seeds: expected an int64 tensor"):
        sampler.sample(torch.zeros(2, 5), [SamplingParams(temperature=1.0)] * 2, None, None)


def test_params_normalise_and_hash() -> None:
    p = SamplingParams(temperature=1, stop_token_ids=[5, 6])
    assert p.stop_token_ids == (5, 6) and isinstance(p.temperature, float)
    assert p == SamplingParams(temperature=1.0, stop_token_ids=(5, 6)) and hash(p) == hash(p)
    assert SamplingParams().greedy and not p.greedy
    p.validate_for_vocab(7)
    with pytest.raises(ValueError, match="'stop_token_ids'.*vocab_size=6.*got 6"):
        p.validate_for_vocab(6)


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 2.0), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", math.nan), ("top_p", None),
    ("top_k", -1), ("top_k", 1.5), ("top_k", False),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0), ("seed", "7"),
    ("stop_token_ids", [1, -2]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3), ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("ignore_eos", None),
])
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"sampling field '{field}': expected .*, got "):
        SamplingParams(**{field: value})


def test_top_p_error_message() -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(top_p=1.5)
    assert str(e.value) == "sampling field 'top_p': expected a float in (0, 1], got 1.5"
