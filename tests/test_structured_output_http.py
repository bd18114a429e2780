"""Structured output through a real cluster (router + prefill + decode processes: every prompt of two tokens or more
is prefilled on the prefill node, so the decode node applies the grammar from its first token): OpenAI's
`response_format` (json_schema through the `openai` client's `chat.completions.parse` with a pydantic model,
json_object on completions equal to the offline engine), `tools` with `tool_choice` "required" and a named function
answered as `tool_calls` (whole and streamed), "auto" (the model's Hermes-style template; its tokenizer holds the
tags as tokens, as Qwen's does, so a `logit_bias` on the opening one sends a call down the grammar) answered as text or as calls whose
arguments match their schemas, whole and streamed alike, and the gRPC SDK's `Grammar`."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest

from baton.cli.cluster import Cluster
from baton.client import Client, Grammar
from baton.engine.make_model import make_model
from baton.engine.sampling_params import SamplingParams
from baton.engine.structured_output import StructuredOutput
from baton.engine.tokenizer import load_tokenizer
from baton.proto.convert import sampling_from_proto, sampling_to_proto
from baton.proto.v1 import generation_pb2 as gen
from baton.router.validation import MAX_GRAMMAR_BYTES, validate
from tests.test_e2e import ENGINE_ARGS, all_free, offline
from tests.test_openai_http import TOOL_CHAT_TEMPLATE, with_chat_template
from tests.test_tool_calls import with_tag_tokens


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=4)
    age: int = pydantic.Field(ge=0, le=99)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city"],
             "properties": {"city": {"type": "string", "maxLength": 6}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["a", "b"],
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                            "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("so-http") / "tiny"
    make_model(out, preset="tiny", seed=31, progress=False)
    with_chat_template(out, TOOL_CHAT_TEMPLATE)
    (out / "tokenizer.json").write_text(with_tag_tokens((out / "tokenizer.json").read_text()))
    return out


def valid_call(name: str, arguments: str) -> bool:
    """A call of one of TOOLS whose arguments match its parameters."""
    args = json.loads(arguments)
    if name == "get_weather":
        return set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 6
    return (name == "add" and set(args) == {"a", "b"}
            and all(type(v) is int and 0 <= v <= 9 for v in args.values()))


def ask(client: openai.OpenAI, max_tokens: int = 60, **kw) -> tuple[dict, dict]:
    """A chat answer whole and streamed (greedy): (content, calls as (name, arguments), finish_reason) of each."""
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=max_tokens, temperature=0, **kw).choices[0]
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                 max_tokens=max_tokens, temperature=0, stream=True, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    streamed = {"content": "".join(d.content or "" for d in deltas) or None,
                "calls": [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []],
                "indexes": [t.index for d in deltas for t in d.tool_calls or []],
                "finish": chunks[-1].choices[0].finish_reason}
    calls = whole.message.tool_calls or []
    return ({"content": whole.message.content, "calls": [(t.function.name, t.function.arguments) for t in calls],
             "indexes": list(range(len(calls))), "finish": whole.finish_reason}, streamed)


def test_structured_output_against_a_real_cluster(model, tmp_path):
    tok = load_tokenizer(model)
    prompt = [(7 * i + 3) % 500 + 3 for i in range(20)]
    ref = offline(str(model), [prompt], SamplingParams(max_tokens=64, structured_output=StructuredOutput(
        "json_object")))[0]
    with Cluster(str(model), prefill_workers=1, decode_workers=1, engine_args=ENGINE_ARGS,
                 log_dir=str(tmp_path / "logs")) as cluster:
        client = openai.OpenAI(base_url=cluster.router_http_url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0,
                                        extra_body={"response_format": {"type": "json_object"},
                                                    "return_token_ids": True})
        assert out.choices[0].model_dump()["token_ids"] == ref
        assert out.choices[0].finish_reason == ("stop" if isinstance(json.loads(tok.decode(ref)), dict)
                                                else "length")

        parsed = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Person,
                                               max_completion_tokens=60, temperature=0.8, seed=4)
        person = parsed.choices[0].message.parsed
        assert isinstance(person, Person) and parsed.choices[0].finish_reason == "stop"

        for choice, names in [("required", {"get_weather", "add"}),
                              ({"type": "function", "function": {"name": "add"}}, {"add"})]:
            chat = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                  max_tokens=60, temperature=0)
            c = chat.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
            args = json.loads(call.function.arguments)
            assert set(args) == ({"a", "b"} if call.function.name == "add" else {"city"})
            chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                         tool_choice=choice, max_tokens=60, temperature=0,
                                                         stream=True))
            streamed = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
            assert [(t.function.name, t.function.arguments) for t in streamed] == [
                (call.function.name, call.function.arguments)]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"

        for kw in ({}, {"tool_choice": "auto"}):
            whole, streamed = ask(client, **kw)
            assert whole == streamed
            assert whole["calls"] or isinstance(whole["content"], str)
            assert all(valid_call(*c) for c in whole["calls"]), whole
        # The opening tag's token pushed up: the model calls a tool (the grammar holds the rest to the schemas).
        (tag,) = map(str, tok.encode("<tool_call>"))
        for parallel in (False, True):
            whole, streamed = ask(client, 150, logit_bias={tag: 100}, parallel_tool_calls=parallel)
            assert whole == streamed
            assert whole["calls"] and all(valid_call(*c) for c in whole["calls"]), whole
            if parallel:
                # Pushed on, it calls again and again until max_tokens cuts a block short: answered as text.
                assert len(whole["calls"]) > 1 and whole["finish"] == "length", whole
                assert whole["content"].startswith("\n<tool_call>\n"), whole
            else:
                assert len(whole["calls"]) == 1 and whole["finish"] == "tool_calls", whole
                assert whole["content"] is None, whole
        for bad, param in [({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
                           ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
                           ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                       "schema": {"type": 5}}}},
                            "response_format.json_schema.schema"),
                           ({"response_format": {"type": "xml"}}, "response_format")]:
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, **bad)
            assert e.value.body["param"] == param, e.value.body

        with Client(cluster.router_addr) as sdk:
            got = sdk.generate(prompt, max_tokens=64, structured_output=Grammar.json_object())
            assert list(got.token_ids) == ref
            got = sdk.generate(prompt, max_tokens=30, temperature=1.0, seed=2,
                               structured_output=Grammar.regex(r"(yes|no)[0-9]{2}"))
            assert got.finish_reason == "stop" and got.text[:-2] in ("yes", "no") and got.text[-2:].isdigit()
        free, loads = all_free(cluster)
        assert free, loads
        client.close()


def test_the_router_refuses_grammars_a_model_cannot_take():
    info = gen.ModelInfoResponse(model="m", vocab_size=512, max_model_len=64, has_tokenizer=True)

    def request(**grammar) -> gen.GenerateRequest:
        return gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2]), sampling=gen.SamplingParams(
            structured_output=gen.StructuredOutput(**grammar)))

    assert validate(request(regex="[ab]+"), info, None).sampling.structured_output.regex == "[ab]+"
    for spec in [StructuredOutput("json_object"), StructuredOutput("lark", 'start: "a"+'), None]:
        p = SamplingParams(max_tokens=3, structured_output=spec)
        assert sampling_from_proto(sampling_to_proto(p)) == p
    for grammar, model, match in [
            ({"regex": "[ab]+"}, gen.ModelInfoResponse(model="m", vocab_size=512, max_model_len=64), "tokenizer"),
            ({"json_schema": "{" * 8}, info, "json_schema"),
            ({"lark": "x" * (MAX_GRAMMAR_BYTES + 1)}, info, "at most"),
            ({"json_object": False}, info, "json_object")]:
        with pytest.raises(ValueError, match=match):
            validate(request(**grammar), model, None)
    with pytest.raises(ValueError, match="structured_output"):
        validate(gen.GenerateRequest(token_ids=gen.TokenIds(ids=[1, 2]), sampling=gen.SamplingParams(
            structured_output=gen.StructuredOutput())), info, None)
