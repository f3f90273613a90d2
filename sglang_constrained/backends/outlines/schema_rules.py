"""The JSON-schema features outlines-core 0.2.14 ignores or cannot compile in time, refused up front by name.

For each rule of the table, an instance violating only that feature passes outlines-core's regex (the outlines
tests check this against the engine). Beyond the table: string length bounds past a size whose automaton takes
minutes to build, values of any JSON type below the root (seconds to minutes each), and recursive references.
"""

from __future__ import annotations

from typing import Any

from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.features import (
    SchemaRule,
    enum_outside_type_rule,
    iter_subschemas,
    keyword_rule,
    keywords_together_rule,
    one_of_overlap_rule,
    refuse_unsupported_features,
    resolve_local_ref,
    schema_types,
    unknown_format_rule,
    with_siblings_rule,
)

OUTLINES_MAX_STRING_LENGTH_BOUND = 12
# outlines-core's own "uuid" is exact; the others listed become patterns of ours (json_string_formats) before it
# sees them. Left out: its own "uri" (it pastes raw quotes and control characters into the JSON text) and
# "hostname" (our pattern's bounded labels make an automaton too large to build in time).
OUTLINES_STRING_FORMATS = frozenset(
    {"uuid", "date", "time", "date-time", "ipv4", "email", "json-pointer", "relative-json-pointer"}
)

_COMPOSITION_KEYWORDS = ("allOf", "anyOf", "oneOf", "$ref", "enum", "const")
_OBJECT_KEYWORDS = ("properties", "additionalProperties", "required", "minProperties", "maxProperties")


def _has_name_needing_escapes(schema: dict[str, Any]) -> bool:
    names = schema.get("properties")
    return isinstance(names, dict) and any(any(char in '"\\' or ord(char) < 0x20 for char in name) for name in names)


OUTLINES_UNSUPPORTED_SCHEMA_FEATURES: tuple[SchemaRule, ...] = (
    SchemaRule("property names with a quote, backslash or control character", _has_name_needing_escapes),  # pasted raw
    enum_outside_type_rule(),  # the enum is kept, the sibling type dropped ("a" passes type: object)
    SchemaRule("an empty enum", lambda schema: schema.get("enum") == []),  # compiles to the empty string, not JSON
    *(keyword_rule(k) for k in ("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
    SchemaRule("uniqueItems", lambda schema: schema.get("uniqueItems") is True),
    *(keyword_rule(k) for k in ("contains", "if", "not", "dependentRequired", "dependentSchemas", "dependencies")),
    *(keyword_rule(k) for k in ("patternProperties", "propertyNames", "maxProperties")),
    SchemaRule(
        "minProperties together with properties, or above 1",
        lambda schema: "minProperties" in schema and ("properties" in schema or schema["minProperties"] > 1),
    ),
    SchemaRule(
        "unevaluatedProperties without properties or additionalProperties",
        lambda schema: (
            "unevaluatedProperties" in schema and "properties" not in schema and "additionalProperties" not in schema
        ),
    ),
    SchemaRule(
        "unevaluatedItems without items or prefixItems",
        lambda schema: "unevaluatedItems" in schema and "items" not in schema and "prefixItems" not in schema,
    ),
    keywords_together_rule("pattern", ("minLength", "maxLength")),
    keywords_together_rule("format", ("minLength", "maxLength", "pattern")),
    unknown_format_rule(OUTLINES_STRING_FORMATS),
    SchemaRule(
        "allOf with more than one subschema",
        lambda schema: isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1,
    ),
    SchemaRule(
        "required naming a property that properties does not define",
        lambda schema: (
            isinstance(schema.get("required"), list)
            and any(name not in schema.get("properties", {}) for name in schema["required"])
        ),
    ),
    keywords_together_rule("properties", _COMPOSITION_KEYWORDS),
    *(with_siblings_rule(keyword) for keyword in ("allOf", "anyOf", "oneOf")),  # siblings dropped
    SchemaRule(
        "object keywords on an array",  # the array becomes an object: only {} matches
        lambda schema: schema_types(schema) == ["array"] and any(k in schema for k in _OBJECT_KEYWORDS),
    ),
    keywords_together_rule("prefixItems", ("minItems", "maxItems")),
)
"""Schema features outlines-core 0.2.14 silently ignores: for each, an instance violating only that feature
passes its regex (the tests check this against the engine)."""


def recursive_ref_rule(root: Any) -> SchemaRule:
    """A ``$ref`` that leads back to itself; outlines-core unrolls it three levels and then emits broken JSON."""
    return SchemaRule("recursive $ref", lambda schema: _is_recursive_ref(root, schema.get("$ref")))


def refuse_outlines_unsupported(schema: Any, backend_name: str) -> None:
    """Raise ``GrammarSpecError`` naming the first feature of ``schema`` outlines-core cannot enforce."""
    rules = (*OUTLINES_UNSUPPORTED_SCHEMA_FEATURES, recursive_ref_rule(schema), one_of_overlap_rule(schema))
    refuse_unsupported_features(schema, rules, backend_name)
    _refuse_long_string_bounds(schema)
    _refuse_nested_unconstrained_values(schema)


def _is_recursive_ref(root: Any, ref: Any) -> bool:
    """Whether following the local reference ``ref`` through the schema ``root`` can reach ``ref`` again."""
    if not isinstance(ref, str):
        return False
    pending, seen = [ref], {ref}
    while pending:
        target = resolve_local_ref(root, pending.pop())
        for _, subschema in iter_subschemas(target):
            inner = subschema.get("$ref")
            if inner == ref:
                return True
            if isinstance(inner, str) and inner not in seen:
                seen.add(inner)
                pending.append(inner)
    return False


def _refuse_long_string_bounds(schema: Any) -> None:
    for pointer, subschema in iter_subschemas(schema):
        for keyword in ("minLength", "maxLength"):
            bound = subschema.get(keyword)
            if isinstance(bound, int) and bound > OUTLINES_MAX_STRING_LENGTH_BOUND:
                raise GrammarSpecError(
                    f"the outlines grammar backend refuses '{keyword}': {bound} (at {pointer or '/'}): "
                    f"outlines-core's automaton doubles with every character of a string length bound, so "
                    f"bounds above {OUTLINES_MAX_STRING_LENGTH_BOUND} take from seconds to hours to compile; "
                    f"use the xgrammar or llguidance backend"
                )


def _refuse_nested_unconstrained_values(schema: Any) -> None:
    """Refuse values of any JSON type below the root: each takes outlines-core seconds to minutes to compile.

    Several such values in one object take minutes (docs/benchmarks.md). The root may be one (that is
    ``json_object``), which the compile deadline bounds.
    """
    for pointer, subschema in iter_subschemas(schema):
        if pointer and _is_unconstrained_value(subschema):
            raise GrammarSpecError(
                f"the outlines grammar backend refuses a value of any JSON type (at {pointer}): outlines-core "
                f"takes from seconds to minutes to compile each one; give it a type with a shape (properties, "
                f"items) or use the xgrammar or llguidance backend"
            )


def _is_unconstrained_value(schema: dict[str, Any]) -> bool:
    """Any JSON value, any object or any array: nothing narrows what the value may contain."""
    types = schema.get("type")
    if types is None:
        return set(schema) <= _ANNOTATION_KEYWORDS
    type_list = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if any(key in schema for key in ("enum", "const", "$ref", "anyOf", "oneOf", "allOf")):
        return False
    open_object = (
        "object" in type_list and "properties" not in schema and not _is_schema(schema.get("additionalProperties"))
    )
    open_array = "array" in type_list and not _is_schema(schema.get("items")) and "prefixItems" not in schema
    return open_object or open_array


_ANNOTATION_KEYWORDS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$id",
        "id",
        "$schema",
        "readOnly",
        "readonly",
        "writeOnly",
        "deprecated",
    }
)


