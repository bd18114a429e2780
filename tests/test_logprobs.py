"""Logprobs in the engine (issue #52): per generated token and per prompt token, with top-k alternatives, against
HF transformers' log_softmax of the same sequence; rows that ask mixed with rows that do not; with MTP the target's
values (equal to the plain engine's); processed logits (logit_bias) shift them; a prefill-only engine scores the
whole prompt but its last token (what a prefill node hands back). The model: the `tiny` preset with one MTP layer,
an 8-token vocabulary (so that random drafts are sometimes accepted), fp32."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine, RequestOutput
from baton.engine.loader import load_checkpoint
from baton.engine.logprobs import TokenLogprob
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams

VOCAB = 8
CHUNK = 8
PROMPTS = [[1, 2, 3, 1, 2], [7], [4, 1, 4, 6, 4, 4, 7, 4, 4, 5, 0, 3, 2, 6, 6, 1, 2, 5, 4], [3, 3]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = make_model(tmp_path_factory.mktemp("lp") / "m", "tiny", mtp_layers=1, seed=5, progress=False,
                     overrides={"vocab_size": VOCAB, "hybrid_override_pattern": "M*-", "mamba_num_heads": 4},
                     tokenizer=False, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    return load_checkpoint(out), hf


def engine_of(model, k: int = 0, **kw) -> LLMEngine:
    (cfg, weights), _ = model
    base = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=CHUNK,
                num_speculative_tokens=k, dtype="float32", num_kv_blocks=128)
    return LLMEngine(cfg, weights, EngineConfig(**{**base, **kw}))


def collect(engine: LLMEngine, prompts, params) -> list[tuple[list[int], list[TokenLogprob | None], tuple | None]]:
    """Per request: its tokens, the logprobs its outputs carried (None where one carried none) and the prompt
    logprobs of its first output."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
    got: dict[str, list] = {i: [[], [], None, 0] for i in ids}
    while engine.has_unfinished():
        outs: list[RequestOutput] = engine.step()
        for o in outs:
            g = got[o.request_id]
            g[0] += o.new_token_ids
            g[1] += o.logprobs if o.logprobs is not None else [None] * len(o.new_token_ids)
            if o.prompt_logprobs is not None:
                g[3] += 1
                g[2] = o.prompt_logprobs
    assert all(g[3] <= 1 for g in got.values())  # prompt logprobs come once
    return [tuple(got[i][:3]) for i in ids]


