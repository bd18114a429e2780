"""Logprobs through a real disaggregated cluster (router + prefill node + decode node processes): the gRPC SDK's
`Completion` / `Chunk`, and OpenAI's shapes on /v1/chat/completions and /v1/completions (with `echo`), streaming and
not, parsed by the `openai` client. Values equal the offline engine's; prompt logprobs of a disaggregated request
come from the prefill node (its N-1 positions score prompt tokens 1..N-1); bounds are refused naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import openai
import pytest

from baton.cli.cluster import Cluster
from baton.client import Client, InvalidArgumentError
from baton.engine.engine_config import EngineConfig
from baton.engine.llm_engine import LLMEngine
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import TextTokenizer, load_tokenizer
from tests.test_e2e import ENGINE, ENGINE_ARGS
from tests.test_openai_http import with_chat_template

MAX_TOKENS = 6
TOL = 2e-2  # the nodes and the offline engine batch differently (a 16-bit model)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("openai-lp") / "tiny"
    make_model(out, preset="tiny", seed=31, progress=False)
    with_chat_template(out)
    return out


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    with Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 router_args=("--max-logprobs", "5"), log_dir=str(tmp_path_factory.mktemp("lp-logs"))) as c:
        yield c


def offline(model: Path, prompt: list[int], params: SamplingParams):
    """(tokens, logprobs per token, prompt logprobs) of the aggregated engine."""
    engine = LLMEngine.from_pretrained(model, EngineConfig(**ENGINE))
    engine.add_request(prompt, params)
    tokens, lps, plps = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            lps += o.logprobs or ()
            plps = o.prompt_logprobs if o.prompt_logprobs is not None else plps
    return tokens, lps, plps


def client_of(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.router_http_url + "/v1", api_key="unused", max_retries=0,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


PROMPT = [(11 * i + 5) % 500 + 3 for i in range(40)]
GREEDY = {"max_tokens": MAX_TOKENS, "ignore_eos": True}


def test_sdk_logprobs_and_prompt_logprobs_over_a_disaggregated_cluster(cluster, model):
    tokens, lps, plps = offline(model, PROMPT, SamplingParams(**GREEDY, logprobs=3, prompt_logprobs=2))
    with Client(cluster.router_addr, retries=0) as c:
        out = c.generate(PROMPT, **GREEDY, logprobs=3, prompt_logprobs=2)
        assert list(out.token_ids) == tokens
        assert [x.token_id for x in out.logprobs] == tokens
        for got, want in zip(out.logprobs, lps, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=TOL)
            assert [t for t, _ in got.top] == [t for t, _ in want.top]
        # The prefill node scored the prompt (tokens 1..N-1).
        assert [x.token_id for x in out.prompt_logprobs] == PROMPT[1:]
        for got, want in zip(out.prompt_logprobs, plps[1:], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=TOL) and len(got.top) == 2
        chunks = list(c.stream(PROMPT, **GREEDY, logprobs=1))
        streamed = [x for ch in chunks for x in ch.logprobs or ()]
        assert [x.token_id for x in streamed] == tokens
        assert all(ch.prompt_logprobs is None for ch in chunks)
        # A one-token prompt is prefilled on the decode node: no prompt token has logprobs.
        one = c.generate([PROMPT[0]], **GREEDY, logprobs=0, prompt_logprobs=0)
        assert len(one.logprobs) == MAX_TOKENS and all(x.top == () for x in one.logprobs)
        assert one.prompt_logprobs == ()
        with pytest.raises(InvalidArgumentError, match="logprobs.*--max-logprobs.*got 6"):
            c.generate(PROMPT, logprobs=6)
        with pytest.raises(InvalidArgumentError, match="prompt_logprobs.*got 9"):
            c.generate(PROMPT, prompt_logprobs=9)


def test_chat_logprobs_in_openais_shape(cluster, model):
    tok: TextTokenizer = load_tokenizer(model)
    client = client_of(cluster)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    out = client.chat.completions.create(**body)
    choice = out.choices[0]
    ids = choice.model_dump()["token_ids"]
    content = choice.logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in ids]
    for e in content:
        assert bytes(e.bytes).decode(errors="replace") == e.token and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the top token
        assert [a.logprob for a in e.top_logprobs] == sorted((a.logprob for a in e.top_logprobs), reverse=True)
        assert all(bytes(a.bytes).decode(errors="replace") == a.token for a in e.top_logprobs)
    streamed = [e for ch in client.chat.completions.create(**body, stream=True) if ch.choices
                for e in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(**{**body, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    for bad, param in [({"top_logprobs": 6}, "top_logprobs"), ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
                       ({"logprobs": 2}, "logprobs")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**body, **bad})
        assert e.value.body["param"] == param
    client.close()


def test_completions_logprobs_and_echo_in_openais_shape(cluster, model):
    tok: TextTokenizer = load_tokenizer(model)
    tokens, lps, plps = offline(model, PROMPT, SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=2))
    client = client_of(cluster)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2,
            "extra_body": {"ignore_eos": True}}
    out = client.completions.create(**body)
    lp = out.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in tokens]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in lps], abs=TOL)
    assert [len(d) for d in lp.top_logprobs] == [len({tok.decode([t]) for t, _ in x.top}) for x in lps]
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(tokens))]
    # echo: the prompt's text and logprobs first (the first token has none), then the completion's.
    echo = client.completions.create(**body, echo=True)
    text, elp = echo.choices[0].text, echo.choices[0].logprobs
    assert text == tok.decode(PROMPT) + tok.decode(tokens)
    assert len(elp.tokens) == len(PROMPT) + MAX_TOKENS
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    want = [x.logprob for x in plps[1:]] + [x.logprob for x in lps]
    assert elp.token_logprobs[1:] == pytest.approx(want, abs=TOL)
    assert elp.text_offset[len(PROMPT)] == len(tok.decode(PROMPT))
    assert all(math.isfinite(v) for v in elp.token_logprobs[1:])
    chunks = [ch for ch in client.completions.create(**body, echo=True, stream=True) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == text
    streamed = [v for ch in chunks if ch.choices[0].logprobs for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(elp.token_logprobs[1:], abs=1e-4)
    # Echo without logprobs: the text only.
    plain = client.completions.create(**{**body, "logprobs": None}, echo=True)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**body, "logprobs": 6})
    assert e.value.body["param"] == "logprobs"
    client.close()
