"""The tool-call syntax of a model's chat template, and the grammar of `tool_choice` "auto" in it.

A model calls a tool by writing its template's call block after (or instead of) its text; which block depends on
how it was trained, so the syntax is read off the chat template (the way it renders an assistant's `tool_calls`)
from a table of known families. The grammar leaves the text free up to the first opening tag (a lazy lexeme that
ends at the tag), then holds each block to one of the tools: its name and its `parameters` schema (in the XML
syntax: the declared parameters in their schema's order, a plain string one as raw text, any other as JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection
from dataclasses import dataclass, replace

JSON_OBJECT_BODY = "json"  # <open>\n{"name": ..., "arguments": {...}}\n<close>, one block per call
JSON_LIST_BODY = "json_list"  # <open>[{"name": ..., "arguments": {...}}, ...]<close>, one block for all calls
XML_BODY = "xml"  # <open>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...</function>\n<close>
# Between two blocks (the templates render consecutive calls on their own lines).
BLOCK_SEPARATOR = "\n"
# What `json.dumps` (and the templates' `tojson`) writes between items and after keys: the calls' JSON is held to
# it, since with flexible whitespace a model may pad without end.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")


@dataclass(frozen=True)
class ToolSyntax:
    """A family's call block: `open` and `close` tags around a `body` (one of the *_BODY kinds)."""

    family: str
    open: str
    close: str
    body: str
    # The tags that are one added token of the model's tokenizer: llguidance reads every added token as a special
    # token, which no text lexeme matches, so the grammar names those tags as tokens.
    special: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.body not in (JSON_OBJECT_BODY, JSON_LIST_BODY, XML_BODY):
            raise ValueError(f"ToolSyntax.body: expected json, json_list or xml, got {self.body!r}")

    def for_tokenizer(self, added_tokens: Collection[str]) -> ToolSyntax:
        """This syntax over a tokenizer with `added_tokens` (their texts)."""
        # (Lark names a special token by its text, which must then read "<...>".)
        return replace(self, special=frozenset(t for t in (self.open, self.close) if t in added_tokens
                                               and t.startswith("<") and t.endswith(">")))

    def tag(self, text: str) -> str:
        """The Lark of tag `text`: a special token, or a string."""
        return text if text in self.special else _lit(text)


# Hermes-style JSON calls (Qwen2.5, Qwen3, Qwen3-Next, Hermes).
HERMES = ToolSyntax("hermes", "<tool_call>", "</tool_call>", JSON_OBJECT_BODY)
# Qwen3-Coder-style XML calls (Qwen3.5, Qwen3-Coder, Nemotron 3).
QWEN3_CODER = ToolSyntax("qwen3_coder", "<tool_call>", "</tool_call>", XML_BODY)
# One JSON list of calls (Nemotron-H, Nemotron Nano 2).
TOOLCALL_LIST = ToolSyntax("toolcall_list", "<TOOLCALL>", "</TOOLCALL>", JSON_LIST_BODY)
KNOWN = (HERMES, QWEN3_CODER, TOOLCALL_LIST)


def detect(template: str | None) -> ToolSyntax | None:
    """The call syntax a chat template renders assistant tool calls in; None when it is none of `KNOWN`."""
    if not template:
        return None
    if "<tool_call>" in template and "<function=" in template and "<parameter=" in template:
        return QWEN3_CODER
    if "<TOOLCALL>" in template:
        return TOOLCALL_LIST
    if "<tool_call>" in template:
        return HERMES
    return None


def _rx(s: str) -> str:
    """`s` as a literal inside a Lark `/.../` regex."""
    return "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in s).replace("\n", "\\n")


