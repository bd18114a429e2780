"""Fuzzing the router's OpenAI front with hypothesis: 1,000 request bodies against one running router (over
fake workers, with a tokenizer and a chat template, so that text prompts, stop strings and chat run too).

Bodies: OpenAI-shaped objects whose fields take plausible values, wrong types or random JSON (lone
surrogates in strings and keys included), extra fields; and raw attacks (random bytes, deep nesting,
truncated JSON, invalid UTF-8, NaN). Every case is answered with 2xx, or 4xx whose error names the field
(an extra field too: it is refused, never ignored) and carries a string code;
never 5xx; a stream ends with `[DONE]` and carries no error. After the run the router still answers and
nothing is left in flight.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from baton.engine import tokenizer_train
from tests.test_openai_http import Env, fake_front, with_chat_template
from tests.test_router_fakes import VOCAB, eventually

PATHS = ("/v1/completions", "/v1/chat/completions")
LONE_SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")

texts = st.text(st.characters(max_codepoint=0x10FFFF) | st.sampled_from(LONE_SURROGATES), max_size=12)
leaves = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | texts
          | st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5))
anything = st.recursive(leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                        max_leaves=12)
ids = st.lists(st.integers(-2, VOCAB + 2), min_size=0, max_size=8)
small_int = st.integers(-3, 70)


def _or_anything(s: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(s, s, anything)


message = st.fixed_dictionaries({"role": _or_anything(st.sampled_from(["user", "system", "assistant"]))},
                                optional={"content": _or_anything(texts | st.lists(
                                    st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)),
                                    "name": anything})
FIELDS = {
    "model": _or_anything(st.just("fake")),
    "prompt": _or_anything(ids | texts | st.lists(ids | texts, max_size=3)),
    "messages": _or_anything(st.lists(message, max_size=3)),
    "max_tokens": _or_anything(small_int),
    "max_completion_tokens": _or_anything(small_int),
    "temperature": _or_anything(st.floats(-1, 3)),
    "top_p": _or_anything(st.floats(-0.5, 1.5)),
    "top_k": _or_anything(small_int),
    "seed": _or_anything(st.integers(-1, 2**64)),
    "n": _or_anything(st.integers(0, 3)),
    "presence_penalty": _or_anything(st.floats(-3, 3)),
    "frequency_penalty": _or_anything(st.floats(-3, 3)),
    "repetition_penalty": _or_anything(st.floats(-1, 3)),
    "min_p": _or_anything(st.floats(-0.5, 1.5)),
    "min_tokens": _or_anything(small_int),
    "logit_bias": _or_anything(st.dictionaries(st.integers(-2, VOCAB + 2).map(str) | texts, st.floats(-200, 200),
                                               max_size=3)),
    "stop": _or_anything(texts | st.lists(texts, max_size=3)),
    "stop_token_ids": _or_anything(ids),
    "ignore_eos": _or_anything(st.booleans()),
    "stream": _or_anything(st.booleans()),
    "stream_options": _or_anything(st.fixed_dictionaries({}, optional={"include_usage": anything})),
    "return_token_ids": _or_anything(st.booleans()),
    "logprobs": anything,
    "echo": anything,
    "response_format": anything,
}
bodies = st.builds(lambda known, extra: {**extra, **known},
                   st.fixed_dictionaries({}, optional=FIELDS), st.dictionaries(texts, anything, max_size=2))


def _deep(k: int) -> bytes:
    return b'{"prompt": ' + b"[" * k + b"]" * k + b"}"


raw = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 3000).map(_deep),
    st.tuples(bodies, st.integers(0, 60)).map(lambda t: json.dumps(t[0]).encode()[: t[1]]),
    st.binary(min_size=1, max_size=8).map(lambda b: b'{"model": "fake", "prompt": "' + b + b'"}'),
    st.sampled_from([b'{"prompt": [1], "temperature": NaN}', b'{"prompt": [1], "top_p": -Infinity}',
                     b'{"prompt": [1], "max_tokens": 1e400}', b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}"]),
)
# Bodies a client means to be right (so that generation, streaming, stop strings and chat run), one of them with
# a field broken, OpenAI-shaped bodies of random fields, and raw attacks.
valid_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
sampling = {"max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
            "top_k": st.integers(0, 20), "seed": st.integers(0, 2**63 - 1), "ignore_eos": st.booleans(),
            "stop": valid_text | st.lists(valid_text, min_size=1, max_size=3), "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
            "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3), "return_token_ids": st.booleans(),
            "n": st.integers(1, 3), "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
            "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1), "min_tokens": st.integers(0, 1),
            "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=3)}
valid_ids = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=8)
completion = st.fixed_dictionaries(
    {"model": st.just("fake"), "prompt": valid_ids | valid_text | st.lists(valid_ids | valid_text, min_size=1,
                                                                            max_size=3)},
    optional=sampling).map(lambda b: ("/v1/completions", b))
chat = st.fixed_dictionaries(
    {"model": st.just("fake"), "max_tokens": st.integers(1, 8),
     "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": valid_text}),
                          min_size=1, max_size=3)},
    optional={k: v for k, v in sampling.items() if k != "max_tokens"}).map(lambda b: ("/v1/chat/completions", b))
meant = completion | chat


def _broken(case: tuple[str, dict], key: str, value: object) -> tuple[str, dict]:
    path, body = case
    return path, {**body, key: value}


broken = st.builds(_broken, meant, st.sampled_from(sorted(FIELDS)) | texts, anything)
shaped = st.tuples(st.sampled_from(PATHS), bodies)
cases = st.one_of(meant, meant, broken, shaped, st.tuples(st.sampled_from(PATHS), raw)).map(
    lambda c: (c[0], c[1] if isinstance(c[1], bytes) else json.dumps(c[1]).encode()))


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Env]:
    """One router over fakes, on a loop of its own thread, for every case."""
    tok_dir = tmp_path_factory.mktemp("fuzz-tok")
    tokenizer_train.write_tokenizer(tok_dir, {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1,
                                              "eos_token_id": 2})
    with_chat_template(tok_dir)
    ready, env_box = threading.Event(), []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        async with fake_front(tok_dir) as env:
            env_box.append(env)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(30), "the router did not start"
    try:
        yield env_box[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


class _Conn:
    """One keep-alive connection, opened again when the server closed it (after an error answer)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, path: str, body: bytes) -> tuple[int, str, bytes]:
        for attempt in range(2):
            try:
                self.conn.request("POST", path, body, {"Content-Type": "application/json"})
                r = self.conn.getresponse()
                return r.status, r.getheader("content-type") or "", r.read()
            except (http.client.RemoteDisconnected, ConnectionError, http.client.CannotSendRequest):
                self.conn.close()
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                if attempt:
                    raise
        raise AssertionError("unreachable")


