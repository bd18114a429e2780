"""A request's output grammar: what `SamplingParams.structured_output` holds, torch-free (the router builds and
validates it too).

The grammar library is llguidance: it needs no tokenizer-wide precompilation per grammar (its token masks are
computed lazily, so a new JSON schema costs nothing up front), has no runtime dependencies (xgrammar pulls in
transformers and triton, and imports transformers on import), takes JSON schema, regex and Lark (EBNF) alike, and
rolls a matcher back by any number of tokens (what verifying MTP drafts needs). outlines-core builds a whole regex
DFA index per schema and cannot express recursive schemas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import llguidance

JSON_OBJECT = "json_object"  # any JSON object
JSON_SCHEMA = "json_schema"  # `value`: the schema, as JSON text
REGEX = "regex"              # `value`: the regular expression the whole output matches
LARK = "lark"                # `value`: a Lark grammar (llguidance's EBNF dialect)
KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, LARK)
# Compact JSON (no whitespace between tokens): with flexible whitespace a model may pad output without end.
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar a request's output must match: `kind` (one of `KINDS`) and its `value` (empty for json_object)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output field 'kind': expected one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"structured_output field 'value': expected a string, got {self.value!r}")
        if self.kind == JSON_OBJECT and self.value:
            raise ValueError(f"structured_output field 'value': expected nothing for json_object, got {self.value!r}")
        if self.kind != JSON_OBJECT and not self.value:
            raise ValueError(f"structured_output field 'value': expected the {self.kind} text, got an empty string")
        if self.kind == JSON_SCHEMA:
            try:
                schema = json.loads(self.value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_output json_schema: expected JSON text, got {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError(f"structured_output json_schema: expected a JSON object, got {self.value[:80]!r}")
        error = grammar_error(self)
        if error:
            raise ValueError(f"structured_output {self.kind}: expected a grammar llguidance accepts, got: {error}")


@lru_cache(maxsize=64)
def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar of `spec`, built once per distinct spec."""
    if spec.kind == JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=_JSON_OPTIONS)
    if spec.kind == JSON_SCHEMA:
        return llguidance.LLMatcher.grammar_from_json_schema(spec.value, overrides=_JSON_OPTIONS)
    if spec.kind == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    return llguidance.LLMatcher.grammar_from_lark(spec.value)


@lru_cache(maxsize=64)
def grammar_error(spec: StructuredOutput) -> str:
    """Why llguidance refuses `spec`'s grammar ("" when it accepts it)."""
    try:
        text = grammar_text(spec)
    except ValueError as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(text)
