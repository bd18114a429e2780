"""Structured output in the engine (issue #52): a request's grammar (JSON object / schema, regex) masks its tokens
before the draw, greedy or sampled, beside plain rows, with async scheduling, with MTP (greedy output with K > 0
equals K = 0: each verify position is masked with the grammar advanced over the drafts before it) and with the
prompt prefilled elsewhere (the decode side applies the grammar from its first token).

The model: the `tiny` preset with one MTP layer and its byte-level tokenizer (the grammar's vocabulary)."""

from __future__ import annotations

import json

import llguidance
import numpy as np
import pytest
from llguidance.numpy import fill_next_token_bitmask

from baton.engine.engine_config import EngineConfig
from baton.engine.grammar import Grammars
from baton.engine.llm_engine import LLMEngine
from baton.engine.loader import load_checkpoint
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.structured_output import StructuredOutput, grammar_text
from baton.engine.tokenizer import load_tokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 4}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                         "ok": {"type": "boolean"}}}
JSON = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]


def valid(text: str) -> bool:
    """`text` is a JSON instance of SCHEMA."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(v, dict) and set(v) == {"name", "age", "ok"} and isinstance(v["name"], str)
            and len(v["name"]) <= 4 and type(v["age"]) is int and 0 <= v["age"] <= 99 and isinstance(v["ok"], bool))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("so") / "m", "tiny", mtp_layers=1, seed=5, progress=False)


@pytest.fixture(scope="module")
def tok(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return load_checkpoint(model_dir)


def engine(model, tok, k: int = 0, **kw) -> LLMEngine:
    cfg, weights = model
    e = LLMEngine(cfg, weights, EngineConfig(**{**dict(dtype="float32", num_kv_blocks=96, block_size=4,
                                                         max_num_seqs=8, num_speculative_tokens=k), **kw}))
    if tok is not None:
        e.use_tokenizer(tok)
    return e


def texts(e: LLMEngine, tok, params, prompts=PROMPTS) -> list[tuple[str, str]]:
    return [(tok.decode(o.token_ids), o.finish_reason) for o in e.generate(prompts, params)]


def test_schema_rows_beside_a_plain_row_greedy_and_sampled(model, tok):
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(max_tokens=60, structured_output=JSON)
    sampled = [SamplingParams(max_tokens=60, temperature=1.5, seed=s, structured_output=JSON) for s in range(3)]
    e = engine(model, tok)
    alone = texts(e, tok, plain, PROMPTS[1:2])[0]
    got = texts(e, tok, [greedy, plain, sampled[0]])
    assert got[1] == alone  # a grammar row leaves its neighbours alone
    many = texts(e, tok, sampled, [PROMPTS[0]] * 3)
    for text, reason in [got[0], got[2], *many]:
        assert valid(text) and reason == "stop", text
    assert len({t for t, _ in many}) > 1  # sampling still samples, within the grammar
    # Without the grammar the random model writes no JSON at all.
    assert not valid(texts(e, tok, SamplingParams(max_tokens=60))[0][0])


def test_sync_equals_async_and_regex_and_json_object(model, tok):
    params = [SamplingParams(max_tokens=40, structured_output=StructuredOutput("regex", r"(ab|c)[0-9]{3}")),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_output=StructuredOutput("json_object")),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    sync = texts(engine(model, tok, async_scheduling=False), tok, params)
    assert texts(engine(model, tok, async_scheduling=True), tok, params) == sync
    (code, r0), (obj, r1), _ = sync
    assert r0 == "stop" and code[:-3] in ("ab", "c") and code[-3:].isdigit()
    assert r1 == "length" or isinstance(json.loads(obj), dict)


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_greedy_equals_plain_decoding(model, tok, k):
    params = [SamplingParams(max_tokens=60, structured_output=JSON), SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=40, structured_output=StructuredOutput("regex", r"[a-z]{2,9}\.[0-9]+!"))]
    want = texts(engine(model, tok), tok, params)
    assert texts(engine(model, tok, k), tok, params) == want
    sampled = SamplingParams(max_tokens=60, temperature=1.0, seed=9, structured_output=JSON)
    (text, reason), = texts(engine(model, tok, k), tok, sampled, PROMPTS[:1])
    assert valid(text) and reason == "stop"


def test_verify_masks_follow_the_drafts(tok):
    """Position j's mask is the grammar's after drafts 0..j-1; after a refused draft everything is allowed; the
    matcher is rolled back (the next call gives the same masks)."""
    g = Grammars(tok.tokenizer.to_str(), 512, [2])
    outputs: list[int] = []
    g.add("r", JSON, outputs)
    text = tok.encode('{"name":"ab')
    outputs.extend(text[:1])
    drafts = text[1:]
    got = g.masks("r", drafts, len(drafts) + 1)
    ref = llguidance.LLMatcher(llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=512, eos_token=[2]),
                               grammar_text(JSON))
    ref.consume_tokens(text[:1])
    want = np.full_like(got, -1)
    for j, d in enumerate([*drafts, None]):
        fill_next_token_bitmask(ref, want, j)
        if d is not None:
            assert ref.consume_token(d)
    assert (got == want).all()
    assert (g.masks("r", drafts, len(drafts) + 1) == got).all()
    bad = [drafts[0], tok.encode("}")[0], drafts[1]]  # "}" cannot follow '{"name"'
    masks = g.masks("r", bad, 4)
    assert (masks[:2] == got[:2]).all() and (masks[2:] == -1).all()
    assert not g.catch_up("r")


def test_prefilled_elsewhere_applies_the_grammar_from_the_first_token(model, tok):
    prompt = PROMPTS[2]
    params = SamplingParams(max_tokens=60, structured_output=JSON)
    want = texts(engine(model, tok), tok, params, [prompt])[0]
    pre = engine(model, None, prefill_only=True)  # no tokenizer: a prefill node never applies the grammar
    pre.add_request(prompt, params, prefill_only=True)
    (held,) = [o for _ in range(30) for o in pre.step()]
    dec = engine(model, tok)
    blocks, slot = dec.reserve(len(prompt) - 1)
    dec.pools.kv[blocks] = pre.pools.kv[list(held.held_block_ids)]
    for name in ("conv", "ssm"):
        dec.pools.states[name][slot] = pre.pools.states[name][held.held_state_slot]
    dec.add_computed_request(prompt, params, "moved", blocks, slot, num_computed=len(prompt) - 1)
    pre.free_held(held.held_block_ids, held.held_state_slot)
    out = None
    while dec.has_unfinished():
        out = next((o for o in dec.step() if o.finished), out)
    assert (tok.decode(out.token_ids), out.finish_reason) == want and valid(want[0])


def test_refused_without_a_tokenizer_and_for_bad_grammars(model):
    e = engine(model, None)
    with pytest.raises(ValueError, match="structured_output"):
        e.add_request([1, 2], SamplingParams(structured_output=JSON))
    assert not e.has_unfinished()
    for kind, value in [("json_schema", "{"), ("json_schema", '{"type": 5}'), ("regex", "[a-"), ("xml", "")]:
        with pytest.raises(ValueError, match="structured_output"):
            StructuredOutput(kind, value)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_output=JSON)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verify_accepts_only_drafts_the_grammar_allows(tok, temperature):
    """Target logits that favour every draft: valid drafts are all accepted; from a draft the grammar refuses on,
    the row stops accepting and its sampled token is one the grammar allows there."""
    import torch

    from baton.engine.logits_processing import RowHistory, allowed_tokens, logits_inputs
    from baton.engine.ops.kernels import resolve_kernels
    from baton.engine.rejection_sampler import RejectionSampler

    g = Grammars(tok.tokenizer.to_str(), 512, [2])
    text = tok.encode('{"name":"ab')
    outputs = list(text[:1])
    g.add("r", JSON, outputs)
    good, bad = text[1:4], [text[1], tok.encode("}")[0], text[3]]
    params = SamplingParams(max_tokens=20, temperature=temperature, seed=1, structured_output=JSON)
    drafts = torch.tensor([good, bad])
    logits = torch.zeros(2, 4, 512)
    logits.scatter_(2, torch.cat([drafts, drafts[:, :1]], 1)[:, :, None], 30.0)  # each draft (and after) favoured
    masks = {0: g.masks("r", good, 4), 1: g.masks("r", bad, 4)}
    hist = RowHistory((), outputs, frozenset({2}))
    inputs = logits_inputs([params] * 2, [hist] * 2, torch.device("cpu"), masks)
    seeds = None if not temperature else torch.tensor([7, 7])
    res = RejectionSampler(3, resolve_kernels("auto", "cpu")).verify(
        logits, drafts, None, torch.tensor([3, 3]), [params] * 2, seeds,
        None if seeds is None else torch.tensor([1, 1]), inputs)
    assert res.accepted_counts.tolist() == [3, 1]
    final = res.output_token_ids[1, 1].item()
    assert allowed_tokens(torch.from_numpy(masks[1][1]), 512)[final] and final != bad[1]
