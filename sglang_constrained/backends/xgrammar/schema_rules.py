"""The JSON-schema features xgrammar 0.2.8 compiles but does not enforce, refused up front with their names; where
its strict mode narrows a schema; and what a schema's length bounds predict its compile costs.

Each rule was measured against the engine (the xgrammar tests re-check each against jsonschema): an instance that
breaks only that feature passes xgrammar's grammar. A ``oneOf`` whose branches may overlap (xgrammar falls back to
``anyOf``) is refused by ``schema_features.one_of_overlap_rule``, which needs the whole schema. Not refused:
unanchored patterns (xgrammar anchors every pattern: a narrowing).
"""

from __future__ import annotations

import math
import re
from typing import Any

from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.features import (
    SchemaRule,
    enum_outside_type_rule,
    iter_subschemas,
    keyword_rule,
    keywords_together_rule,
    schema_types,
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
    step, types = schema.get("multipleOf"), schema_types(schema)
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
    may_be_object = "type" not in schema or "object" in schema_types(schema)
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


_REPETITION = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
SMALL_REPETITION_BELOW = 128
"""xgrammar unrolls a repetition bound below this into states (cost grows with the bound and the vocabulary),
compiles larger ones another way (cost grows with the bound's square), and from ``LARGE_REPETITION_FROM`` on yet
another (a few seconds, whatever the bound)."""
LARGE_REPETITION_FROM = 10_000
SECONDS_PER_SMALL_REPETITION = 0.005
"""Per repeated character at 49,152 tokens, measured on 2 cores (AMD EPYC): ``[^"]{0,100}`` 0.56 s (6.8 s at 248k)."""
SECONDS_PER_THOUSAND_SQUARED = 0.3
"""Per (bound / 1,000)² at 49,152 tokens, measured alike: ``{0,1000}`` 0.31 s, ``{0,5000}`` 8.5 s (40 s at 248k),
``{0,8000}`` 145 s on a busy machine, ``{0,9000}`` over 60 s."""
SECONDS_PER_LARGE_REPETITION = 1.0
"""At 49,152 tokens, measured alike: ``{0,10000}`` 4.9 s, ``{0,32767}`` 5.9 s, ``{0,131072}`` 4.9 s (busy)."""
SECONDS_PER_THOUSAND_PROPERTIES_CUBED = 0.01
"""Per (properties of one object / 1,000)³ at 49,152 tokens, measured alike: 1,000 integer properties 0.09 s,
5,000 1.35 s; 10,000 74 s and 20,000 428 s on a busy machine."""
COST_VOCABULARY = 49_152
"""The vocabulary the costs above were measured at; they scale with the vocabulary's size (the measured growth to
248k was 2.7-12x: scaling by 5x keeps the prediction at or below what was measured)."""
_NAMED_OBJECT_FROM = 1_000
"""Objects this large are named in a refusal; smaller ones add next to nothing."""


def predicted_compile_seconds(patterns: list[str], object_sizes: list[int], vocab_size: int) -> float:
    """What xgrammar's compile is predicted to cost at ``vocab_size`` tokens for ``patterns``' bounded repetitions
    (length-bounded strings are written as such) and objects of ``object_sizes`` properties. A low estimate: it
    leaves out everything else a grammar costs."""
    seconds = 0.0
    for bound in _repetition_bounds(patterns):
        if bound < SMALL_REPETITION_BELOW:
            seconds += SECONDS_PER_SMALL_REPETITION * bound
        elif bound < LARGE_REPETITION_FROM:
            seconds += SECONDS_PER_THOUSAND_SQUARED * (bound / 1000) ** 2
        else:
            seconds += SECONDS_PER_LARGE_REPETITION
    seconds += sum(SECONDS_PER_THOUSAND_PROPERTIES_CUBED * (size / 1000) ** 3 for size in object_sizes)
    return seconds * vocab_size / COST_VOCABULARY


def refuse_predicted_beyond_deadline(
    patterns: list[str], object_sizes: list[int], vocab_size: int, deadline_s: float, what: str
) -> None:
    """Raise ``GrammarSpecError`` when the bounded repetitions of ``patterns`` and the objects' sizes alone predict a
    compile beyond ``deadline_s``, naming the measures and the bound, before any compile time is spent."""
    seconds = predicted_compile_seconds(patterns, object_sizes, vocab_size)
    if seconds <= deadline_s:
        return
    bounds = _repetition_bounds(patterns)
    measures = []
    if bounds:
        measures.append(f"{len(bounds)} length bound{'s' * (len(bounds) > 1)} (up to {max(bounds):,} characters)")
    if max(object_sizes, default=0) >= _NAMED_OBJECT_FROM:
        measures.append(f"an object of {max(object_sizes):,} properties")
    raise GrammarSpecError(
        f"the {what} has {' and '.join(measures)}, which predict an xgrammar compile of about {seconds:.0f} s at this "
        f"vocabulary of {vocab_size:,} tokens, beyond the compile deadline of {deadline_s:g} s "
        "(--grammar-compile-timeout); llguidance compiles such schemas in milliseconds (--grammar-backend "
        "llguidance or auto)"
    )


def _repetition_bounds(patterns: list[str]) -> list[int]:
    return [int(high) if high else int(low) for pattern in patterns for low, high in _REPETITION.findall(pattern)]


def schema_patterns(schema: Any) -> list[str]:
    """Every ``pattern`` of ``schema``'s subschemas."""
    return [s["pattern"] for _, s in iter_subschemas(schema) if isinstance(s.get("pattern"), str)]


def schema_object_sizes(schema: Any) -> list[int]:
    """How many properties each object of ``schema`` lists."""
    return [len(s["properties"]) for _, s in iter_subschemas(schema) if isinstance(s.get("properties"), dict)]
