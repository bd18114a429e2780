"""Limits and input checks of the router's OpenAI front (router/http_limits.py, http_json.py,
http_openai_request.py), over fake workers.

A body over --max-request-bytes gets 413 (declared or chunked); more prompts than --max-choices get 400
naming `prompt`; past --http-max-in-flight a request gets 429 with retry-after, and is served once slots
free; nested JSON, lone surrogates, invalid UTF-8, NaN and wrong types get 400 naming the field, never 500;
a huge text prompt is tokenized off the event loop (the router keeps answering meanwhile).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import AsyncIterator

import httpx2

from baton.router.http_limits import HttpLimits
from tests.test_openai_http import fake_front, tok_dir  # noqa: F401 (tok_dir: a fixture)
from tests.test_router_fakes import expected_tokens, run

LIMITS = HttpLimits(max_request_bytes=4096, max_choices=4, max_in_flight=3)


def _client() -> httpx2.AsyncClient:
    return httpx2.AsyncClient(trust_env=False, timeout=15)


async def _post(c: httpx2.AsyncClient, url: str, body: object) -> httpx2.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await c.post(url + "/v1/completions", content=content, headers={"content-type": "application/json"})


def test_request_size_and_choices_limits():
    async def go():
        async with fake_front(limits=LIMITS) as env, _client() as c:
            big = {"model": "fake", "prompt": [5] * 2000, "max_tokens": 2}  # ~6 KB of JSON
            r = await _post(c, env.url, big)
            assert r.status_code == 413 and r.json()["error"]["param"] == "body"

            async def chunks() -> AsyncIterator[bytes]:  # no content-length: counted as it arrives
                for _ in range(10):
                    yield b" " * 1000

            r = await c.post(env.url + "/v1/completions", content=chunks())
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            r = await _post(c, env.url, {"model": "fake", "prompt": [[5, 6]] * 5, "max_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "--max-choices" in r.json()["error"]["message"]
            r = await _post(c, env.url, {"model": "fake", "prompt": [[5, 6, i] for i in range(3)], "max_tokens": 2,
                                         "return_token_ids": True})
            assert r.status_code == 200
            assert [ch["token_ids"] for ch in r.json()["choices"]] == [expected_tokens([5, 6, i], 2) for i in range(3)]

    run(go())


def test_in_flight_limit_answers_429_with_retry_after_then_serves():
    async def go():
        async with fake_front(limits=LIMITS) as env, _client() as c:
            env.decode.token_delay_s = 0.05
            slow = asyncio.create_task(_post(c, env.url, {"model": "fake", "prompt": [[5], [6]], "max_tokens": 20}))
            await asyncio.sleep(0.3)  # two of the three slots taken
            r = await _post(c, env.url, {"model": "fake", "prompt": [[5], [6]], "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            r = await _post(c, env.url, {"model": "fake", "prompt": [5], "max_tokens": 2})  # the third slot
            assert r.status_code == 200
            assert (await slow).status_code == 200
            r = await _post(c, env.url, {"model": "fake", "prompt": [[5], [6], [7]], "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3

    run(go())


def test_bad_input_gets_400_naming_the_field(tok_dir):  # noqa: F811
    cases: list[tuple[bytes | dict, str]] = [
        (b'{"model": "fake", "prompt": ' + b"[" * 40 + b"5" + b"]" * 40 + b"}", "prompt"),
        (b"[" * 100_000, "body"),  # deeper than Python's own recursion limit
        (b'{"model": "fake", "prompt": "a\\ud800b"}', "prompt"),
        (b'{"model": "fake", "prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        (b'{"model": "fake", "prompt": "hi", "stop": ["\\ud83d"]}', "stop[0]"),
        (b'{"model": "fake", "prompt": "\xff\xfe\xfa"}', "body"),  # invalid UTF-8
        (b'{"model": "fake", "prompt": [5], "temperature": NaN}', "body"),
        (b'{"model": "fake", "prompt": [5], "top_p": 1e999}', "body"),
        (b"", "body"),
        (b"[1, 2]", "body"),
        ({"model": "fake", "prompt": 5}, "prompt"),
        ({"model": "fake", "prompt": [5, -1]}, "prompt"),
        ({"model": "fake", "prompt": [5, 2**40 + 7]}, "prompt"),
        ({"model": "fake", "prompt": [5], "max_tokens": "5"}, "max_tokens"),
        ({"model": "fake", "prompt": [5], "temperature": "hot"}, "temperature"),
        ({"model": "fake", "prompt": [5], "temperature": 1e39}, "temperature"),
        ({"model": "fake", "prompt": [5], "stream": "yes"}, "stream"),
        ({"model": "fake", "prompt": [5], "stream_options": []}, "stream_options"),
        ({"model": "fake", "prompt": [5], "stop": 5}, "stop"),
        ({"model": "fake", "prompt": [5], "stop": ["x"] * 65}, "stop"),
        ({"model": "fake", "prompt": [5], "n": "2"}, "n"),
        ({"model": 7, "prompt": [5]}, "model"),
        ({"model": "fake", "prompt": [5], "ignore_eos": 1}, "ignore_eos"),
        ({"model": "fake", "prompt": [5], "stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ]
    chat_cases: list[tuple[dict, str]] = [
        ({"model": "fake", "messages": "hi"}, "messages"),
        ({"model": "fake", "messages": [{"role": 1}]}, "messages[0]"),
        ({"model": "fake", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "fake", "messages": [{"role": "user", "content": "\udc00"}]}, "messages[0].content"),
    ]

    async def go():
        async with fake_front(tok_dir, limits=HttpLimits()) as env, _client() as c:
            for body, param in cases:
                r = await _post(c, env.url, body)
                assert r.status_code == 400, (body[:80], r.status_code, r.text[:300])
                assert r.json()["error"]["param"] == param, (body[:80], r.json())
            for body, param in chat_cases:
                # ensure_ascii: a lone surrogate travels as its \\u escape, as a hostile client sends it.
                r = await c.post(env.url + "/v1/chat/completions", content=json.dumps(body).encode())
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text[:300])
            assert (await c.get(env.url + "/health")).status_code == 200

    run(go())


def _probe(port: int, stop: threading.Event, answered: list[tuple[float, float]]) -> None:
    """GET /health over and over from another thread, noting when each was sent and answered."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    while not stop.is_set():
        t0 = time.monotonic()
        conn.request("GET", "/health")
        conn.getresponse().read()
        answered.append((t0, time.monotonic()))
        time.sleep(0.01)
    conn.close()


