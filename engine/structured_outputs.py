"""What a request's output must match (vLLM's ``structured_outputs``), checked and keyed
here without the grammar engine (the gateway imports this through SamplingParams).

    json            a JSON schema (text): the output is one JSON value matching it
    json_object     any JSON object (OpenAI's ``response_format: json_object``)
    regex           the output matches the regular expression, whole
    choice          the output is exactly one of the strings
    grammar         an EBNF grammar (xgrammar's dialect: ``root ::= ...``)
    structural_tag  xgrammar's structural tag JSON (``{"type": "structural_tag", "format": ...}``):
                    what tool calls compile to

Exactly one is set. JSON output is compact between tokens by default (no free
whitespace: a small model cannot fill max_tokens with blanks); ``any_whitespace``
allows it, at most ``MAX_WHITESPACE`` characters in a row.

``reasoning_end_token_ids`` (a thinking model: the gateway's ``--reasoning-parser``)
holds the constraint back while the model reasons: every token is allowed until the
output contains this token sequence (``</think>``'s id, gpt-oss's
``<|channel|>final<|message|>``), and the grammar matches the output after it. Empty:
the grammar matches the output from its first token. It is no part of the grammar
(nor of ``key``).

A JSON schema is checked for keywords the grammar engine would silently ignore
(``uniqueItems``, ``not``, ``if``/``then``/``else``, ``allOf`` of several schemas, ...):
a request naming one is refused with the keyword's name and path, rather than served
output that does not match its schema. The grammar engine finds the other errors
(bad regex, bad grammar) when it compiles, on the engine servers.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass
from typing import Any

MAX_SPEC_CHARS = 256 * 1024  # a schema, regex, grammar or structural tag
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
MAX_WHITESPACE = 4  # with any_whitespace: the longest run of blanks between JSON tokens
MAX_REASONING_END_TOKENS = 16
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

# Keywords the grammar engine (xgrammar) enforces or that only annotate.
_ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                "readOnly", "writeOnly", "$defs", "definitions", "$ref", "strict"}
_SUPPORTED = {
    "type", "enum", "const", "anyOf", "oneOf", "allOf",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems", "contains", "minContains", "maxContains",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
} | _ANNOTATIONS
_FORMATS = {"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"}
# Keywords whose value is a map of names to schemas, or a schema, or a list of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_VALUES = ("additionalProperties", "items", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | None = None  # a JSON schema, as JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None
    any_whitespace: bool = False  # JSON kinds: allow blanks between tokens (bounded)
    # The grammar starts after the first occurrence of this token sequence in the output
    # (the end of a thinking model's reasoning); empty: at the first output token.
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.reasoning_end_token_ids, list):
            object.__setattr__(self, "reasoning_end_token_ids", tuple(self.reasoning_end_token_ids))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if not isinstance(self.choice, list):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        """The kind's value (True for json_object)."""
        return getattr(self, self.kind)

    @property
    def key(self) -> str:
        """What compiles to the same grammar has the same key (the compiled-grammar cache's)."""
        blob = json.dumps([self.kind, self.spec, self.any_whitespace], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def validate(self) -> None:
        """ValueError naming the field: not exactly one kind, a wrong type, an oversized
        spec, a schema that is not JSON or names an unsupported keyword."""
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got "
                             f"{', '.join(set_kinds) or 'none'}")
        kind = set_kinds[0]
        if not isinstance(self.json_object, bool) or not isinstance(self.any_whitespace, bool):
            raise ValueError("structured_outputs.json_object and any_whitespace must be booleans")
        ends = self.reasoning_end_token_ids
        if not isinstance(ends, tuple) or len(ends) > MAX_REASONING_END_TOKENS or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in ends):
            raise ValueError(f"structured_outputs.reasoning_end_token_ids must be at most "
                             f"{MAX_REASONING_END_TOKENS} token ids, got {ends!r:.80}")
        if kind == "choice":
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must list 1 to {MAX_CHOICES} strings, "
                                 f"got {len(self.choice or ())}")
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise ValueError(f"structured_outputs.choice: each choice must be a non-empty string of at "
                                     f"most {MAX_CHOICE_CHARS} characters, got {c!r:.80}")
            return
        if kind == "json_object":
            return
        value = getattr(self, kind)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, got {value!r:.80}")
        if len(value) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is {len(value)} characters; at most {MAX_SPEC_CHARS}")
        if kind in ("json", "structural_tag"):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.{kind} is not valid JSON: {e}") from None
            if kind == "json":
                check_schema(parsed)
            elif not isinstance(parsed, dict) or parsed.get("type") != "structural_tag":
                raise ValueError('structured_outputs.structural_tag must be an object with "type": "structural_tag"')


class GrammarState(enum.Enum):
    """Where a request's constraint stands, as the grammar manager (engine/grammar.py) reports
    it and the scheduler acts on it; here, without the grammar engine, so the scheduler
    imports it for nothing."""

    WAIT = enum.auto()  # compiling: the request waits
    READY = enum.auto()  # compiled and caught up with the request's tokens: its next mask is known
    DONE = enum.auto()  # the grammar is complete: the request has its whole output
    ERROR = enum.auto()  # it failed to compile, timed out, or a token did not match (with a message)


def check_schema(schema: Any, path: str = "#") -> None:
    """ValueError naming the first keyword (and where it is) that the grammar engine does
    not enforce, or a ``format`` it does not know; ``schema`` is parsed JSON."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema at {path} must be an object or a boolean, got {type(schema).__name__}")
    unknown = sorted(k for k in schema if k not in _SUPPORTED)
    if unknown:
        raise ValueError(f"the JSON schema uses {', '.join(repr(k) for k in unknown)} at {path}, which structured "
                         "outputs do not enforce (supported: type, enum, const, anyOf, oneOf, properties, required, "
                         "additionalProperties, items, prefixItems, min/max lengths, items and properties, pattern, "
                         "format, numeric bounds, $ref/$defs)")
    if "allOf" in schema and len(schema["allOf"] or []) > 1:
        raise ValueError(f"the JSON schema's allOf at {path} combines {len(schema['allOf'])} schemas; structured "
                         "outputs enforce allOf of one schema only")
    fmt = schema.get("format")
    if fmt is not None and fmt not in _FORMATS:
        raise ValueError(f"the JSON schema's format {fmt!r} at {path} is not supported (supported: "
                         f"{', '.join(sorted(_FORMATS))})")
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{path}/{key}/{name}")
    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), (dict, bool)):
            check_schema(schema[key], f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{path}/{key}/{i}")