def _lit(s: str) -> str:
    """`s` as a Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def _schema(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


def call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": parameters}}


# The keywords of a string schema a raw XML value is held to (or that hold nothing).
_RAW_STRING_KEYS = {"type", "minLength", "maxLength", "enum", "const", "description", "title", "examples", "default",
                    "deprecated", "$comment"}


def raw_string(schema: object) -> bool:
    """An XML parameter's value is written as raw text (not JSON) when its schema is a plain string one (without
    a pattern or format, which only a JSON string can be held to)."""
    return isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= _RAW_STRING_KEYS


def _raw_value(schema: dict, end: str) -> str:
    """A raw-text XML value and the `end` after it, as one lazy lexeme (it ends at the first `end`)."""
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        return " | ".join(_lit(str(v) + end) for v in values if isinstance(v, str)) or _lit(end)
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    count = f"{{{int(lo)},{'' if hi is None else int(hi)}}}"
    return f"/(.|\\n){count}{_rx(end)}/"


def _xml_function(i: int, name: str, parameters: dict, rules: list[str]) -> str:
    """The rules of one function's XML block (appended to `rules`); its rule name."""
    props = parameters.get("properties")
    required = set(parameters.get("required", []))
    end = "\n</parameter>\n"
    items = []
    if isinstance(props, dict) and props:
        for j, (key, sub) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            head = _lit(f"<parameter={key}>\n")
            if raw_string(sub):
                rules.append(f"{rule}: {head} v{i}_{j}")
                rules.append(f"v{i}_{j}[lazy]: {_raw_value(sub, end)}")
            else:
                rules.append(f"{rule}: {head} {_schema(sub if isinstance(sub, dict) else {})} {_lit(end)}")
            items.append(rule if key in required else rule + "?")
    elif props is None:
        # No declared properties: any keys, each with a raw text value.
        rules.append(f"p{i}: \"<parameter=\" /[^<>\\n]+/ \">\\n\" v{i}")
        rules.append(f"v{i}[lazy]: /(.|\\n)*{_rx(end)}/")
        items.append(f"p{i}*")
    rules.append(f"f{i}: {_lit(f'<function={name}>' + chr(10))} {' '.join(items)} {_lit('</function>')}")
    return f"f{i}"


def grammar(syntax: ToolSyntax, functions: dict[str, dict], parallel: bool) -> str:
    """The Lark grammar of "auto": free text without `syntax.open`, or text then call blocks (one call at most
    unless `parallel`), each call one of `functions` (name -> parameters schema)."""
    rules = ["%llguidance {}"]
    close = syntax.tag(syntax.close) if syntax.body == JSON_LIST_BODY else f'"\\n" {syntax.tag(syntax.close)}'
    if syntax.body == XML_BODY:
        names = [_xml_function(i, n, p, rules) for i, (n, p) in enumerate(functions.items())]
        rules.append(f"call: \"\\n\" ({' | '.join(names)}) {close}")
    else:
        one = [call_schema(n, p) for n, p in functions.items()]
        item = one[0] if len(one) == 1 else {"anyOf": one}
        if syntax.body == JSON_LIST_BODY:
            item = {"type": "array", "minItems": 1, "items": item, **({} if parallel else {"maxItems": 1})}
            rules.append(f"call: {_schema(item)} {close}")
        else:
            rules.append(f"call: \"\\n\" {_schema(item)} {close}")
    more = ""
    if parallel and syntax.body != JSON_LIST_BODY:
        more = f" ({_lit(BLOCK_SEPARATOR)} {syntax.tag(syntax.open)} call)*"
    tag = _rx(syntax.open)
    # The text never spells the opening tag out (the answer's parser would read it as one).
    rules.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/")
    if syntax.open in syntax.special:
        # A special token ends the text lexeme by itself.
        rules.append(f"start: TEXT | TEXT {syntax.open} call{more}")
    else:
        # The text and the tag as one lazy lexeme, which ends at the tag (a greedy text lexeme would not).
        rules += [f"start: TEXT | opening call{more}", f"opening[lazy]: /(.|\\n)*{tag}/"]
    return "\n".join(rules) + "\n"


_XML_KEY = re.compile(r"[^<>\n]+")


def check_keys(syntax: ToolSyntax, functions: dict[str, dict]) -> str:
    """Why `functions` cannot be written in `syntax` ("" when they can): XML tags hold names and keys unquoted."""
    if syntax.body != XML_BODY:
        return ""
    for name, params in functions.items():
        keys = [name, *(params.get("properties") or {})]
        for k in keys:
            if not _XML_KEY.fullmatch(k):
                return f"{k!r} in tool {name!r} (names and parameter keys hold no '<', '>' or newline)"
    return ""
