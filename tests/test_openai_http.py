"""The router's OpenAI-compatible HTTP API (router/openai_http.py), driven by the official `openai` client.

Over fake workers (fast): /v1/models; completions from token ids, several prompts, streaming with a final
usage chunk; stop strings (cut text, finish_reason "stop", the nodes told to abort, counted as ok); chat
through a Jinja template; OpenAI-format errors (400 / 404 / 405 / 503) as the client's exception classes;
a client that walks away mid-stream cancels the request on the nodes.
Against a real cluster (router + prefill + decode processes): greedy completions (token ids and text)
equal the offline engine, streaming gives the same text, chat renders the template as transformers does,
and a disconnect mid-stream frees every block and slot on both nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from baton.cli.cluster import Cluster
from baton.engine import tokenizer_train
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.tokenizer import TOKENIZER_CONFIG_FILE, TextTokenizer, load_tokenizer
from baton.router.config import RouterConfig
from baton.router.http_limits import HttpLimits
from baton.router.server import Router, start_router
from tests.test_e2e import ENGINE_ARGS, all_free, offline
from tests.test_router_fakes import VOCAB, FakeWorker, eventually, expected_tokens, run, start_fake

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# The same, rendering `tools` and an assistant's `tool_calls` in the Hermes syntax (what tool_choice "auto" reads).
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>Tools:{% for t in tools %} {{ t | tojson }}{% endfor %}\nCall one as "
    "<tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>\n{% endif %}{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}\n<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def with_chat_template(model_dir: Path, template: str = CHAT_TEMPLATE) -> None:
    path = model_dir / TOKENIZER_CONFIG_FILE
    cfg = json.loads(path.read_text())
    cfg["chat_template"] = template
    path.write_text(json.dumps(cfg))


def http(method: str, url: str, body: bytes | None = None) -> tuple[int, dict]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def requests_total(router: Router, outcome: str) -> float:
    return router.service.metrics.registry.get_sample_value("baton_router_requests_total", {"outcome": outcome}) or 0


# ---- over fake workers --------------------------------------------------------------------------------
@dataclass
class Env:
    prefill: FakeWorker
    decode: FakeWorker
    router: Router
    client: openai.AsyncOpenAI
    url: str


@contextlib.asynccontextmanager
async def fake_front(tokenizer_dir: Path | None = None, served_model_name: str | None = None,
                     limits: HttpLimits | None = None, fakes_have_tokenizer: bool = False) -> AsyncIterator[Env]:
    started = [await start_fake("prefill", "p0"), await start_fake("decode", "d0")]
    for worker, _, _ in started:
        worker.has_tokenizer = fakes_have_tokenizer
    tok = str(tokenizer_dir / "tokenizer.json") if tokenizer_dir else None
    cfg = RouterConfig((started[0][2],), (started[1][2],), load_poll_interval_s=0.1, control_timeout_s=1.0,
                       tokenizer_path=tok)
    router = await start_router(cfg, 0, http_port=0, served_model_name=served_model_name, http_limits=limits)
    url = f"http://127.0.0.1:{router.http.port}"
    # The router runs on this loop: the async client keeps it free. No proxy must see 127.0.0.1.
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    try:
        yield Env(started[0][0], started[1][0], router, client, url)
    finally:
        await client.close()
        await router.stop(0)
        await asyncio.gather(*(s.stop(0) for _, s, _ in started))


@pytest.fixture
def tok_dir(tmp_path) -> Path:
    tokenizer_train.write_tokenizer(tmp_path, {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1,
                                               "eos_token_id": 2})
    with_chat_template(tmp_path)
    return tmp_path


def test_models_and_token_id_completions_over_fakes():
    async def go():
        async with fake_front() as env:
            c = env.client
            models = await c.models.list()
            assert [(m.id, m.owned_by) for m in models.data] == [("fake", "baton")]
            out = await c.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                             extra_body={"return_token_ids": True})
            choice = out.choices[0]
            assert choice.model_dump()["token_ids"] == expected_tokens([5, 6, 7], 4)
            assert (choice.text, choice.finish_reason, out.object, out.model) == ("", "length", "text_completion", "fake")
            assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 4, 7)
            sent = env.decode.decodes[0].sampling
            assert (sent.max_tokens, sent.temperature) == (4, 0)
            # Several prompts: one choice each, usage summed.
            out = await c.completions.create(model="fake", prompt=[[5, 6], [8, 9, 10]], max_tokens=3,
                                             extra_body={"return_token_ids": True})
            assert [ch.model_dump()["token_ids"] for ch in out.choices] == [
                expected_tokens([5, 6], 3), expected_tokens([8, 9, 10], 3)]
            assert [ch.index for ch in out.choices] == [0, 1]
            assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 6)
            # Streaming, with the final usage chunk.
            stream = await c.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=5, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"return_token_ids": True})
            chunks = [ch async for ch in stream]
            ids = [t for ch in chunks for choice in ch.choices for t in choice.model_dump()["token_ids"]]
            assert ids == expected_tokens([5, 6, 7], 5)
            assert chunks[-2].choices[0].finish_reason == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
            assert all(ch.usage is None for ch in chunks[:-1])
            # vLLM's continuous_usage_stats (aiperf's --per-chunk-usage): every chunk carries the usage so far.
            stream = await c.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=5, stream=True,
                                                stream_options={"include_usage": True,
                                                                "continuous_usage_stats": True},
                                                extra_body={"return_token_ids": True})
            chunks = [ch async for ch in stream]
            sofar = [len(ch.choices[0].model_dump()["token_ids"]) for ch in chunks[:-1]]
            assert [ch.usage.completion_tokens for ch in chunks[:-1]] == [sum(sofar[:k + 1])
                                                                        for k in range(len(sofar))]
            assert {ch.usage.prompt_tokens for ch in chunks} == {3} and chunks[-1].usage.completion_tokens == 5
            assert all(ch.usage.total_tokens == 3 + ch.usage.completion_tokens for ch in chunks)
            # Without include_usage it asks for nothing, as in vLLM; a non-boolean is refused naming it.
            stream = await c.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=5, stream=True,
                                                stream_options={"continuous_usage_stats": True})
            assert all(ch.usage is None for ch in [ch async for ch in stream])
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="fake", prompt=[5], stream=True,
                                           stream_options={"continuous_usage_stats": 1})
            assert e.value.body["param"] == "stream_options.continuous_usage_stats"
            assert requests_total(env.router, "ok") == 3 + 3  # the two prompts are two Generate calls
        async with fake_front(served_model_name="my-model") as env:
            assert [m.id for m in (await env.client.models.list()).data] == ["my-model"]
    run(go())


def test_text_stop_strings_and_chat_over_fakes(tok_dir):
    tok = load_tokenizer(tok_dir)
    reply = "Hello world. Goodbye now"

    async def go():
        async with fake_front(tok_dir) as env:
            c, d0 = env.client, env.decode
            d0.script = tok.encode(reply)
            out = await c.completions.create(model="fake", prompt="Say hi", max_tokens=50)
            assert (out.choices[0].text, out.choices[0].finish_reason) == (reply, "length")
            assert list(d0.decodes[-1].prompt_token_ids) == tok.encode("Say hi")
            d0.token_delay_s = 0.02  # the stop must catch the request while it still runs
            out = await c.completions.create(model="fake", prompt="Say hi", stop=["d. G", "zz"])
            assert (out.choices[0].text, out.choices[0].finish_reason) == ("Hello worl", "stop")
            assert out.usage.completion_tokens < len(d0.script)
            await eventually(lambda: f"{out.id}-0" in d0.aborts, what="abort after the stop string")
            stream = await c.completions.create(model="fake", prompt="Say hi", stop=". ", stream=True)
            chunks = [ch async for ch in stream]
            assert "".join(ch.choices[0].text for ch in chunks) == "Hello world"
            assert chunks[-1].choices[0].finish_reason == "stop"
            assert requests_total(env.router, "ok") == 3 and requests_total(env.router, "aborted") == 0
            # Chat: the template renders the messages, the reply comes back as the assistant's message.
            d0.token_delay_s = 0.0
            messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            out = await c.chat.completions.create(model="fake", messages=messages)
            rendered = "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
            assert list(d0.decodes[-1].prompt_token_ids) == tok.encode(rendered)
            # No max_tokens: as many as the context has room for.
            assert d0.decodes[-1].sampling.max_tokens == 64 - len(tok.encode(rendered))
            assert (out.object, out.choices[0].message.role, out.choices[0].message.content) == (
                "chat.completion", "assistant", reply)
            stream = await c.chat.completions.create(model="fake", messages=messages, stream=True,
                                                     stream_options={"include_usage": True}, max_tokens=5)
            chunks = [ch async for ch in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply
            assert chunks[-1].usage.prompt_tokens == len(tok.encode(rendered))
    run(go())


def test_errors_have_openai_format_and_status_over_fakes():
    async def go():
        async with fake_front() as env:
            c = env.client
            cases = [
                (dict(prompt=[1, 2], n=0), openai.BadRequestError, "n"),
                (dict(prompt=[1, 2], best_of=2), openai.BadRequestError, "best_of"),
                (dict(prompt=[1], presence_penalty=2.5), openai.BadRequestError, "presence_penalty"),
                (dict(prompt=[1], extra_body={"min_p": 1.5}), openai.BadRequestError, "min_p"),
                (dict(prompt=[1], extra_body={"repetition_penalty": 0}), openai.BadRequestError,
                 "repetition_penalty"),
                (dict(prompt=[1], logit_bias={"x": 1}), openai.BadRequestError, "logit_bias"),
                (dict(prompt=[1], logit_bias={"3": 101}), openai.BadRequestError, "logit_bias"),
                (dict(prompt=[1], logit_bias={str(VOCAB): 1}), openai.BadRequestError, "logit_bias"),  # the service
                (dict(prompt=[1], max_tokens=4, extra_body={"min_tokens": 5}), openai.BadRequestError,
                 "min_tokens"),
                (dict(prompt=[1, VOCAB]), openai.BadRequestError, "prompt"),  # the service's validation
                (dict(prompt=[1], temperature=-1), openai.BadRequestError, "temperature"),
                (dict(prompt="text"), openai.BadRequestError, "prompt"),  # no tokenizer
                (dict(prompt=[1], stop="x"), openai.BadRequestError, "stop"),
                (dict(prompt=[]), openai.BadRequestError, "prompt"),
                (dict(prompt=[1], logprobs=21), openai.BadRequestError, "logprobs"),  # above --max-logprobs
            ]
            for kw, exc, param in cases:
                with pytest.raises(exc) as e:
                    await c.completions.create(model="fake", **kw)
                assert e.value.status_code == 400 and e.value.type == "invalid_request_error", kw
                assert e.value.param == param and e.value.message, kw
            with pytest.raises(openai.BadRequestError) as e:  # also when streaming: before any event
                await c.completions.create(model="fake", prompt=[1], n=100, stream=True)
            assert e.value.param == "n"
            with pytest.raises(openai.NotFoundError) as e:
                await c.completions.create(model="gpt-4", prompt=[1])
            assert e.value.code == "model_not_found" and "gpt-4" in e.value.message
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
            assert e.value.code == "no_chat_template" and "chat template" in e.value.message
            status, body = await asyncio.to_thread(http, "POST", env.url + "/v1/completions", b"{not json")
            assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}
            status, body = await asyncio.to_thread(http, "GET", env.url + "/v1/completions")
            assert status == 405 and body["error"]["type"] == "invalid_request_error"
            # Every refusal counts, those of the HTTP front as those of the service.
            assert requests_total(env.router, "invalid") == len(cases) + 5
            env.decode.load_fails = True
            await eventually(lambda: not env.router.service.decode_pool.healthy_count(), what="decode unhealthy")
            with pytest.raises(openai.InternalServerError) as e:
                await c.completions.create(model="fake", prompt=[1, 2, 3])
            assert e.value.status_code == 503 and e.value.code == "unavailable"
    run(go())


def test_client_gone_mid_stream_cancels_the_request_over_fakes():
    async def go():
        async with fake_front() as env:
            env.decode.token_delay_s = 0.05
            stream = await env.client.completions.create(model="fake", prompt=[5, 6, 7], max_tokens=60,
                                                         stream=True, extra_body={"return_token_ids": True})
            seen = []
            async for chunk in stream:
                seen.append(chunk)
                if len(seen) == 3:
                    break
            await stream.close()  # the client walks away
            rid = f"{seen[0].id}-0"
            await eventually(lambda: rid in env.decode.aborts, what="the decode node told to abort")
            await eventually(lambda: requests_total(env.router, "cancelled") == 1, what="cancelled")
            assert env.router.service.metrics.registry.get_sample_value("baton_router_in_flight_requests") == 0
            # The same holds for a non-streaming client that gives up.
            with pytest.raises(openai.APITimeoutError):
                await env.client.completions.create(model="fake", prompt=[5, 6, 8], max_tokens=60, timeout=0.3)
            await eventually(lambda: requests_total(env.router, "cancelled") == 2, what="cancelled again")
    run(go())


# ---- a real cluster -----------------------------------------------------------------------------------
def check_sampling_fields(cluster: Cluster, client: openai.OpenAI, model: Path, prompt: list[int],
                          greedy_ref: list[int], greedy_text: str) -> None:
    """Each sampling field takes effect through the disaggregated cluster, over HTTP and gRPC: the tokens are the
    offline engine's with the same params, and differ from plain greedy decoding where the field changes them."""
    from baton.client import Client

    plain = {"max_tokens": 8, "ignore_eos": True}
    cases = {
        "penalties": ({"presence_penalty": 0.5, "frequency_penalty": 0.75, "repetition_penalty": 1.5}, True),
        "logit_bias": ({"logit_bias": {7: 100.0}}, True),
        "min_tokens": ({"stop_token_ids": [greedy_ref[0]], "min_tokens": 4}, False),
        "min_p": ({"temperature": 1.5, "seed": 3, "min_p": 1.0}, False),
    }
    want = offline(str(model), [prompt] * len(cases), [SamplingParams(**plain, **kw) for kw, _ in cases.values()])
    assert want[1] == [7] * 8 and want[3] == greedy_ref  # logit_bias forces 7; min_p = 1 keeps only the top token
    assert len(want[2]) >= 4 and greedy_ref[0] not in want[2][:4]
    with Client(cluster.router_addr, retries=0) as grpc_client:
        for (name, (kw, differs)), expect in zip(cases.items(), want, strict=True):
            if differs:
                assert expect != greedy_ref, name
            body = {**kw, "ignore_eos": True, "return_token_ids": True}
            if "logit_bias" in kw:
                body["logit_bias"] = {str(t): b for t, b in kw["logit_bias"].items()}
            out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                            temperature=kw.get("temperature", 0), extra_body=body)
            assert out.choices[0].model_dump()["token_ids"] == expect, name
            assert list(grpc_client.generate(prompt, **plain, **kw).token_ids) == expect, name
        # n: three choices, each reproducible from the request's seed; choice 0 is the request with n = 1.
        hot = {"max_tokens": 8, "temperature": 1.5, "seed": 9, "ignore_eos": True}
        out = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=8, temperature=1.5, seed=9,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        http_choices = [ch.model_dump()["token_ids"] for ch in out.choices]
        assert [ch.index for ch in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 24
        assert len({tuple(c) for c in http_choices}) > 1
        both = grpc_client.generate(prompt, n=3, **hot)
        assert [list(ch.token_ids) for ch in both.choices] == http_choices
        assert list(grpc_client.generate(prompt, **hot).token_ids) == http_choices[0]
        # Stop strings on gRPC: the text ends before the match, which is not returned.
        stop = greedy_text[3:6]
        cut = grpc_client.generate("The capital of France is", max_tokens=8, ignore_eos=True, stop=[stop])
        assert len(stop) == 3 and (cut.text, cut.finish_reason) == (greedy_text[:greedy_text.index(stop)], "stop")
        # Without min_tokens the stop id ends the request at once.
        early = grpc_client.generate(prompt, **plain, stop_token_ids=[greedy_ref[0]])
        assert (list(early.token_ids), early.finish_reason) == ([greedy_ref[0]], "stop")



@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("openai") / "tiny"
    make_model(out, preset="tiny", seed=31, progress=False)
    with_chat_template(out)
    return out


def test_openai_client_against_a_real_cluster(model, tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok: TextTokenizer = load_tokenizer(model)
    text_prompt = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat_text = PreTrainedTokenizerFast.from_pretrained(str(model)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
    id_prompt = [(11 * i + 5) % 500 + 3 for i in range(40)]
    prompts = [id_prompt, tok.encode(text_prompt), tok.encode(chat_text)]
    ref = offline(str(model), prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    greedy = {"max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    with Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path / "logs")) as cluster:
        client = openai.OpenAI(base_url=cluster.router_http_url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt=id_prompt, **greedy)
        assert out.choices[0].model_dump()["token_ids"] == ref[0]
        assert out.choices[0].text == tok.decode(ref[0])
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (40, 8)
        out = client.completions.create(model="tiny", prompt=text_prompt, **greedy)
        assert out.choices[0].text == tok.decode(ref[1]) and out.choices[0].finish_reason == "length"
        chunks = list(client.completions.create(model="tiny", prompt=text_prompt, stream=True,
                                                stream_options={"include_usage": True}, **greedy))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(ref[1])
        assert len([ch for ch in chunks if ch.choices]) > 1
        assert chunks[-1].usage.completion_tokens == 8
        assert chunks[-1].usage.prompt_tokens == len(prompts[1])
        chat = client.chat.completions.create(model="tiny", messages=messages, **greedy)
        assert chat.choices[0].message.content == tok.decode(ref[2])
        assert chat.usage.prompt_tokens == len(prompts[2])
        check_sampling_fields(cluster, client, model, id_prompt, ref[0], tok.decode(ref[1]))
        # A client that walks away mid-stream: the request is aborted on both nodes.
        stream = client.completions.create(model="tiny", prompt=id_prompt * 3, max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        free, loads = all_free(cluster)
        assert free, loads
        again = client.completions.create(model="tiny", prompt=id_prompt, **greedy)
        assert again.choices[0].model_dump()["token_ids"] == ref[0]
        client.close()