def test_a_huge_text_prompt_is_tokenized_off_the_loop(tok_dir):  # noqa: F811
    async def go():
        async with fake_front(tok_dir) as env, _client() as c:
            # The router's own tokenizer, its encode timed: the probes answered inside that window show the loop
            # (and the GIL) free while it ran, however slow a loaded machine makes either.
            tok = env.router.service.tokenizer
            encode, windows = tok.encode, []

            def timed_encode(text: str, add_bos: bool = False) -> list[int]:
                t0 = time.monotonic()
                try:
                    return encode(text, add_bos)
                finally:
                    windows.append((t0, time.monotonic()))

            tok.encode = timed_encode
            text = "the quick brown fox jumps over the lazy dog. " * 20_000  # 900 KB
            stop, answered = threading.Event(), []
            probe = threading.Thread(target=_probe, args=(env.router.http.port, stop, answered))
            probe.start()
            try:
                r = await _post(c, env.url, {"model": "fake", "prompt": text, "max_tokens": 2})
            finally:
                stop.set()
                await asyncio.to_thread(probe.join)
            # More tokens than the fake model's context: the service's 400, after tokenizing.
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text[:300]
            [(start, end)] = windows
            inside = sum(start <= s and a <= end for s, a in answered)
            assert inside >= 5, (f"the router answered {inside} probes in the {end - start:.2f} s its "
                                f"tokenizer ran ({len(answered)} in all)")

    run(go())
