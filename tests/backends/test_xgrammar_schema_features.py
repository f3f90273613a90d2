"""JSON-schema features xgrammar would ignore are refused by name and place; each refusal is warranted (compiled as
is, xgrammar's verdict differs from JSON Schema's), and what it does enforce is accepted and enforced."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import accepts_text, compile_grammar

MULTIPLE_OF = "multipleOf on a non-integer or widely bounded number"
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
DRAFT_07 = {"$schema": "http://json-schema.org/draft-07/schema#"}
# feature, the subschema of property "x", a value of "x" on which xgrammar and JSON Schema disagree, root extras
REFUSED_FEATURES = [
    (MULTIPLE_OF, {"type": "number", "multipleOf": 0.5}, 1.3, {}),
    (MULTIPLE_OF, {"type": "integer", "multipleOf": 3, "minimum": 0}, 8, {}),
    (MULTIPLE_OF, {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10_000}, 8, {}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], {}),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1], {}),
    ("if", {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 4}}, 5, {}),
    ("not", {"type": "integer", "not": {"const": 3}}, 3, {}),
    ("dependentRequired", {**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}, {}),
    ("dependentSchemas", {**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, {}),
    ("dependencies", {**OBJ, "dependencies": {"a": ["b"]}}, {"a": 1}, DRAFT_07),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"x1": 1}, {}),
    (
        "pattern together with minLength/maxLength",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "abcdef",
        {},
    ),
    (
        "format together with minLength/maxLength",
        {"type": "string", "format": "email", "maxLength": 8},
        "abcdefgh@b.co",
        {},
    ),
    ("format together with pattern", {"type": "string", "format": "email", "pattern": "^a"}, "b@c.de", {}),
    ("format", {"type": "string", "format": "regex"}, "(", {}),
    ("allOf with several subschemas", {"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 3}]}, 2, {}),
    (
        "allOf together with other keywords",
        {"type": "integer", "maximum": 9, "allOf": [{"type": "integer", "minimum": 3}]},
        11,
        {},
    ),
    (
        "anyOf together with other keywords",
        {"type": "integer", "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "s",
        {},
    ),
    (
        "oneOf together with other keywords",
        {"type": "integer", "oneOf": [{"type": "integer"}, {"type": "string"}]},
        "s",
        {},
    ),
    ("$ref together with other keywords", {"$ref": "#/$defs/obj", "required": ["a"]}, {}, {"$defs": {"obj": OBJ}}),
    ("enum/const values that the sibling 'type' forbids", {"type": "object", "enum": ["a", {"k": 1}]}, "a", {}),
    ("enum together with other keywords", {"enum": ["a", "bb"], "maxLength": 1}, "bb", {}),
    ("const together with other keywords", {"const": "ab", "maxLength": 1}, "ab", {}),
    (
        "$ref to anything but a local JSON pointer",
        {"$ref": "#int"},
        "s",
        {"$defs": {"i": {"$anchor": "int", "type": "integer"}}},
    ),
    ("$dynamicRef", {"$dynamicRef": "#n"}, "s", {"$defs": {"n": {"$dynamicAnchor": "n", "type": "integer"}}}),
    (
        "$recursiveRef",
        {"$recursiveRef": "#"},
        1,
        {"$schema": "https://json-schema.org/draft/2019-09/schema", "$recursiveAnchor": True},
    ),
    ("required property missing from properties", {**OBJ, "required": ["a", "c"]}, {"a": 1}, {}),
    ("minimum without type", {"minimum": 3}, 2, {}),
    ("maximum without type", {"maximum": 3}, 4, {}),
    ("exclusiveMinimum without type", {"exclusiveMinimum": 3}, 3, {}),
    ("exclusiveMaximum without type", {"exclusiveMaximum": 3}, 3, {}),
    ("minLength without type", {"minLength": 3}, "ab", {}),
    ("maxLength without type", {"maxLength": 1}, "ab", {}),
    ("pattern without type", {"pattern": "^a$"}, "b", {}),
    ("format without type", {"format": "email"}, "b", {}),
    ("minItems without type", {"minItems": 2}, [1], {}),
    ("maxItems without type", {"maxItems": 1}, [1, 2], {}),
    ("minProperties without type", {"minProperties": 1}, {}, {}),
    ("maxProperties without type", {"maxProperties": 0}, {"a": 1}, {}),
    ("propertyNames without type", {"propertyNames": {"maxLength": 1}}, {"bb": 1}, {}),
]
# the subschema of property "x", a valid value, an invalid value, root extras
ENFORCED_FEATURES = [
    ({"type": "integer", "minimum": 3, "maximum": 5}, 4, 6, {}),
    ({"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, 0.5, 1, {}),
    ({"type": "integer", "multipleOf": 3}, 9, 10, {}),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 99}, 99, 98, {}),
    ({"type": ["integer", "null"], "multipleOf": 4}, None, 6, {}),
    ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "abcd", {}),
    ({"type": "string", "pattern": "^[a-z]+$"}, "ab", "a1", {}),
    ({"type": "string", "format": "date"}, "2024-01-02", "2024-1-2", {}),
    ({"type": "string", "format": "email"}, "ada@example.com", "ada", {}),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1], [], {}),
    ({"items": {"type": "integer"}, "minItems": 2}, [1, 2], [1], {}),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1], [1, 2], {}),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, {"a": 1}, {}, {}),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"pattern": "^[a-z]+$"}},
        {"ab": 1},
        {"A": 1},
        {},
    ),
    ({**OBJ, "unevaluatedProperties": {"type": "string"}}, {"a": 1, "c": "x"}, {"a": 1, "c": 2}, {}),
    ({**OBJ, "unevaluatedProperties": True}, {"a": 1, "c": "x"}, {"a": "s"}, {}),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": 1}},
        {"a": 1},
        {"ab": 1},
        {},
    ),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": True}, [1, "s"], ["s"], {}),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}, {}, {}),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Optional"}, None, 1, {}),
    ({"oneOf": [{"type": "string"}, {"type": "null"}]}, "s", 1, {}),
    ({"allOf": [{"type": "integer", "minimum": 3}], "description": "one subschema"}, 3, 2, {}),
    ({"$ref": "#/$defs/i", "description": "a reference"}, 1, "s", {"$defs": {"i": {"type": "integer"}}}),
    ({"enum": ["a", "b"], "type": "string", "title": "Letter"}, "a", "c", {}),
    ({"const": 3, "type": "integer"}, 3, 4, {}),
    ({"type": ["integer", "null"], "minimum": 2}, None, 1, {}),
]


def in_property_x(subschema: Any, root_extras: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": subschema}, "required": ["x"], **root_extras}


def json_schema_says_valid(schema: dict[str, Any], instance: Any) -> bool:
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return validator_class(schema, format_checker=validator_class.FORMAT_CHECKER).is_valid(instance)


def xgrammar_says_valid(backend: XGrammarGrammarBackend, setup: TokenizerSetup, schema: Any, instance: Any) -> bool:
    """xgrammar's own verdict, compiling without our refusals."""
    grammar = XGrammarGrammar(
        backend.backend.compiler.compile_json_schema(json.dumps(schema)), backend.backend.vocabulary.stop_token_ids
    )
    return accepts_text(grammar, setup, json.dumps(instance))


