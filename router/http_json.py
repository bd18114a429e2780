"""Decoding a request body into a JSON object that the rest of the front can trust to be plain data.

Strict where Python's `json` is lenient: the body must be UTF-8 (or UTF-16/32 with a BOM, as RFC 8259's
detection allows), no NaN or Infinity (nor a number too large for a float), nesting at most `max_depth`
deep, and every string and key valid Unicode (a `\\ud800` escape decodes to a lone surrogate that no
tokenizer or encoder accepts). Each failure is an `ApiError` 400 naming the field. CPU-bound: callers run
it off the event loop.
"""

from __future__ import annotations

import json
import math
from typing import Any

from baton.router.http_errors import ApiError, bad


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]!r} out of range")
    return v


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _field(path: str) -> str:
    return path or "body"


def _err(param: str, text: str) -> ApiError:
    return ApiError(400, f"{param}: {text}", param=param)


def _check(obj: Any, max_depth: int) -> None:
    """Walks `obj` iteratively (no recursion on the client's nesting). A string's error names its path
    (`messages[0].content`); a nesting error names the top-level field it is under."""
    stack: list[tuple[Any, str, str, int]] = [(obj, "", "", 0)]
    while stack:
        v, path, top, depth = stack.pop()
        if isinstance(v, str):
            if not v.isascii() and not _is_unicode(v):
                raise _err(_field(path), "expected valid Unicode text, got a string with a lone surrogate")
        elif isinstance(v, dict | list):
            if depth >= max_depth:
                raise _err(_field(top), f"expected JSON nested at most {max_depth} levels deep, got deeper nesting")
            if isinstance(v, dict):
                for k, x in v.items():
                    if not k.isascii() and not _is_unicode(k):
                        raise _err(_field(path), "expected valid Unicode keys, got a key with a lone surrogate")
                    key = k if len(k) <= 64 else k[:64] + "..."
                    name = f"{path}.{key}" if path else key
                    if isinstance(x, str | dict | list):
                        stack.append((x, name, top or key, depth + 1))
            else:
                for i, x in enumerate(v):
                    if isinstance(x, str | dict | list):
                        stack.append((x, f"{path}[{i}]", top, depth + 1))


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def decode_object(body: bytes, max_depth: int) -> dict:
    """The JSON object in `body`, checked as the module says."""
    try:
        obj = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise _err("body", f"expected JSON nested at most {max_depth} levels deep, got deeper nesting") from None
    except (ValueError, UnicodeDecodeError) as e:
        message = str(e)
        raise ApiError(400, f"body: expected a JSON object, got invalid JSON: {message[:200]}",
                       param="body") from None
    if not isinstance(obj, dict):
        raise bad("body", "a JSON object", type(obj).__name__)
    _check(obj, max_depth)
    return obj