def _check(status: int, ctype: str, payload: bytes, case: tuple[str, bytes]) -> None:
    assert status < 500, (case, status, payload[:300])
    event(f"{status} {'stream' if ctype.startswith('text/event-stream') else ctype}")
    if status == 200 and ctype.startswith("text/event-stream"):
        events = [e.removeprefix("data: ") for e in payload.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]", (case, events[-3:])
        assert not any("error" in json.loads(e) for e in events[:-1]), (case, events)
    elif status == 200:
        assert json.loads(payload)["choices"], (case, payload[:300])
    else:
        error = json.loads(payload)["error"]
        assert status in (400, 404), (case, status, error)
        assert isinstance(error["param"], str) and error["param"], (case, status, error)
        assert isinstance(error["code"], str) and error["code"], (case, status, error)
        event(f"param {error['param'].split('[')[0]}")
        assert error["param"] in error["message"], (case, error)


@pytest.fixture(scope="module")
def conn(served: Env) -> Iterator[_Conn]:
    c = _Conn(served.router.http.port)
    yield c
    c.conn.close()


@settings(max_examples=1000, deadline=None, database=None, derandomize=True, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(case=cases)
def test_fuzzed_openai_bodies_get_2xx_or_4xx_naming_the_field(conn: _Conn, case: tuple[str, bytes]):
    _check(*conn.post(*case), case)


def test_the_router_is_whole_after_the_fuzzing(served: Env):
    status, _, body = _Conn(served.router.http.port).post("/v1/completions",
                                                          b'{"model": "fake", "prompt": [5, 6], "max_tokens": 2}')
    assert status == 200, body
    service = served.router.service
    asyncio.run(eventually(lambda: not service._inflight, what="no request left in flight"))
    # (The handler gives its slot back just after its answer's last write: the client may read it first.)
    front = served.router.http.app.front
    asyncio.run(eventually(lambda: front.in_flight == 0, what="no HTTP slot left taken"))
    assert service.admission.inflight == 0
