"""Logits processing (logit_bias, min_tokens, penalties, min_p) against a straightforward per-row torch reference,
on plain rows and verify rows (position j counts drafts 0..j-1 as generated), with a newest output still PENDING
on the device, and SamplingParams' validation of the new fields."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.engine.logits_processing import RowHistory, apply_processing, generated_counts, logits_inputs
from baton.engine.request import PENDING
from baton.engine.sampling_params import SamplingParams


def reference(z: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int], stop: set[int]
              ) -> torch.Tensor:
    """One position's processed logits, op by op as vLLM defines them: z [V] raw logits."""
    z = z.float().clone()
    V = z.shape[0]
    for t, b in p.logit_bias:
        z[t] += b
    if len(generated) < p.min_tokens:
        for t in stop:
            z[t] = float("-inf")
    counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=V).float()
    if p.repetition_penalty != 1:
        seen = counts > 0
        seen[prompt] = True
        z = torch.where(seen, torch.where(z > 0, z / p.repetition_penalty, z * p.repetition_penalty), z)
    z = z - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
    if p.min_p > 0 and not p.greedy:
        probs = (z / p.temperature).softmax(-1)
        z = z.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return z


PARAMS = [
    SamplingParams(max_tokens=8, repetition_penalty=1.3),
    SamplingParams(max_tokens=8, presence_penalty=0.7, frequency_penalty=0.4, temperature=0.8),
    SamplingParams(max_tokens=8, logit_bias={3: 5.0, 9: -100.0}),
    SamplingParams(max_tokens=8, min_tokens=4),
    SamplingParams(max_tokens=8, min_p=0.2, temperature=0.7, repetition_penalty=0.8, frequency_penalty=-0.5),
    SamplingParams(max_tokens=8),  # nothing to process, in a batch that has
]


def _histories(g: torch.Generator, V: int) -> list[RowHistory]:
    out = []
    for r in range(len(PARAMS)):
        prompt = torch.randint(V, (5,), generator=g).tolist()
        outputs = torch.randint(V, (r % 3 + 1,), generator=g).tolist()
        out.append(RowHistory(prompt, outputs, frozenset({0, 1})))
    return out


@pytest.mark.parametrize("K", [0, 3])
def test_processing_matches_the_reference_at_every_verify_position(K):
    g = torch.Generator().manual_seed(0)
    V = 12
    hist = _histories(g, V)
    R = len(PARAMS)
    logits = torch.randn(R, K + 1, V, generator=g) * 3
    drafts = torch.randint(V, (R, K), generator=g)
    # Repeated drafts, so that a count of 2 and more shows.
    drafts[:, 1:2] = drafts[:, :1] if K else drafts[:, 1:2]
    num_draft = torch.tensor([min(K, r % 4) for r in range(R)])
    inputs = logits_inputs(PARAMS, hist, torch.device("cpu"))
    got = apply_processing(logits, drafts, num_draft, inputs)
    for r, (p, h) in enumerate(zip(PARAMS, hist, strict=True)):
        for j in range(int(num_draft[r]) + 1):
            want = reference(logits[r, j], p, list(h.prompt), [*h.outputs, *drafts[r, :j].tolist()],
                             set(h.stop_ids))
            torch.testing.assert_close(got[r, j], want, msg=f"row {r} position {j}")


def test_16_bit_logits_are_processed_in_float32_and_rounded_once_before_min_p():
    """bf16 logits give bf16 processed rows: each row's float32 processing rounded to bf16, then min_p against the
    rounded maximum, on the rounded values (so the draw reads 16-bit rows, as it does without processing)."""
    g = torch.Generator().manual_seed(3)
    V = 40
    hist = _histories(g, V)
    R = len(PARAMS)
    logits = (torch.randn(R, 1, V, generator=g) * 3).bfloat16()
    none = torch.zeros(R, 0, dtype=torch.int64)
    got = apply_processing(logits, none, torch.zeros(R, dtype=torch.int64), logits_inputs(PARAMS, hist,
                                                                                            torch.device("cpu")))
    assert got.dtype == torch.bfloat16
    for r, (p, h) in enumerate(zip(PARAMS, hist, strict=True)):
        plain = dataclasses.replace(p, min_p=0.0)
        want = reference(logits[r, 0], plain, list(h.prompt), list(h.outputs), set(h.stop_ids)).bfloat16()
        if p.min_p > 0:
            z = want.float()
            want = want.masked_fill(z < z.max() + p.temperature * torch.log(torch.tensor(p.min_p)), float("-inf"))
        assert torch.equal(got[r, 0], want), f"row {r}"


def test_a_pending_newest_output_is_counted_from_the_device():
    V = 6
    p = SamplingParams(max_tokens=8, frequency_penalty=1.0)
    hist = [RowHistory([0], [2, 2, PENDING], frozenset())]
    inputs = logits_inputs([p], hist, torch.device("cpu"))
    inputs = inputs.with_anchor([0], torch.tensor([4]))
    counts = generated_counts(inputs, torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), V)
    assert counts[0, 0].tolist() == [0, 0, 2, 0, 1, 0]
    with pytest.raises(ValueError, match="at most the newest output PENDING"):
        logits_inputs([p], [RowHistory([0], [PENDING, 2], frozenset())], torch.device("cpu"))


def test_min_tokens_stops_masking_once_reached_and_nothing_to_do_gives_none():
    p = SamplingParams(max_tokens=8, min_tokens=2)
    assert logits_inputs([p], [RowHistory([0], [1, 1], frozenset({0}))], torch.device("cpu")) is None
    inputs = logits_inputs([p], [RowHistory([0], [1], frozenset({0}))], torch.device("cpu"))
    z = apply_processing(torch.zeros(1, 3, 4), torch.tensor([[3, 3]]), torch.tensor([2]), inputs)
    # Output 1 (position 0) may not stop; outputs 2 and 3 may.
    assert z[0, :, 0].tolist() == [float("-inf"), 0.0, 0.0]


def test_greedy_rows_ignore_min_p_and_take_the_penalised_argmax():
    logits = torch.tensor([[[4.0, 3.9, -1.0]]])
    greedy = SamplingParams(max_tokens=4, min_p=0.9, presence_penalty=0.5)
    inputs = logits_inputs([greedy], [RowHistory([2], [0], frozenset())], torch.device("cpu"))
    z = apply_processing(logits, torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), inputs)
    assert z[0, 0].argmax().item() == 1 and torch.isfinite(z).all()


@pytest.mark.parametrize(("field", "value", "message"), [
    ("min_p", 1.5, "min_p"), ("min_p", -0.1, "min_p"), ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", float("nan"), "frequency_penalty"), ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", float("inf"), "repetition_penalty"), ("logit_bias", {3: 101}, "logit_bias"),
    ("logit_bias", {-1: 1}, "logit_bias"), ("logit_bias", {"3": 1}, "logit_bias"), ("logit_bias", 3, "logit_bias"),
    ("min_tokens", 9, "min_tokens"), ("min_tokens", -1, "min_tokens"), ("min_tokens", True, "min_tokens"),
])
def test_bad_values_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=f"'{message}'"):
        SamplingParams(max_tokens=8, **{field: value})


def test_logit_bias_is_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={5: 1, 2: -3.5})
    assert p.logit_bias == ((2, -3.5), (5, 1.0))
    assert p == SamplingParams(logit_bias=[(5, 1.0), (2, -3.5)])
    with pytest.raises(ValueError, match="logit_bias"):
        p.validate_for_vocab(5)