@pytest.fixture(scope="module")
def smollm2_backend(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> XGrammarGrammarBackend:
    return build_backend("xgrammar", smollm2_tokenizer)


def test_every_refusal_rule_has_a_case():
    from sglang_constrained.backends.xgrammar.backend import XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES

    assert {rule.feature for rule in XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES} == {row[0] for row in REFUSED_FEATURES}


@pytest.mark.parametrize(("feature", "subschema", "value", "root_extras"), REFUSED_FEATURES, ids=lambda v: None)
def test_ignored_schema_feature_is_refused_by_name_and_place(
    smollm2_backend, smollm2_tokenizer, feature, subschema, value, root_extras
):
    schema = in_property_x(subschema, root_extras)
    # The refusal is warranted: compiled as is, xgrammar would give another verdict than JSON Schema.
    instance = {"x": value}
    assert xgrammar_says_valid(smollm2_backend, smollm2_tokenizer, schema, instance) != json_schema_says_valid(
        schema, instance
    )
    grammar = smollm2_backend.get_cached_or_future_value(make_grammar_key("json", schema))[0].result()
    assert isinstance(grammar, InvalidGrammarObject)
    assert feature in grammar.error_message and "(at /properties/x)" in grammar.error_message
    assert json.dumps(subschema) not in grammar.error_message and len(grammar.error_message) < 400


@pytest.mark.parametrize(("subschema", "valid", "invalid", "root_extras"), ENFORCED_FEATURES, ids=lambda v: None)
def test_enforced_schema_feature_is_accepted_and_enforced(
    smollm2_backend, smollm2_tokenizer, subschema, valid, invalid, root_extras
):
    schema = in_property_x(subschema, root_extras)
    grammar = smollm2_backend.get_cached_or_future_value(make_grammar_key("json", schema))[0].result()
    assert isinstance(grammar, XGrammarGrammar)
    for value, expected in ((valid, True), (invalid, False)):
        assert json_schema_says_valid(schema, {"x": value}) is expected
        assert accepts_text(grammar, smollm2_tokenizer, json.dumps({"x": value})) is expected


OVERLAPPING_ONE_OF = in_property_x({"oneOf": [{"type": "integer"}, {"type": "number"}]}, {})
DISJOINT_ONE_OFS = [
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
    {
        "oneOf": [
            {"type": "object", "properties": {"k": {"const": "circle"}, "r": {"type": "number"}}, "required": ["k"]},
            {"type": "object", "properties": {"k": {"const": "square"}, "side": {"type": "number"}}, "required": ["k"]},
        ]
    },
]


def test_a_one_of_whose_branches_may_overlap_is_refused(smollm2_backend, smollm2_tokenizer):
    # The refusal is warranted: xgrammar reads it as anyOf and takes 1, valid under both branches.
    assert xgrammar_says_valid(smollm2_backend, smollm2_tokenizer, OVERLAPPING_ONE_OF, {"x": 1})
    assert not json_schema_says_valid(OVERLAPPING_ONE_OF, {"x": 1})
    grammar = compile_grammar(smollm2_backend, "json", OVERLAPPING_ONE_OF)
    assert isinstance(grammar, InvalidGrammarObject)
    assert "'oneOf whose branches may overlap' (at /properties/x)" in grammar.error_message


@pytest.mark.parametrize("subschema", DISJOINT_ONE_OFS)
def test_a_one_of_of_provably_disjoint_branches_compiles(smollm2_backend, subschema):
    assert not isinstance(compile_grammar(smollm2_backend, "json", in_property_x(subschema, {})), InvalidGrammarObject)
