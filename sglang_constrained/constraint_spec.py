"""Constraint keys: how a request's constraint becomes a cache key and, at compile time, a dispatchable spec.

A key is ``(key_type, spec)``. ``json`` and ``structural_tag`` specs are canonicalised JSON text so that the
same constraint written with other spacing shares a cache entry; ``choice`` and ``json_object`` are lowered to
``regex`` and ``json`` right before dispatch, so every backend that speaks those kinds speaks them too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema

from sglang_constrained.errors import GrammarSpecError

GrammarKey = tuple[str, str]

__all__ = [
    "CONSTRAINT_KINDS",
    "MAX_SPEC_DEPTH",
    "GrammarKey",
    "GrammarSpecError",
    "check_schema_is_valid",
    "choices_to_regex",
    "escape_regex_literal",
    "lower_constraint",
    "make_grammar_key",
    "nesting_depth",
]

CONSTRAINT_KINDS = ("json", "regex", "ebnf", "structural_tag", "choice", "json_object")
MAX_SPEC_DEPTH = 100
"""Deepest nesting of objects and arrays a JSON spec may have; every backend compiles 100 levels, and the schema
checks recurse about ten Python frames per level (150 levels ran out of stack)."""
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}

_REGEX_METACHARACTERS = frozenset("\\.^$|?*+()[]{}")
_REGEX_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def make_grammar_key(kind: str, spec: Any) -> GrammarKey:
    """The cache key for a constraint of ``kind`` (one of ``CONSTRAINT_KINDS``).

    ``spec`` is a string, or for ``json`` / ``structural_tag`` also a dict, for ``choice`` a list of strings,
    and ignored for ``json_object``. Text that is not valid JSON is kept as it is, so that compiling it
    reports the parse error.
    """
    if kind not in CONSTRAINT_KINDS:
        raise ValueError(f"unknown constraint kind {kind!r}; expected one of {CONSTRAINT_KINDS}")
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        if not isinstance(spec, list | tuple) or not all(isinstance(c, str) for c in spec):
            raise ValueError("a choice constraint is a list of strings")
        return kind, json.dumps(list(spec), ensure_ascii=False)
    if kind in ("json", "structural_tag"):
        if isinstance(spec, dict | bool):
            _check_depth(kind, spec)
            return kind, _canonical_json(spec)
        if isinstance(spec, str):
            try:
                parsed = json.loads(spec)
            except json.JSONDecodeError:
                return kind, spec
            except RecursionError:
                raise GrammarSpecError(_too_deep(kind)) from None
            _check_depth(kind, parsed)
            return kind, _canonical_json(parsed)
    if not isinstance(spec, str):
        raise ValueError(f"a {kind} constraint is a string, not {type(spec).__name__}")
    return kind, spec


def lower_constraint(
    key: GrammarKey, max_spec_bytes: int, prepare_json_schema: Callable[[Any], Any]
) -> tuple[str, str]:
    """``(dispatch_type, spec)`` for a key, after the checks every backend shares; raises ``GrammarSpecError``.

    ``prepare_json_schema`` is the backend's: it refuses schema features the backend would silently ignore and
    returns the schema to compile.
    """
    key_type, spec = key
    if key_type not in CONSTRAINT_KINDS:
        raise GrammarSpecError(f"unknown constraint kind {key_type!r}")
    num_bytes = len(spec.encode("utf-8"))
    if num_bytes > max_spec_bytes:
        raise GrammarSpecError(
            f"the {key_type} spec is {num_bytes:,} bytes, over the limit of {max_spec_bytes:,} bytes"
        )
    if key_type == "choice":
        return "regex", choices_to_regex(_parse_json(spec, "choice list"))
    if key_type == "json_object":
        return "json", _canonical_json(JSON_OBJECT_SCHEMA)
    if key_type == "json":
        schema = _parse_json(spec, "JSON schema")
        check_schema_is_valid(schema)
        return key_type, _canonical_json(prepare_json_schema(schema))
    if key_type == "structural_tag":
        if not isinstance(_parse_json(spec, "structural tag"), dict):
            raise GrammarSpecError("a structural tag must be a JSON object")
    elif not spec.strip():
        raise GrammarSpecError(f"the {key_type} spec is empty")
    return key_type, spec


def choices_to_regex(choices: Any) -> str:
    """An alternation that matches exactly one of ``choices``, each escaped for every backend's regex dialect.

    Longer options come first: outlines-core's automaton follows leftmost-first semantics, under which ``Java``
    placed before ``JavaScript`` would end the match at ``Java`` and never allow the longer option.
    """
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarSpecError("a choice constraint must be a non-empty list of strings")
    return "|".join(f"({escape_regex_literal(c)})" for c in sorted(choices, key=len, reverse=True))


def escape_regex_literal(text: str) -> str:
    """Escape ``text`` so that the xgrammar, llguidance and outlines-core regex dialects all match it literally.

    Only true metacharacters are escaped (xgrammar warns on escapes such as ``\\#``); other control
    characters become ``\\uHHHH`` (xgrammar reads every hex digit after ``\\x``: ``\\x01f`` would be U+001F); non-ASCII
    text stays literal.
    """
    pieces = []
    for char in text:
        if char in _REGEX_METACHARACTERS:
            pieces.append("\\" + char)
        elif char in _REGEX_NAMED_ESCAPES:
            pieces.append(_REGEX_NAMED_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            pieces.append(f"\\u{ord(char):04x}")
        else:
            pieces.append(char)
    return "".join(pieces)


def check_schema_is_valid(schema: Any) -> None:
    """Refuse a schema that breaks the JSON Schema meta-schema, naming the keyword and where it is."""
    if not isinstance(schema, dict | bool):
        raise GrammarSpecError(f"a JSON schema must be an object or a boolean, not {_json_type_name(schema)}")
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    error = jsonschema.exceptions.best_match(validator_class(validator_class.META_SCHEMA).iter_errors(schema))
    if error is not None:
        where = _json_pointer(error.path)
        raise GrammarSpecError(
            f"invalid JSON schema at {where}: the value of {error.path[-1] if error.path else 'the schema'!r} "
            f"fails the meta-schema's {error.validator!r} rule"
        )


def nesting_depth(value: Any) -> int:
    """How many objects and arrays deep ``value`` nests (0 for a scalar); iterative, for any depth."""
    depth, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return depth


def _check_depth(kind: str, spec: Any) -> None:
    depth = nesting_depth(spec)
    if depth > MAX_SPEC_DEPTH:
        raise GrammarSpecError(_too_deep(kind, depth))


def _too_deep(kind: str, depth: int | None = None) -> str:
    what = "JSON schema" if kind == "json" else "structural tag"
    levels = f"{depth} levels deep" if depth is not None else "too deeply to parse"
    return f"the {what} nests objects and arrays {levels}; at most {MAX_SPEC_DEPTH} levels are allowed"


def _json_pointer(path: Any) -> str:
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else "/ (the root)"


def _json_type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _parse_json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarSpecError(f"the {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e


def _canonical_json(value: Any) -> str:
    """Compact JSON with key order kept (the order of ``properties`` is the order of the output)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
