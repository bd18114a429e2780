"""Logits processing in the engine: penalties, logit_bias, min_tokens and min_p take effect in plain steps (with
async scheduling, where the newest output is still on the device), in MTP verify steps (drafts count as
generated at the positions after them, so speculative decoding emits the plain engine's tokens), and in the
prompt's first token. The model: test_spec_decode's small MTP model with an 8-token vocabulary (random weights
repeat tokens a lot, so penalties show)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from baton.engine.sampling_params import SamplingParams
from tests.test_spec_decode import new_engine, prefill_elsewhere, run, small_spec_model  # noqa: F401  (fixture)

PROMPTS = [[1, 2, 3, 1, 2], [7], [4, 4, 4, 4, 4, 4, 4, 4, 4, 5]]
N = 10


def _generate(model, k: int, params: SamplingParams, async_on: bool = True, prompts=PROMPTS):
    engine = new_engine(model, k, async_scheduling=async_on)
    outs = engine.generate(prompts, params)
    return [list(o.token_ids) for o in outs], sum(o.num_accepted for o in outs)


def test_penalised_greedy_equals_a_step_by_step_logit_bias_reference(small_spec_model):  # noqa: F811
    """presence / frequency penalties are a logit_bias of -(frequency * count + presence) on each generated token:
    the penalised request, decoded with async scheduling, equals one-token requests carrying that bias."""
    pen = SamplingParams(max_tokens=N, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6)
    got, _ = _generate(small_spec_model, 0, pen)
    plain, _ = _generate(small_spec_model, 0, SamplingParams(max_tokens=N, ignore_eos=True))
    assert got != plain
    engine = new_engine(small_spec_model, 0, async_scheduling=False)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        want: list[int] = []
        for _ in range(N):
            counts = Counter(want)
            bias = {t: -(0.6 * c + 0.8) for t, c in counts.items()}
            one = SamplingParams(max_tokens=1, ignore_eos=True, logit_bias=bias)
            want.append(engine.generate([prompt + want], one)[0].token_ids[0])
        assert tokens == want


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=0.7),
    SamplingParams(max_tokens=N, ignore_eos=True, presence_penalty=1.5, repetition_penalty=0.6),
], ids=["repetition-frequency", "presence-repetition"])
def test_speculative_decoding_with_penalties_emits_the_plain_engines_tokens(small_spec_model, params):  # noqa: F811
    # The middle request is not penalised: a batch mixes processed and unprocessed rows.
    none = SamplingParams(max_tokens=N, ignore_eos=True)
    mixed = [params, none, params]
    plain, _ = _generate(small_spec_model, 0, mixed)
    spec, accepted = _generate(small_spec_model, 2, mixed)
    assert accepted > 0  # drafts were accepted, so verify positions after them were penalised with them counted
    assert spec == plain
    unpenalised, _ = _generate(small_spec_model, 0, none)
    assert plain[1] == unpenalised[1] and (plain[0], plain[2]) != (unpenalised[0], unpenalised[2])


@pytest.mark.parametrize("k", [0, 2])
def test_logit_bias_forces_a_token_and_min_tokens_holds_back_a_stop(small_spec_model, k):  # noqa: F811
    forced, _ = _generate(small_spec_model, k, SamplingParams(max_tokens=6, ignore_eos=True, logit_bias={5: 100}))
    assert forced == [[5] * 6] * len(PROMPTS)
    first = _generate(small_spec_model, k, SamplingParams(max_tokens=1, ignore_eos=True))[0]
    for prompt, [stop] in zip(PROMPTS, first, strict=True):
        early = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop])
        assert _generate(small_spec_model, k, early, prompts=[prompt])[0] == [[stop]]
        held = SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=[stop], min_tokens=4)
        [tokens] = _generate(small_spec_model, k, held, prompts=[prompt])[0]
        assert len(tokens) >= 4 and stop not in tokens[:4]


@pytest.mark.parametrize("k", [0, 2])
def test_min_p_of_one_keeps_only_the_top_token(small_spec_model, k):  # noqa: F811
    greedy, _ = _generate(small_spec_model, k, SamplingParams(max_tokens=N, ignore_eos=True))
    hot = SamplingParams(max_tokens=N, ignore_eos=True, temperature=5.0, seed=3)
    drawn, _ = _generate(small_spec_model, k, hot)
    assert drawn != greedy
    only_top, _ = _generate(small_spec_model, k, SamplingParams(max_tokens=N, ignore_eos=True, temperature=5.0,
                                                                  seed=3, min_p=1.0))
    assert only_top == greedy


@pytest.mark.parametrize("k", [0, 2])
def test_a_transferred_request_is_penalised_as_an_aggregated_one(small_spec_model, k):  # noqa: F811
    """Disaggregated: the decode engine gets the prompt with the transferred caches, so repetition_penalty (which
    reads the prompt) and the other fields give the aggregated engine's tokens (R6)."""
    params = SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=0.5,
                            logit_bias={1: -2.0}, min_tokens=3, stop_token_ids=[0])
    prompt = PROMPTS[2]
    aggregated, _ = _generate(small_spec_model, k, params, prompts=[prompt])
    dec = new_engine(small_spec_model, k)
    moved = run(dec, [[("moved", "m", prompt, prefill_elsewhere(small_spec_model, k, prompt))]], params)
    assert [list(moved["m"].token_ids)] == aggregated
    plain, _ = _generate(small_spec_model, k, SamplingParams(max_tokens=N, ignore_eos=True), prompts=[prompt])
    assert plain != aggregated


def _raw_logits(engine, tokens: list[int]):
    """The model's raw next-token logits after `tokens` [V] float32 (one prefill step of a throwaway request)."""
    rid = engine.add_request(tokens, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:  # (a long prompt is prefilled in chunks: the last one samples)
        out = engine.scheduler.schedule()
        res = engine.runner.execute(out, return_logits=True)
        engine.step_update.update(out, res.sampled)
        if rid in res.logits:
            engine.runner.remove_request(rid)
            return res.logits[rid].float().clone()


def test_repetition_penalty_reads_the_prompt_aggregated_and_disaggregated(small_spec_model):  # noqa: F811
    """HF / vLLM's repetition penalty over prompt + outputs (a positive logit divided, a negative one multiplied),
    step by step from the raw logits, is what the engine emits: plain, with MTP, and transferred with MTP."""
    params = SamplingParams(max_tokens=N, ignore_eos=True, repetition_penalty=3.0)
    prompt = PROMPTS[2]
    ref_engine = new_engine(small_spec_model, 0, async_scheduling=False)
    want: list[int] = []
    for _ in range(N):
        z = _raw_logits(ref_engine, prompt + want)
        seen = sorted(set(prompt + want))
        z[seen] = torch.where(z[seen] > 0, z[seen] / 3.0, z[seen] * 3.0)
        want.append(int(z.argmax()))
    assert want != _generate(small_spec_model, 0, SamplingParams(max_tokens=N, ignore_eos=True), prompts=[prompt])[0][0]
    for k in (0, 2):
        assert _generate(small_spec_model, k, params, prompts=[prompt])[0] == [want], k
    dec = new_engine(small_spec_model, 2)
    moved = run(dec, [[("moved", "m", prompt, prefill_elsewhere(small_spec_model, 2, prompt))]], params)
    assert list(moved["m"].token_ids) == want