def _is_schema(value: Any) -> bool:
    """A subschema that constrains something (not absent, ``true`` or ``{}``)."""
    return (isinstance(value, dict) and bool(value)) or value is False


def outlines_narrowing(schema: Any) -> str | None:
    """The first place where outlines-core's regex admits less than ``schema`` allows (measured: it closes every
    object to its listed properties, even with ``additionalProperties``; admits no items after ``prefixItems``;
    and a number at the top level takes no fraction or exponent), or None."""
    for pointer, subschema in iter_subschemas(schema):
        if "properties" in subschema and subschema.get("additionalProperties") is not False:
            return (
                f"narrows 'unlisted properties' (at {pointer or '/'}): outlines-core admits only the properties an "
                "object lists, whatever additionalProperties says"
            )
        if "prefixItems" in subschema and subschema.get("items") is not False:
            return (
                f"narrows 'items after prefixItems' (at {pointer or '/'}): outlines-core admits no items beyond "
                "prefixItems"
            )
    if _may_be_number(schema, schema, depth=0):
        return (
            "narrows 'a number at the top level' (at /): outlines-core ends the match after its integer part, so a "
            "fraction or an exponent cannot follow"
        )
    return None


def _may_be_number(root: Any, schema: Any, depth: int) -> bool:
    """Whether ``schema`` (at the top level, through references and composition) admits a non-integer number."""
    if not isinstance(schema, dict) or depth > 8:
        return False
    if "enum" in schema or "const" in schema:
        return False
    if isinstance(schema.get("$ref"), str):
        return _may_be_number(root, resolve_local_ref(root, schema["$ref"]), depth + 1)
    branches = [b for keyword in ("anyOf", "oneOf") for b in schema.get(keyword) or ()]
    if branches:
        return any(_may_be_number(root, branch, depth + 1) for branch in branches)
    return "number" in schema_types(schema) if "type" in schema else set(schema) <= _ANNOTATION_KEYWORDS
