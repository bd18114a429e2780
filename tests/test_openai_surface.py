"""The rest of the API surface clients probe, over fake workers: `GET /v1/models/{id}`; unknown paths; every error
body in OpenAI's shape with a string code; `max_tokens` / `max_completion_tokens` beyond the context refused (HTTP
400 naming the field, gRPC INVALID_ARGUMENT) rather than cut short; every refusal of the HTTP front counted as
outcome "invalid"; ModelInfo and /v1/models name the model, never the workers' directory."""

from __future__ import annotations

import asyncio

import grpc
import openai
import pytest

from baton.proto.v1 import generation_pb2
from baton.router.config import RouterConfig
from baton.router.server import start_router
from tests.test_openai_http import fake_front, http, requests_total, tok_dir  # noqa: F401  (fixture)
from tests.test_router_fakes import MAX_MODEL_LEN, cluster, eventually, run, start_fake


def _is_openai_error(body: dict) -> bool:
    error = body.get("error")
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and all(isinstance(error[k], str) and error[k] for k in ("message", "type", "code")))


def test_models_by_id_and_unknown_paths_answer_openai_errors():
    async def go():
        async with fake_front() as env:
            model = await env.client.models.retrieve("fake")
            assert (model.id, model.object, model.owned_by) == ("fake", "model", "baton")
            with pytest.raises(openai.NotFoundError) as e:
                await env.client.models.retrieve("gpt-4")
            assert e.value.code == "model_not_found" and e.value.param == "model" and "gpt-4" in e.value.message
            for method, path in [("GET", "/v1/nope"), ("POST", "/v1/nope"), ("GET", "/"), ("POST", "/v1"),
                                 ("GET", "/v1/completions/x")]:
                status, body = await asyncio.to_thread(http, method, env.url + path, b"{}" if method == "POST" else None)
                assert status == 404 and _is_openai_error(body), (method, path, body)
                assert body["error"]["code"] == "not_found"
            status, body = await asyncio.to_thread(http, "POST", env.url + "/v1/models/fake", b"{}")
            assert status == 405 and _is_openai_error(body) and body["error"]["code"] == "method_not_allowed"
            assert requests_total(env.router, "invalid") == 0  # (not generation requests)
    run(go())


def test_every_refusal_has_a_string_code_and_counts_as_invalid():
    bodies = [b"", b"{not json", b"[1]", b'{"prompt": [1], "max_tokens": -1}', b'{"prompt": [1], "n": 0}',
              b'{"prompt": [1], "frobnicate": 1}', b'{"prompt": [1], "min_p": 1.1}', b'{"model": "x", "prompt": [1]}',
              b'{"prompt": [1], "temperature": -1}', b'{"prompt": [1, 2, 3], "max_tokens": 62}']

    async def go():
        async with fake_front() as env:
            for raw in bodies:
                status, body = await asyncio.to_thread(http, "POST", env.url + "/v1/completions", raw)
                assert status in (400, 404) and _is_openai_error(body), (raw, body)
            status, body = await asyncio.to_thread(http, "GET", env.url + "/v1/chat/completions")
            assert status == 405 and _is_openai_error(body)
            assert requests_total(env.router, "invalid") == len(bodies) + 1
            assert requests_total(env.router, "ok") == 0
    run(go())


def test_max_tokens_beyond_the_context_is_refused_naming_the_field(tok_dir):  # noqa: F811
    async def go():
        async with fake_front(tok_dir) as env:
            c = env.client
            prompt = [5, 6, 7]
            room = MAX_MODEL_LEN - len(prompt)
            out = await c.completions.create(model="fake", prompt=prompt, max_tokens=room)
            assert out.usage.completion_tokens == room
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="fake", prompt=prompt, max_tokens=room + 1)
            assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
            assert f"= {room}, got {room + 1}" in e.value.message
            with pytest.raises(openai.BadRequestError) as e:
                await c.completions.create(model="fake", prompt=prompt, max_tokens=100000, stream=True)
            assert e.value.param == "max_tokens"
            messages = [{"role": "user", "content": "Hi"}]
            for field in ("max_tokens", "max_completion_tokens"):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(model="fake", messages=messages, **{field: MAX_MODEL_LEN})
                assert (e.value.param, e.value.code) == (field, "context_length_exceeded"), field
            assert env.decode.decodes[1:] == []  # only the first request reached a worker
    run(go())


def test_grpc_max_tokens_beyond_the_context_is_invalid_argument():
    async def go():
        async with cluster() as c:
            await eventually(lambda: c.router.service.health().ok, what="router ready")
            prompt = [1, 2, 3, 4]
            msgs = await c.generate(prompt, max_tokens=MAX_MODEL_LEN - len(prompt))
            assert msgs[-1].usage.completion_tokens == MAX_MODEL_LEN - len(prompt)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.generate(prompt, max_tokens=MAX_MODEL_LEN - len(prompt) + 1)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("sampling.max_tokens: expected at most max_model_len - prompt")
    run(go())


@pytest.mark.parametrize(("reported", "served", "expected"), [
    ("/srv/models/nemotron-h-8b/", None, "nemotron-h-8b"),
    ("nemotron-h-8b", None, "nemotron-h-8b"),
    ("/srv/models/nemotron-h-8b", "acme/nemo", "acme/nemo"),
])
def test_model_info_and_models_name_the_model_not_its_directory(reported, served, expected):
    async def go():
        fake, server, addr = await start_fake("decode", "d0")
        fake.model = reported
        router = await start_router(RouterConfig((), (addr,), load_poll_interval_s=0.1), 0, http_port=0,
                                    served_model_name=served)
        try:
            await eventually(lambda: router.service.health().ok, what="router ready")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                info = await ch.unary_unary("/baton.v1.Generation/ModelInfo",
                                            response_deserializer=generation_pb2.ModelInfoResponse.FromString)(
                    generation_pb2.ModelInfoRequest().SerializeToString())
            assert info.model == expected and info.max_model_len == MAX_MODEL_LEN
            status, body = await asyncio.to_thread(http, "GET", f"http://127.0.0.1:{router.http.port}/v1/models")
            assert status == 200 and [m["id"] for m in body["data"]] == [expected]
            status, body = await asyncio.to_thread(http, "GET",
                                                   f"http://127.0.0.1:{router.http.port}/v1/models/{expected}")
            assert status == 200 and body["id"] == expected
        finally:
            await router.stop(0)
            await server.stop(0)
    run(go())
