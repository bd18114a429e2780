"""OpenAI's structured output on the HTTP front: `response_format` (json_object, json_schema) and chat `tools` with
`tool_choice`, as the grammar of `SamplingParams.structured_output`.

A forced tool call ("required" or a named function) is generated as a JSON array of `{"name", "arguments"}` objects
(one item unless `parallel_tool_calls` is true), each `arguments` matching its function's `parameters`, and answered
as `message.tool_calls` with finish_reason "tool_calls". With "auto" (the default when tools are given) the model
answers in text or calls tools in its chat template's own call syntax (`tool_syntax`), split into `content` and
`tool_calls` by `tool_call_parser`; a template whose syntax Baton does not know is refused.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from baton.engine.structured_output import JSON_OBJECT, JSON_SCHEMA, LARK, StructuredOutput
from baton.proto.v1 import generation_pb2
from baton.router.http_errors import ApiError, bad
from baton.router.tool_call_parser import ToolCallSplitter
from baton.router.tool_syntax import KNOWN, ToolSyntax, check_keys, grammar

# Tools a request may declare (each rides in its grammar).
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCalls:
    """A chat request whose output is forced to tool calls: the names it may call."""

    names: tuple[str, ...]

    def parse(self, text: str) -> list[dict] | None:
        """OpenAI's `tool_calls` from the generated text, or None when it is not a complete call list (cut short by
        max_tokens: the text is then answered as content)."""
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and c.get("name") in self.names
                                                  for c in calls):
            return None
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}} for c in calls]


@dataclass(frozen=True)
class AutoToolCalls:
    """A chat request whose output may call tools ("auto"): how to split each choice's text into content and calls."""

    syntax: ToolSyntax
    functions: dict[str, dict]
    parallel: bool

    def splitter(self) -> ToolCallSplitter:
        return ToolCallSplitter(self.syntax, self.functions, self.parallel)


def _grammar(param: str, kind: str, value: str = "") -> generation_pb2.StructuredOutput:
    try:
        StructuredOutput(kind, value)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param) from None
    if kind == JSON_OBJECT:
        return generation_pb2.StructuredOutput(json_object=True)
    if kind == LARK:
        return generation_pb2.StructuredOutput(lark=value)
    return generation_pb2.StructuredOutput(json_schema=value)


def response_format(body: dict) -> generation_pb2.StructuredOutput | None:
    """The grammar `response_format` asks for (None: text)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or rf.get("type") not in ("text", JSON_OBJECT, JSON_SCHEMA):
        raise bad("response_format", 'an object with "type" "text", "json_object" or "json_schema"', rf)
    if rf["type"] == "text":
        return None
    if rf["type"] == JSON_OBJECT:
        return _grammar("response_format", JSON_OBJECT)
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str):
        raise bad("response_format.json_schema", 'an object with a string "name" and a "schema"', js)
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", "a JSON schema object", schema)
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "a boolean", strict)
    # strict or not, the output matches the schema: a grammar enforces it either way.
    return _grammar("response_format.json_schema.schema", JSON_SCHEMA, json.dumps(schema))


def _functions(tools: Any) -> dict[str, dict]:
    """Function name -> its parameters schema, from OpenAI's `tools`."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad("tools", f"a list of at most {MAX_TOOLS} tools", tools)
    out: dict[str, dict] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{i}]", 'a {"type": "function", "function": {"name", "parameters"}} object', t)
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "a JSON schema object", params)
        if fn["name"] in out:
            raise bad(f"tools[{i}].function.name", "names used once", fn["name"])
        out[fn["name"]] = params
    return out


def tool_choice(body: dict, syntax: ToolSyntax | None = None
                ) -> tuple[ToolCalls | AutoToolCalls | None, list[dict] | None, generation_pb2.StructuredOutput | None]:
    """(how to answer the calls, the tools for the chat template, their grammar) of a chat body whose model's
    template writes calls in `syntax` (None: unknown); (None, None, None) without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "a boolean", parallel)
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", '"none" or null without tools', choice)
        return None, None, None
    functions = _functions(tools)
    if choice == "none":
        return None, tools, None
    if choice is None or choice == "auto":
        calls = _auto(body, syntax, functions, parallel is not False)
        return calls, tools, _grammar("tools", LARK, grammar(calls.syntax, calls.functions, calls.parallel))
    if choice == "required":
        names = list(functions)
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and choice["function"].get("name") in functions):
        names = [choice["function"]["name"]]
    else:
        raise bad("tool_choice", f'"none", "auto", "required" or {{"type": "function", "function": {{"name": one of '
                                 f'{sorted(functions)}}}}}', choice)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format: expected text or null with tool_choice forcing a call (the call is "
                            "the output)", param="response_format")
    one = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": n}, "arguments": functions[n]}} for n in names]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": one[0] if len(one) == 1 else {"anyOf": one}}
    if parallel is not True:
        schema["maxItems"] = 1
    return ToolCalls(tuple(names)), tools, _grammar("tools", JSON_SCHEMA, json.dumps(schema))


def _auto(body: dict, syntax: ToolSyntax | None, functions: dict[str, dict], parallel: bool) -> AutoToolCalls:
    """"auto": text or calls in the template's syntax."""
    if syntax is None:
        known = ", ".join(f"{s.family} ({s.open}...{s.close})" for s in KNOWN)
        raise ApiError(400, f'tool_choice: "auto" (the default with tools) needs the model\'s tool-call syntax, and '
                            f"its chat template writes calls in none this server knows ({known}): send \"required\", "
                            '{"type": "function", "function": {"name": ...}} or "none"',
                       param="tool_choice", code="unsupported_parameter")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, 'response_format: expected text or null with tool_choice "auto" (its grammar is the '
                            "calls' syntax)", param="response_format")
    why = check_keys(syntax, functions)
    if why:
        raise ApiError(400, f"tools: expected names the {syntax.family} call syntax can write, got {why}",
                       param="tools")
    return AutoToolCalls(syntax, functions, parallel)

