"""Refuse JSON-schema features a backend would silently ignore, naming the feature and its JSON pointer.

Each backend declares a table of ``SchemaRule``s. ``refuse_unsupported_features`` walks every subschema (and
only subschemas: a property *named* ``format`` is not the ``format`` keyword) and raises for the first match.
"""

from __future__ import annotations

import json
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


# Keywords that constrain an instance (annotations such as title, description or default do not).
ASSERTION_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
        "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "contains",
        "maxContains", "minContains", "items", "prefixItems", "additionalItems", "unevaluatedItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "properties",
        "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties", "dependentSchemas",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip


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


def with_siblings_rule(keyword: str, allowed: tuple[str, ...] = ()) -> SchemaRule:
    """``keyword`` next to other assertion keywords (but ``allowed``): engines that keep one side drop the other."""
    ignored = {keyword, *allowed}
    return SchemaRule(
        f"{keyword} together with other keywords",
        lambda s: keyword in s and any(k in ASSERTION_KEYWORDS and k not in ignored for k in s),
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


def resolve_local_ref(root: Any, ref: str) -> Any:
    """The subschema a ``#/...`` reference points at, or None (outlines-core reports other references itself)."""
    if not ref.startswith("#"):
        return None
    target = root
    for part in ref[1:].split("/")[1:]:
        if not isinstance(target, dict):
            return None
        target = target.get(part.replace("~1", "/").replace("~0", "~"))
    return target


def one_of_overlap_rule(root: Any) -> SchemaRule:
    """``oneOf`` whose branches are not provably disjoint (``root`` resolves ``$ref`` branches).

    Engines that read ``oneOf`` as ``anyOf`` (xgrammar falls back to it, outlines-core always does) then accept a
    value valid under several branches, which ``oneOf`` forbids (measured: ``oneOf`` of integer and number lets ``1``
    through). Provably disjoint: branches of pairwise disjoint types, of pairwise disjoint ``const``/``enum``
    values, or objects that all require one property whose ``const``/``enum`` values are pairwise disjoint.
    """

    def applies(schema: dict[str, Any]) -> bool:
        branches = schema.get("oneOf")
        if not isinstance(branches, list):
            return False
        resolved = [resolve_local_ref(root, b["$ref"]) if _is_ref(b) else b for b in branches]
        return not _provably_disjoint(resolved)

    return SchemaRule("oneOf whose branches may overlap", applies)


def _is_ref(branch: Any) -> bool:
    return isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and len(branch) == 1


def _provably_disjoint(branches: list[Any]) -> bool:
    if len(branches) <= 1:
        return True
    if not all(isinstance(branch, dict) for branch in branches):
        return False
    types = [_type_set(branch) for branch in branches]
    if all(t is not None for t in types) and _pairwise(types, _types_overlap):
        return True
    values = [_value_keys(branch) for branch in branches]
    if all(v is not None for v in values) and _pairwise(values, lambda a, b: bool(a & b)):
        return True
    return _discriminated(branches)


def schema_types(schema: dict[str, Any]) -> list[Any]:
    """The types a schema's ``type`` names (none where it names none)."""
    types = schema.get("type")
    return [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []


def _type_set(schema: dict[str, Any]) -> frozenset[str] | None:
    types = schema.get("type")
    if isinstance(types, str):
        return frozenset({types})
    if isinstance(types, list) and all(isinstance(t, str) for t in types):
        return frozenset(types)
    return None


def _types_overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    numeric = {"integer", "number"}
    return bool(a & b) or (bool(a & numeric) and bool(b & numeric))


def _value_keys(schema: dict[str, Any]) -> frozenset[str] | None:
    """The ``const``/``enum`` values as comparable keys (``1`` and ``1.0`` are one value)."""
    if "const" in schema:
        values = [schema["const"]]
    elif isinstance(schema.get("enum"), list):
        values = schema["enum"]
    else:
        return None
    return frozenset(json.dumps(_normalised(value), sort_keys=True) for value in values)


def _normalised(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_normalised(item) for item in value]
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items()}
    return value


def _discriminated(branches: list[dict[str, Any]]) -> bool:
    """Every branch is an object requiring a property whose values tell the branches apart."""
    if not all(_type_set(branch) == frozenset({"object"}) for branch in branches):
        return False
    names = set.intersection(*(set(branch.get("required") or ()) for branch in branches))
    for name in names:
        subschemas = [(branch.get("properties") or {}).get(name) for branch in branches]
        values = [_value_keys(sub) if isinstance(sub, dict) else None for sub in subschemas]
        if all(v is not None for v in values) and _pairwise(values, lambda a, b: bool(a & b)):
            return True
    return False


def _pairwise(items: list[Any], overlap: Callable[[Any, Any], bool]) -> bool:
    """True when no two items overlap."""
    return not any(overlap(a, b) for i, a in enumerate(items) for b in items[i + 1 :])
