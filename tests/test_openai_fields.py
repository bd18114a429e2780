"""Nothing is silently ignored: every parameter of OpenAI's `/v1/completions` and `/v1/chat/completions`, as the
installed `openai` client types them, is either implemented by the router (`http_fields.IMPLEMENTED`) or refused
with 400 naming it; one that Baton accepts only with a neutral value (`http_fields.NEUTRAL_ONLY`: `best_of: 1`,
`logprobs: false`, `functions: []`, ...) is answered 200 with that value. Fields of no API are refused
as unknown, and so are unknown `stream_options` keys. Every `tool_choice` ("auto" included) is implemented where the
chat template writes tool calls in a syntax the router knows."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from baton.engine import tokenizer_train
from baton.router.http_errors import ApiError
from baton.router.http_fields import CHAT, COMPLETIONS, IMPLEMENTED, NEUTRAL_ONLY, check_fields
from tests.test_openai_http import (  # noqa: F401  (tok_dir: a fixture)
    CHAT_TEMPLATE,
    fake_front,
    http,
    requests_total,
    tok_dir,
    with_chat_template,
)
from tests.test_router_fakes import VOCAB, run

# The parameters as the client library sends them, so that this list follows the client.
OPENAI_PARAMS = {
    COMPLETIONS: sorted(completion_params.CompletionCreateParamsBase.__annotations__),
    CHAT: sorted(chat_params.CompletionCreateParamsBase.__annotations__),
}
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
# A value no field takes as neutral.
ODD = {"baton-test": 1}


def _base(path: str) -> dict:
    if path == CHAT:
        return {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return {"model": "fake", "prompt": [5, 6], "max_tokens": 2}


def test_the_openai_parameter_lists_are_read():
    # `stream` is typed on the streaming/non-streaming subclasses, not the base.
    assert {"prompt", "max_tokens", "temperature", "logit_bias"} <= set(OPENAI_PARAMS[COMPLETIONS])
    assert {"messages", "max_completion_tokens", "response_format", "tools"} <= set(OPENAI_PARAMS[CHAT])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_every_openai_parameter_is_implemented_or_refused_naming_it(path, tok_dir):  # noqa: F811
    not_implemented = [p for p in OPENAI_PARAMS[path] if p not in IMPLEMENTED[path]]

    async def go():
        async with fake_front(tok_dir) as env:
            url = env.url + PATHS[path]
            refused = 0
            for name in not_implemented:
                body = {**_base(path), name: ODD}
                status, answer = await asyncio.to_thread(http, "POST", url, json.dumps(body).encode())
                assert status == 400, (name, answer)
                assert answer["error"]["param"] == name and name in answer["error"]["message"], answer
                assert answer["error"]["code"] in ("unsupported_parameter", "unknown_parameter"), answer
                refused += 1
                neutral = NEUTRAL_ONLY.get(name)
                if neutral is None or path not in neutral.paths:
                    continue
                for value in (None, *neutral.values):
                    body = {**_base(path), name: value}
                    status, answer = await asyncio.to_thread(http, "POST", url, json.dumps(body).encode())
                    assert status == 200, (name, value, answer)
            for name in ("frobnicate", "best_of" if path == CHAT else "max_completion_tokens"):
                body = {**_base(path), name: 1}
                status, answer = await asyncio.to_thread(http, "POST", url, json.dumps(body).encode())
                assert status == 400 and answer["error"]["code"] == "unknown_parameter", (name, answer)
                assert answer["error"]["param"] == name
            body = {**_base(path), "stream": True, "stream_options": {"include_usage": True, "x": True}}
            status, answer = await asyncio.to_thread(http, "POST", url, json.dumps(body).encode())
            assert status == 400 and answer["error"]["param"] == "stream_options.x", answer
            assert requests_total(env.router, "invalid") == refused + 3
    run(go())


@pytest.mark.parametrize(("field", "neutral", "used"), [
    ("functions", [], [{"name": "f"}]), ("function_call", "none", "auto"),
])
def test_unimplemented_sampling_fields_pass_only_when_neutral(field, neutral, used):
    check_fields({field: neutral}, CHAT)
    with pytest.raises(ApiError) as e:
        check_fields({field: used}, CHAT)
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    assert e.value.message.startswith(f"{field}: not implemented by this server: expected ")


def test_a_boolean_is_not_a_neutral_number():
    # JSON's true is not 1: `n: true` asks for something, if anything, other than one choice.
    for field, v, path in [("store", 0, CHAT), ("best_of", True, COMPLETIONS)]:
        with pytest.raises(ApiError) as e:
            check_fields({field: v}, path)
        assert e.value.param == field


# The fakes' context is short: a template that names the Hermes call syntax without rendering the tools.
SHORT_TOOL_TEMPLATE = CHAT_TEMPLATE + "{# an assistant's calls: <tool_call>\n{...}\n</tool_call> #}"


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, SHORT_TOOL_TEMPLATE], ids=["no-call-syntax", "hermes"])
def test_every_tool_choice_is_implemented_where_the_template_writes_calls(tmp_path, template):
    # "auto" (and no tool_choice, its default) reads the calls in the template's syntax: refused, naming
    # tool_choice, only where the template writes calls in no syntax the router knows.
    tokenizer_train.write_tokenizer(tmp_path, {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1,
                                               "eos_token_id": 2})
    with_chat_template(tmp_path, template)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    choices = [{}, {"tool_choice": "auto"}, {"tool_choice": "none"}, {"tool_choice": "required"},
               {"tool_choice": {"type": "function", "function": {"name": "f"}}}, {"parallel_tool_calls": False}]

    async def go():
        async with fake_front(tmp_path, fakes_have_tokenizer=True) as env:
            for extra in choices:
                body = {**_base(CHAT), "tools": tools, **extra}
                status, answer = await asyncio.to_thread(http, "POST", env.url + PATHS[CHAT],
                                                         json.dumps(body).encode())
                auto = extra.get("tool_choice", "auto") == "auto"
                if auto and template == CHAT_TEMPLATE:
                    assert status == 400 and answer["error"]["param"] == "tool_choice", answer
                    assert '"auto"' in answer["error"]["message"], answer
                else:
                    assert status == 200, (extra, answer)
                    assert answer["choices"][0]["message"]["role"] == "assistant", answer
    run(go())
