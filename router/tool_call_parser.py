"""Splitting a chat answer of `tool_choice` "auto" into its text and its tool calls, whole or as it streams.

Text before the first opening tag (less the whitespace before the tag) is `content`; each call block after it becomes an OpenAI tool call (a generated
id, the arguments as JSON text). While streaming, text that may be the start of an opening tag is held back (as
stop strings are) and a call goes out once its block is complete. What cannot be read as calls (a block cut short
by max_tokens) is answered as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from baton.router.tool_syntax import BLOCK_SEPARATOR, JSON_LIST_BODY, XML_BODY, ToolSyntax, raw_string

_DECODER = json.JSONDecoder()


class _Malformed(ValueError):
    """Output that is not a call block (the grammar was not followed to the end)."""


def tool_call(name: str, arguments: object) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _expect(buf: str, at: int, lit: str) -> int:
    """The index after `lit` at `at`; raises `_Malformed` when `buf` differs there, EOFError when it stops short."""
    got = buf[at:at + len(lit)]
    if got != lit[:len(got)]:
        raise _Malformed(f"expected {lit!r} at {at}")
    if len(got) < len(lit):
        raise EOFError
    return at + len(lit)


def _json(buf: str, at: int) -> tuple[object, int]:
    try:
        return _DECODER.raw_decode(buf, at)
    except json.JSONDecodeError:
        # A JSON value cut short and one that is wrong look alike: a complete one is followed by more text.
        raise EOFError from None


@dataclass
class ToolCallSplitter:
    """One choice's output, fed in order: `feed` and `finish` answer the new (content, calls) each time."""

    syntax: ToolSyntax
    functions: dict[str, dict]
    parallel: bool
    _buf: str = ""
    _in_calls: bool = False  # the first opening tag has been seen
    _failed: bool = False  # the rest is answered as text
    _gap: str = ""  # the whitespace before the first tag
    calls: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        out = ""
        if not self._in_calls:
            i = self._buf.find(self.syntax.open)
            if i < 0:
                # Whitespace before a tag is not content (the templates put a newline between the two).
                head = self._buf[:len(self._buf) - _partial_tag(self._buf, self.syntax.open)]
                out = head.rstrip()
                self._buf = self._buf[len(out):]
                return out, []
            out = self._buf[:i].rstrip()
            self._gap, self._buf, self._in_calls = self._buf[len(out):i], self._buf[i:], True
        calls = self._blocks()
        if self._failed:
            out, self._buf = out + self._rest(), ""
        return out, calls

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the output ended: a held partial tag or an unfinished block, as text."""
        out, calls = self.feed("")
        out, self._buf = out + self._rest(), ""
        return out, calls

    def _rest(self) -> str:
        """The unread output as text (with the whitespace before the first tag when no call came of it)."""
        gap, self._gap = ("" if self.calls else self._gap), ""
        return gap + self._buf

    def _blocks(self) -> list[dict]:
        new: list[dict] = []
        while self._buf and not self._failed:
            try:
                at = 0
                if self.calls:
                    if self.syntax.body == JSON_LIST_BODY or not self.parallel:
                        raise _Malformed("a call block after the last one allowed")
                    at = _expect(self._buf, 0, BLOCK_SEPARATOR)
                got, end = self._block(_expect(self._buf, at, self.syntax.open))
            except EOFError:
                break
            except _Malformed:
                self._failed = True
                break
            self._buf = self._buf[end:]
            self.calls += got
            new += got
        return new

    def _block(self, at: int) -> tuple[list[dict], int]:
        """The calls of the block whose body starts at `at`, and the index after its closing tag."""
        buf, body = self._buf, self.syntax.body
        if body == JSON_LIST_BODY:
            items, at = _json(buf, at)
            if not isinstance(items, list):
                raise _Malformed("expected a list of calls")
            return [self._call(c) for c in items], _expect(buf, at, self.syntax.close)
        at = _expect(buf, at, "\n")
        if body == XML_BODY:
            at = _expect(buf, at, "<function=")
            name_end = buf.find(">\n", at)
            if name_end < 0:
                raise EOFError
            name = buf[at:name_end]
            if name not in self.functions:
                raise _Malformed(f"function {name!r}")
            args, at = self._xml_arguments(name, name_end + 2)
            at = _expect(buf, at, "</function>\n" + self.syntax.close)
            return [tool_call(name, args)], at
        one, at = _json(buf, at)
        return [self._call(one)], _expect(buf, at, "\n" + self.syntax.close)

    def _call(self, one: object) -> dict:
        if not isinstance(one, dict) or one.get("name") not in self.functions:
            raise _Malformed("expected {'name': one of the tools, 'arguments': ...}")
        return tool_call(one["name"], one.get("arguments", {}))

    def _xml_arguments(self, name: str, at: int) -> tuple[dict, int]:
        buf, args = self._buf, {}
        props = self.functions[name].get("properties") or {}
        while not buf.startswith("</function>", at):
            if len(buf) - at < len("</function>") and "</function>".startswith(buf[at:]):
                raise EOFError
            at = _expect(buf, at, "<parameter=")
            key_end = buf.find(">\n", at)
            if key_end < 0:
                raise EOFError
            key, at = buf[at:key_end], key_end + 2
            end = "\n</parameter>\n"
            if raw_string(props.get(key)) or key not in props:
                value_end = buf.find(end, at)
                if value_end < 0:
                    raise EOFError
                args[key], at = buf[at:value_end], value_end
            else:
                args[key], at = _json(buf, at)
            at = _expect(buf, at, end)
        return args, at


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may be starting)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
