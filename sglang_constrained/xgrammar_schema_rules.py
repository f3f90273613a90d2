"""The JSON-schema features xgrammar 0.2.8 compiles but does not enforce, refused up front with their names.

Each rule was measured against the engine (the xgrammar tests re-check each against jsonschema): an instance that
breaks only that feature passes xgrammar's grammar. A ``oneOf`` whose branches may overlap (xgrammar falls back to
``anyOf``) is refused by ``schema_features.one_of_overlap_rule``, which needs the whole schema. Not refused:
unanchored patterns (xgrammar anchors every pattern: a narrowing).
"""

from __future__ import annotations

import math
from typing import Any

from sglang_constrained.schema_features import (
    SchemaRule,
    enum_outside_type_rule,
    keyword_rule,
    keywords_together_rule,
    unknown_format_rule,
    with_siblings_rule,
)

# The string formats xgrammar 0.2.8 enforces; it accepts any string for every other format.
XGRAMMAR_SUPPORTED_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
        "uri", "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip

_OBJECT_INFERRED_FROM = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_INFERRED_FROM = ("items", "prefixItems")
# xgrammar enforces multipleOf on an integer bounded on both sides only when maximum - minimum is below this.
_MULTIPLE_OF_MAX_RANGE = 10_000


def _types(schema: dict[str, Any]) -> list[Any]:
    types = schema.get("type")
    return [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []


def _integer_bound(schema: dict[str, Any], inclusive: str, exclusive: str, sign: int) -> int | None:
    """The tightest integer bound (``sign`` +1 for lower, -1 for upper) the schema puts on an integer."""
    candidates = []
    if isinstance(schema.get(inclusive), int | float):
        candidates.append(sign * math.ceil(sign * schema[inclusive]))
    if isinstance(schema.get(exclusive), int | float):
        candidates.append(sign * (math.floor(sign * schema[exclusive]) + 1))
    if not candidates:
        return None
    return max(candidates) if sign > 0 else min(candidates)


def _is_multiple_of_ignored(schema: dict[str, Any]) -> bool:
    step, types = schema.get("multipleOf"), _types(schema)
    if step is None:
        return False
    if "integer" not in types or "number" in types or not float(step).is_integer():
        return True
    low = _integer_bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _integer_bound(schema, "maximum", "exclusiveMaximum", -1)
    if low is None and high is None:
        return False
    return low is None or high is None or high - low >= _MULTIPLE_OF_MAX_RANGE


def _untyped_rule(keyword: str, inferred_from: tuple[str, ...] = ()) -> SchemaRule:
    """``keyword`` in a schema whose type xgrammar cannot tell: it then allows any value."""
    return SchemaRule(
        f"{keyword} without type",
        lambda s: keyword in s and "type" not in s and not any(k in s for k in inferred_from),
    )


def _has_required_outside_properties(schema: dict[str, Any]) -> bool:
    required, properties = schema.get("required"), schema.get("properties") or {}
    may_be_object = "type" not in schema or "object" in _types(schema)
    return may_be_object and isinstance(required, list) and any(name not in properties for name in required)


def _is_non_pointer_ref(schema: dict[str, Any]) -> bool:
    ref = schema.get("$ref")
    return isinstance(ref, str) and ref != "#" and not ref.startswith("#/")


XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES: tuple[SchemaRule, ...] = (
    enum_outside_type_rule(),  # the enum is kept, the sibling type dropped ("a" passes type: object)
    SchemaRule("multipleOf on a non-integer or widely bounded number", _is_multiple_of_ignored),  # any number
    SchemaRule("uniqueItems", lambda s: s.get("uniqueItems") is True),  # duplicates accepted
    keyword_rule("contains"),  # any items accepted (min/maxContains only qualify contains)
    keyword_rule("if"),  # if/then/else all dropped
    keyword_rule("not"),  # anything accepted
    keyword_rule("dependentRequired"),  # dependent properties not required
    keyword_rule("dependentSchemas"),  # dependent schemas dropped
    keyword_rule("dependencies"),  # (draft 7) dropped
    keyword_rule("patternProperties"),  # matching properties rejected as unknown
    keywords_together_rule("pattern", ("minLength", "maxLength")),  # lengths dropped
    keywords_together_rule("format", ("minLength", "maxLength")),  # lengths dropped
    keywords_together_rule("format", ("pattern",)),  # pattern dropped
    unknown_format_rule(XGRAMMAR_SUPPORTED_FORMATS),  # any string accepted
    SchemaRule("allOf with several subschemas", lambda s: len(s.get("allOf") or ()) > 1),  # not intersected
    with_siblings_rule("allOf"),  # siblings dropped
    with_siblings_rule("anyOf"),  # siblings dropped
    with_siblings_rule("oneOf"),  # siblings dropped
    with_siblings_rule("$ref"),  # siblings dropped
    with_siblings_rule("enum", allowed=("type",)),  # siblings other than type dropped
    with_siblings_rule("const", allowed=("type",)),  # siblings other than type dropped
    SchemaRule("$ref to anything but a local JSON pointer", _is_non_pointer_ref),  # anything accepted
    keyword_rule("$dynamicRef"),  # anything accepted
    keyword_rule("$recursiveRef"),  # (2019-09) anything accepted
    SchemaRule("required property missing from properties", _has_required_outside_properties),  # not required
    _untyped_rule("minimum"),  # without a type xgrammar drops the keyword, and so for the rules below
    _untyped_rule("maximum"),  # any number
    _untyped_rule("exclusiveMinimum"),  # any number
    _untyped_rule("exclusiveMaximum"),  # any number
    _untyped_rule("minLength"),  # any string
    _untyped_rule("maxLength"),  # any string
    _untyped_rule("pattern"),  # any string
    _untyped_rule("format"),  # any string
    _untyped_rule("minItems", _ARRAY_INFERRED_FROM),  # any array, unless items/prefixItems imply the type
    _untyped_rule("maxItems", _ARRAY_INFERRED_FROM),  # any array, likewise
    _untyped_rule("minProperties", _OBJECT_INFERRED_FROM),  # any object, unless properties & co imply the type
    _untyped_rule("maxProperties", _OBJECT_INFERRED_FROM),  # any object, likewise
    _untyped_rule("propertyNames", _OBJECT_INFERRED_FROM),  # any object, likewise
)
