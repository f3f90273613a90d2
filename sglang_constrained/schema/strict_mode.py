"""xgrammar's strict mode (SGLang's default for JSON schemas): where it admits less than a schema allows, and the
schema with that narrowing written out, so that any backend compiles the language strict mode gives.

Strict mode closes an object that lists anything (properties, required, ...) but says nothing of unlisted properties
to the listed ones, and an array with array keywords but no ``items`` to no items (none after ``prefixItems``); an
object or array of a type and annotations alone stays open. Written out, the same closing is
``"additionalProperties": false`` and ``"items": false``, which every exact backend enforces: xgrammar's grammar for
the closed schema admits what strict mode admits for the original (``tests/backends/test_auto_backend.py`` walks
them side by side). JSON Schema's ``additionalProperties`` sees only the properties listed beside it, so the closing
is written out only where no subschema beside a closed object or array may add to it (``closing_is_exact``): an
object of ``{"type": "object", "oneOf": [...]}`` closed at its top would refuse every property its branches list.
"""

from __future__ import annotations

from typing import Any

from sglang_constrained.schema.features import iter_subschemas, schema_types

_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$comment", "$id", "$schema", "deprecated", "readOnly", "writeOnly"}
)
_OBJECT_KEYWORDS = ("properties", "required", "minProperties", "maxProperties", "propertyNames")
_ARRAY_KEYWORDS = ("prefixItems", "minItems", "maxItems")


def _is_plain(schema: dict[str, Any]) -> bool:
    """Only a type and annotations: xgrammar's strict mode leaves such an object or array open."""
    return set(schema) - {"type"} <= _ANNOTATIONS


def _may_be(schema: dict[str, Any], kind: str, keywords: tuple[str, ...]) -> bool:
    types = schema_types(schema)
    return kind in types if "type" in schema else any(keyword in schema for keyword in keywords)


def closes_properties(schema: dict[str, Any]) -> bool:
    """Whether xgrammar's strict mode admits only the listed properties of this object where JSON Schema allows
    any others (measured: ``{"type": "object", "required": []}`` admits only ``{}``)."""
    return (
        _may_be(schema, "object", _OBJECT_KEYWORDS)
        and not _is_plain(schema)
        and "additionalProperties" not in schema
        and "unevaluatedProperties" not in schema
    )


def closes_items(schema: dict[str, Any]) -> bool:
    """Whether xgrammar's strict mode admits no items (or none after ``prefixItems``) where JSON Schema allows any
    (measured: ``{"type": "array", "maxItems": 3}`` admits only ``[]``)."""
    return (
        _may_be(schema, "array", _ARRAY_KEYWORDS)
        and not _is_plain(schema)
        and not isinstance(schema.get("items"), dict | bool)
        and "unevaluatedItems" not in schema
    )


def strict_mode_narrowing(schema: Any, objects: bool = True) -> str | None:
    """The first place where xgrammar's strict mode (SGLang's default) admits less than ``schema`` allows, as
    ``"narrows '<what>' (at <pointer>): <why>"``; None where it admits exactly the schema's instances (property
    order aside, which every backend fixes). ``objects=False`` leaves objects out (``allow_unlisted_properties``
    opens them)."""
    for pointer, subschema in iter_subschemas(schema):
        if objects and closes_properties(subschema):
            return (
                f"narrows 'unlisted properties' (at {pointer or '/'}): xgrammar's strict mode admits only the "
                "properties an object lists, where the schema allows others"
            )
        if closes_items(subschema):
            return (
                f"narrows 'array items' (at {pointer or '/'}): xgrammar's strict mode admits no items the schema "
                "does not describe with 'items', where the schema allows any"
            )
    return None


def allow_unlisted_properties(schema: Any) -> Any:
    """``schema`` (a private copy) with JSON Schema's default written out where xgrammar's strict mode would close
    an object: ``"additionalProperties": true``, which strict mode honours. Changed in place."""
    for _, subschema in iter_subschemas(schema):
        if closes_properties(subschema):
            subschema["additionalProperties"] = True
    return schema


def close_as_strict_mode(schema: Any) -> Any:
    """``schema`` (a private copy) with strict mode's narrowing written out: ``"additionalProperties": false`` where
    it closes an object, ``"items": false`` where it closes an array. Changed in place."""
    for _, subschema in iter_subschemas(schema):
        if closes_properties(subschema):
            subschema["additionalProperties"] = False
        if closes_items(subschema):
            subschema["items"] = False
    return schema


_COMBINING = frozenset({"allOf", "not", "if", "then", "else", "dependentSchemas", "dependentRequired"})
"""Keywords that combine a subschema's constraints with others' (a closed branch of an ``allOf`` refuses the
properties the others list): a schema holding any of them is not closed."""
_BESIDE = ("anyOf", "oneOf", "$ref", "patternProperties")
"""Keywords beside a closed object or array that may list what it holds."""


def closing_is_exact(schema: Any) -> bool:
    """Whether ``close_as_strict_mode`` writes strict mode's closing out as JSON Schema means it: no subschema
    combines with another, and every object or array it closes lists all it holds (each property it requires, no
    properties or items from a subschema beside it)."""
    for _, subschema in iter_subschemas(schema):
        if _COMBINING & subschema.keys():
            return False
        closes_object, closes_array = closes_properties(subschema), closes_items(subschema)
        if (closes_object or closes_array) and any(keyword in subschema for keyword in _BESIDE):
            return False
        listed = subschema.get("properties", {})
        if closes_object and not (isinstance(listed, dict) and set(subschema.get("required", [])) <= listed.keys()):
            return False
    return True