@torch.inference_mode()
def reference(hf, seq: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits at every position of seq [len(seq), V]."""
    return hf(input_ids=torch.tensor([seq])).logits[0].float().log_softmax(-1)


def check(item: TokenLogprob, token: int, ref: torch.Tensor, k: int) -> None:
    """One position against the reference row ref [V]."""
    assert item.token_id == token
    assert item.logprob == pytest.approx(ref[token].item(), abs=1e-4)
    assert len(item.top) == k
    vals = [v for _, v in item.top]
    assert vals == sorted(vals, reverse=True)
    want = ref.topk(k)
    assert [t for t, _ in item.top] == want.indices.tolist()
    torch.testing.assert_close(torch.tensor(vals), want.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("async_on", [True, False])
def test_logprobs_and_prompt_logprobs_match_hf_in_a_mixed_batch(model, async_on):
    _, hf = model
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3),  # greedy
              SamplingParams(max_tokens=6, ignore_eos=True),  # no logprobs
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=7, logprobs=2,
                             prompt_logprobs=4),  # sampled; a prompt of several chunks
              SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)]
    got = collect(engine_of(model, async_scheduling=async_on), PROMPTS, params)
    for prompt, p, (tokens, lps, plps) in zip(PROMPTS, params, got, strict=True):
        assert len(tokens) == 6
        if p.logprobs is None:
            assert lps == [None] * 6 and plps is None
            continue
        ref = reference(hf, prompt + tokens)
        for j, (t, item) in enumerate(zip(tokens, lps, strict=True)):
            check(item, t, ref[len(prompt) - 1 + j], p.logprobs)
            if p.greedy:  # a greedy token is the most likely one
                assert item.logprob == pytest.approx(ref[len(prompt) - 1 + j].max().item(), abs=1e-4)
        if p.prompt_logprobs is None:
            assert plps is None
            continue
        assert len(plps) == len(prompt) and plps[0] is None
        for i in range(1, len(prompt)):
            check(plps[i], prompt[i], ref[i - 1], p.prompt_logprobs)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_logprobs_are_the_targets_and_equal_the_plain_engines(model, k):
    params = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1, prompt_logprobs=2),
              SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0)]
    plain = collect(engine_of(model), PROMPTS, params)
    engine = engine_of(model, k)
    spec = collect(engine, PROMPTS, params)
    assert engine.stats.spec_accepted > 0  # drafts were accepted: logprobs of accepted positions were read
    for (t0, l0, p0), (t1, l1, p1) in zip(plain, spec, strict=True):
        assert t0 == t1
        assert len(l0) == len(l1)
        for a, b in zip(l0, l1, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert (p0 is None) == (p1 is None)
        if p0 is not None:
            assert [x and x.token_id for x in p0] == [x and x.token_id for x in p1]
            assert [x and round(x.logprob, 3) for x in p0] == [x and round(x.logprob, 3) for x in p1]


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_are_of_the_processed_logits(model, k):
    """logit_bias shifts the logits the row decides on: its logprobs are log_softmax(model logits + bias)."""
    _, hf = model
    bias = {3: 2.5, 5: -1.0}
    params = SamplingParams(max_tokens=5, ignore_eos=True, logprobs=4, logit_bias=bias)
    [(tokens, lps, _)] = collect(engine_of(model, k), PROMPTS[:1], params)
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([PROMPTS[0] + tokens])).logits[0].float().clone()
    with torch.inference_mode():
        for t, b in bias.items():
            logits[:, t] += b
        ref = logits.log_softmax(-1)
    for j, (t, item) in enumerate(zip(tokens, lps, strict=True)):
        check(item, t, ref[len(PROMPTS[0]) - 1 + j], 4)


@pytest.mark.parametrize("k", [0, 1])
def test_a_prefill_only_engine_scores_every_prompt_token_but_the_first(model, k):
    """What a prefill node computes (N-1 tokens) scores prompt tokens 1..N-1: all the prompt logprobs there are."""
    _, hf = model
    prompt = PROMPTS[2]
    engine = engine_of(model, k, prefill_only=True)
    engine.add_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=3), prefill_only=True)
    outs = [o for _ in range(20) for o in engine.step()]
    (held,) = outs
    assert held.finish_reason == "prefilled"
    ref = reference(hf, prompt)
    assert len(held.prompt_logprobs) == len(prompt) and held.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        check(held.prompt_logprobs[i], prompt[i], ref[i - 1], 3)
    engine.free_held(held.held_block_ids, held.held_state_slot)


def test_logprobs_above_the_engines_bound_are_refused(model):
    engine = engine_of(model, max_logprobs=5)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"'{name}'.*max_logprobs=5.*got 6"):
            engine.add_request([1, 2], SamplingParams(**{name: 6}))
    with pytest.raises(ValueError, match="'logprobs'"):
        SamplingParams(logprobs=-1)
    engine.add_request([1, 2], SamplingParams(logprobs=5, prompt_logprobs=5))


def test_mtp_logprobs_of_sampled_rows_are_the_targets_at_each_emitted_position(model):
    """Sampled rows under K = 2: every emitted token's logprobs (accepted drafts and the drawn token alike) are
    the target's log_softmax at its position, whatever the drafter proposed."""
    _, hf = model
    params = [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=s, logprobs=2) for s in (1, 2, 3)]
    engine = engine_of(model, 2)
    got = collect(engine, PROMPTS[:3], params)
    assert engine.stats.spec_accepted > 0
    for prompt, (tokens, lps, _) in zip(PROMPTS[:3], got, strict=True):
        ref = reference(hf, prompt + tokens)
        for j, (t, item) in enumerate(zip(tokens, lps, strict=True)):
            check(item, t, ref[len(prompt) - 1 + j], 2)


def test_prompt_logprobs_after_a_cached_prefix_score_the_whole_prompt(model):
    """A prompt whose prefix the prefix cache holds is computed in full when it asks for prompt logprobs: a cached
    prefix has no logits to score."""
    _, hf = model
    prompt = PROMPTS[2]
    engine = engine_of(model, prefix_checkpoint_stride=1)
    collect(engine, [prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    hits = engine.scheduler.prefix.hit_tokens
    (_, _, plps), = collect(engine, [prompt], SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2))
    assert engine.scheduler.prefix.hit_tokens == hits  # no hit taken
    ref = reference(hf, prompt)
    assert len(plps) == len(prompt) and plps[0] is None
    for i in range(1, len(prompt)):
        check(plps[i], prompt[i], ref[i - 1], 2)
    collect(engine, [prompt], SamplingParams(max_tokens=2, ignore_eos=True))
    assert engine.scheduler.prefix.hit_tokens > hits  # (without prompt logprobs the same prompt hits)
