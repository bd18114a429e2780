"""tool_choice "auto" (router/tool_syntax.py, router/tool_call_parser.py, router/http_structured.py): the call
syntax read off a chat template, its grammar (llguidance over a byte-level tokenizer: text alone or text then calls,
never a call to an unknown tool or with arguments its schema refuses, at most one call unless parallel), and the
split of the output into content and tool calls, whole or streamed in pieces."""

from __future__ import annotations

import json

import llguidance
import pytest

from baton.engine.structured_output import StructuredOutput
from baton.engine.tokenizer_train import train_tokenizer_json
from baton.router.http_errors import ApiError
from baton.router.http_structured import AutoToolCalls, tool_choice
from baton.router.tool_call_parser import ToolCallSplitter
from baton.router.tool_syntax import HERMES, QWEN3_CODER, TOOLCALL_LIST, ToolSyntax, detect, grammar
from tests.test_openai_http import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE

FUNCTIONS = {
    "get_weather": {"type": "object", "additionalProperties": False, "required": ["city"],
                    "properties": {"city": {"type": "string", "maxLength": 6},
                                   "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                                   "day": {"type": "string", "pattern": "^[0-9]+$"}}},
    "add": {"type": "object", "required": ["a", "b"],
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}}},
    "free": {"type": "object"},
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": p}} for n, p in FUNCTIONS.items()]


def with_tag_tokens(tokenizer_json: str, tags: tuple[str, ...] = ("<tool_call>", "</tool_call>")) -> str:
    """`tokenizer_json` with each of `tags` one added token, as in the tokenizers of models trained to call tools
    (its last merges give way, so the vocabulary keeps its size)."""
    tj = json.loads(tokenizer_json)
    for tag in tags:
        last = tj["model"]["merges"].pop()
        tid = tj["model"]["vocab"].pop("".join(last if isinstance(last, list) else last.split(" ")))
        tj["added_tokens"].append({"id": tid, "content": tag, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": False})
    return json.dumps(tj)


@pytest.fixture(scope="module", params=["spelled", "tokens"])
def lltok(request):
    """A byte-level tokenizer, and its grammar's view: the tags spelled out, or each one added token."""
    from tokenizers import Tokenizer
    text = train_tokenizer_json(512)
    tags = ()
    if request.param == "tokens":
        tags = ("<tool_call>", "</tool_call>", "<TOOLCALL>", "</TOOLCALL>")
        text = with_tag_tokens(text, tags)
    return llguidance.LLTokenizer(text, n_vocab=512, eos_token=[2]), Tokenizer.from_str(text), tags


def matches(lltok, syntax: ToolSyntax, parallel: bool, text: str) -> bool:
    """llguidance's matcher of the "auto" grammar takes all of `text`'s tokens and may end there."""
    lt, tok, tags = lltok
    syntax = syntax.for_tokenizer(tags)
    assert syntax.special == ({syntax.open, syntax.close} if tags else set())
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(grammar(syntax, FUNCTIONS, parallel)))
    assert not m.is_error(), m.get_error()
    ids = tok.encode(text).ids
    # With the tags as tokens, the text's tags are those tokens (what the model writes).
    assert {tok.id_to_token(i) for i in ids} & set(tags) == {t for t in tags if t in text}
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


def xml(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def toolcall(*calls: tuple[str, dict]) -> str:
    return "<TOOLCALL>" + json.dumps([{"name": n, "arguments": a} for n, a in calls]) + "</TOOLCALL>"


def test_the_call_syntax_is_read_off_the_chat_template():
    assert detect(TOOL_CHAT_TEMPLATE) is HERMES
    assert detect("{{ '<tool_call>\\n<function=' + c.name + '>\\n<parameter=' }}") is QWEN3_CODER
    assert detect("{{- '<TOOLCALL>' + calls | tojson + '</TOOLCALL>' }}") is TOOLCALL_LIST
    assert detect(CHAT_TEMPLATE) is None and detect(None) is None


@pytest.mark.parametrize(("syntax", "parallel", "text", "ok"), [
    (HERMES, True, "Plain text, <tool_call without its end.", True),
    (HERMES, True, "", True),
    (HERMES, True, "Let me see.\n" + hermes("add", {"a": 3, "b": 4}), True),
    (HERMES, True, hermes("add", {"a": 3, "b": 4}) + "\n" + hermes("get_weather", {"city": "Paris"}), True),
    (HERMES, True, hermes("free", {"z": [1, {"y": None}]}), True),
    (HERMES, True, hermes("add", {"a": 3, "b": 14}), False),  # b > maximum
    (HERMES, True, hermes("get_weather", {"city": "Lisbon!"}), False),  # longer than maxLength
    (HERMES, True, hermes("mul", {"a": 3, "b": 4}), False),  # no such tool
    (HERMES, True, hermes("add", {"a": 3, "b": 4}) + " and text after", False),
    (HERMES, False, hermes("add", {"a": 3, "b": 4}) + "\n" + hermes("add", {"a": 1, "b": 2}), False),
    (QWEN3_CODER, True, "Sure.\n" + xml("get_weather", {"city": "Pa\nris", "unit": "c"}), True),
    (QWEN3_CODER, True, xml("add", {"a": 3, "b": 4}) + "\n" + xml("free", {"q": "any\nthing"}), True),
    (QWEN3_CODER, True, xml("get_weather", {"city": "Nice", "unit": "k"}), False),  # not in enum
    (QWEN3_CODER, True, xml("get_weather", {"city": "Nice", "day": '"12"'}), True),  # a pattern: a JSON string
    (QWEN3_CODER, True, xml("get_weather", {"city": "Nice", "day": '"x"'}), False),
    (QWEN3_CODER, True, xml("get_weather", {"city": "Nice", "day": "12"}), False),
    (QWEN3_CODER, True, xml("add", {"a": 3}), False),  # b is required
    (QWEN3_CODER, True, xml("add", {"a": "three", "b": 4}), False),
    (QWEN3_CODER, False, xml("add", {"a": 3, "b": 4}) + "\n" + xml("add", {"a": 1, "b": 2}), False),
    (TOOLCALL_LIST, True, "ok " + toolcall(("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})), True),
    (TOOLCALL_LIST, False, toolcall(("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})), False),
    (TOOLCALL_LIST, False, toolcall(("add", {"a": 1, "b": 2})), True),
    (TOOLCALL_LIST, True, toolcall(("get_weather", {"town": "Rome"})), False),
])
def test_the_auto_grammar_takes_text_or_valid_calls_only(lltok, syntax, parallel, text, ok):
    assert matches(lltok, syntax, parallel, text) is ok


def split(syntax: ToolSyntax, text: str, step: int, parallel: bool = True) -> tuple[str, list[tuple[str, dict]]]:
    """`text` fed `step` characters at a time: the content and (name, arguments) of the calls."""
    s = ToolCallSplitter(syntax, FUNCTIONS, parallel)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = s.feed(text[i:i + step])
        content += c
        calls += k
    c, k = s.finish()
    assert [c["id"] for c in calls + k] == [c["id"] for c in s.calls] and len({c["id"] for c in s.calls}) == len(s.calls)
    return content + c, [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls + k]


@pytest.mark.parametrize(("syntax", "text", "content", "calls"), [
    (HERMES, "No call; a <tool_ca is not a tag.", "No call; a <tool_ca is not a tag.", []),
    (HERMES, "Two calls.\n" + hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("get_weather", {"city": "</tool_call>"}),
     "Two calls.", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "</tool_call>"})]),
    (HERMES, "\n" + hermes("add", {"a": 1, "b": 2}), "", [("add", {"a": 1, "b": 2})]),
    (HERMES, "Cut: " + hermes("add", {"a": 1, "b": 2})[:30], "Cut: " + hermes("add", {"a": 1, "b": 2})[:30], []),
    (QWEN3_CODER, "ok\n" + xml("get_weather", {"city": "Pa\nris", "unit": "c"}) + "\n" + xml("add", {"a": 1, "b": 2}),
     "ok", [("get_weather", {"city": "Pa\nris", "unit": "c"}), ("add", {"a": 1, "b": 2})]),
    (QWEN3_CODER, xml("get_weather", {"city": "x", "day": '"12"'}), "", [("get_weather", {"city": "x", "day": "12"})]),
    (QWEN3_CODER, xml("free", {"q": "</function>"}), "", [("free", {"q": "</function>"})]),
    (TOOLCALL_LIST, toolcall(("add", {"a": 1, "b": 2}), ("free", {})), "", [("add", {"a": 1, "b": 2}), ("free", {})]),
    (TOOLCALL_LIST, "text <TOOLCAL", "text <TOOLCAL", []),
])
@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_the_output_splits_into_content_and_calls_however_it_is_chunked(syntax, text, content, calls, step):
    assert split(syntax, text, step) == (content, calls)


def test_a_tag_split_over_chunks_is_held_back_until_it_is_known():
    s = ToolCallSplitter(HERMES, FUNCTIONS, True)
    assert s.feed("Hi <tool") == ("Hi", [])  # the space may precede a tag: held too
    assert s.feed("box") == (" <toolbox", [])
    assert s.feed("\n<tool_") == ("", [])
    assert s.feed('call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_cal') == ("", [])
    content, (call,) = s.feed("l>")
    assert content == "" and call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert s.finish() == ("", [])


def test_without_parallel_calls_a_second_block_is_text():
    two = hermes("add", {"a": 1, "b": 2}) + "\n" + hermes("add", {"a": 3, "b": 4})
    assert split(HERMES, two, 1, parallel=False) == ("\n" + hermes("add", {"a": 3, "b": 4}),
                                                     [("add", {"a": 1, "b": 2})])


def test_auto_needs_a_known_call_syntax_and_writable_tools():
    body = {"tools": TOOLS, "tool_choice": "auto"}
    for b in (body, {"tools": TOOLS}):
        with pytest.raises(ApiError) as e:
            tool_choice(b, None)
        assert (e.value.status, e.value.param, e.value.code) == (400, "tool_choice", "unsupported_parameter")
        assert '"auto"' in e.value.message and "hermes" in e.value.message
    calls, tools, g = tool_choice({**body, "parallel_tool_calls": False}, QWEN3_CODER)
    assert calls == AutoToolCalls(QWEN3_CODER, FUNCTIONS, False) and tools == TOOLS
    assert StructuredOutput("lark", g.lark).value == grammar(QWEN3_CODER, FUNCTIONS, False)
    assert tool_choice({"tools": TOOLS}, HERMES)[0].parallel  # OpenAI's default: parallel calls allowed
    with pytest.raises(ApiError, match="response_format"):
        tool_choice({**body, "response_format": {"type": "json_object"}}, HERMES)
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}]
    with pytest.raises(ApiError) as e:
        tool_choice({"tools": odd}, QWEN3_CODER)
    assert e.value.param == "tools" and "'a>b'" in e.value.message
    assert tool_choice({"tools": odd}, HERMES)[0] is not None  # JSON quotes any key
