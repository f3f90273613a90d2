"""Refuse JSON-schema features a backend would silently ignore, naming the feature and its JSON pointer.

Each backend declares a table of ``SchemaRule``s. ``refuse_unsupported_features`` walks every subschema (and
only subschemas: a property *named* ``format`` is not the ``format`` keyword) and raises for the first match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sglang_constrained.errors import GrammarSpecError

_SCHEMA_VALUED = (
    "additionalProperties",
    "additionalItems",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_SCHEMA_MAP_VALUED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_SCHEMA_ARRAY_VALUED = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


@dataclass(frozen=True)
class SchemaRule:
    """One unsupported feature: its user-facing name and a test on a single (sub)schema object."""

    feature: str
    applies: Callable[[dict[str, Any]], bool]


def keyword_rule(keyword: str) -> SchemaRule:
    """The keyword is refused wherever it appears in a schema object."""
    return SchemaRule(keyword, lambda schema: keyword in schema)


def keywords_together_rule(keyword: str, others: tuple[str, ...]) -> SchemaRule:
    """``keyword`` is refused when it appears in the same schema object as any of ``others``."""
    return SchemaRule(
        f"{keyword} together with {'/'.join(others)}",
        lambda schema: keyword in schema and any(other in schema for other in others),
    )


def unknown_format_rule(supported_formats: frozenset[str]) -> SchemaRule:
    """A ``format`` value outside ``supported_formats`` is refused."""
    return SchemaRule(
        "format",
        lambda schema: isinstance(schema.get("format"), str) and schema["format"] not in supported_formats,
    )


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def enum_outside_type_rule() -> SchemaRule:
    """``enum``/``const`` values that the sibling ``type`` forbids (engines that keep the enum drop the type)."""

    def applies(schema: dict[str, Any]) -> bool:
        types = schema.get("type")
        allowed = [types] if isinstance(types, str) else types
        if not isinstance(allowed, list) or not all(t in _JSON_TYPES for t in allowed):
            return False
        values = list(schema.get("enum", [])) if isinstance(schema.get("enum"), list) else []
        if "const" in schema:
            values.append(schema["const"])
        return any(not any(_JSON_TYPES[t](value) for t in allowed) for value in values)

    return SchemaRule("enum/const values that the sibling 'type' forbids", applies)


def refuse_unsupported_features(schema: Any, rules: tuple[SchemaRule, ...], backend_name: str) -> None:
    """Raise ``GrammarSpecError`` naming the first unsupported feature found and where it is."""
    for pointer, subschema in iter_subschemas(schema):
        for rule in rules:
            if rule.applies(subschema):
                detail = _feature_detail(rule, subschema)
                raise GrammarSpecError(
                    f"the {backend_name} grammar backend does not support the JSON schema feature "
                    f"{detail} (at {pointer or '/'}); it would be ignored, so the schema is refused"
                )


def iter_subschemas(schema: Any, pointer: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``schema`` with its JSON pointer, the root first."""
    if not isinstance(schema, dict):
        return
    yield pointer, schema
    for keyword in _SCHEMA_VALUED:
        if isinstance(schema.get(keyword), dict):
            yield from iter_subschemas(schema[keyword], f"{pointer}/{_escape(keyword)}")
    for keyword in _SCHEMA_MAP_VALUED:
        if isinstance(schema.get(keyword), dict):
            for name, subschema in schema[keyword].items():
                yield from iter_subschemas(subschema, f"{pointer}/{_escape(keyword)}/{_escape(name)}")
    for keyword in _SCHEMA_ARRAY_VALUED:
        if isinstance(schema.get(keyword), list):
            for index, subschema in enumerate(schema[keyword]):
                yield from iter_subschemas(subschema, f"{pointer}/{_escape(keyword)}/{index}")


def _feature_detail(rule: SchemaRule, subschema: dict[str, Any]) -> str:
    if rule.feature == "format":
        return f"'format': {str(subschema['format'])[:60]!r}"
    return repr(rule.feature)


def _escape(token: str) -> str:
    return str(token).replace("~", "~0").replace("/", "~1")
