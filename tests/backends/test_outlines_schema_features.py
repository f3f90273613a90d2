"""JSON-schema features outlines-core would ignore are refused by name and place, and each refusal is warranted:
outlines-core's own regex lets an instance that violates the feature through."""

from __future__ import annotations

import json

import outlines_core
import pytest
from outlines_core.json_schema import build_regex_from_schema

from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import compile_grammar


@pytest.fixture(scope="module")
def smollm2_backend(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> OutlinesGrammarBackend:
    return build_backend("outlines", smollm2_tokenizer)


INT = {"type": "integer"}
PAIR = {"a": INT, "b": INT}
LINKED_LIST = {
    "type": "object",
    "properties": {"v": INT, "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
    "required": ["v", "next"],
}
YES_NO = {"type": "string", "enum": ["yes", "no"]}
REFUSED_FEATURES = [
    ("'allOf together with other keywords'", {"allOf": [YES_NO], "enum": ["yes"]}, "/", '"no"'),
    ("'anyOf together with other keywords'", {"anyOf": [YES_NO], "enum": ["yes"]}, "/", '"no"'),
    ("'oneOf together with other keywords'", {"oneOf": [YES_NO], "enum": ["yes"]}, "/", '"no"'),
    ("'object keywords on an array'", {"type": "array", "items": INT, "properties": {}}, "/", "{}"),
    ("'oneOf whose branches may overlap'", {"oneOf": [INT, {"type": "number"}]}, "/", "1"),
    ("'multipleOf'", {"type": "array", "items": {**INT, "multipleOf": 3}}, "/items", "[4]"),
    ("'minimum'", {"type": "object", "properties": {"n": {**INT, "minimum": 5}}}, "/properties/n", '{"n":1}'),
    ("'maximum'", {"type": "array", "items": {"type": "number", "maximum": 5}}, "/items", "[9]"),
    ("'exclusiveMinimum'", {"type": "array", "items": {**INT, "exclusiveMinimum": 5}}, "/items", "[5]"),
    ("'exclusiveMaximum'", {"type": "array", "items": {**INT, "exclusiveMaximum": 5}}, "/items", "[5]"),
    ("'uniqueItems'", {"type": "array", "items": INT, "uniqueItems": True}, "/", "[1,1]"),
    ("'an empty enum'", {"enum": []}, "/", ""),  # compiles to the empty string, which is no JSON
    ("'contains'", {"type": "array", "items": INT, "contains": {"const": 5}}, "/", "[1]"),
    ("'if'", {"type": "array", "items": {"type": "string", "if": {"const": "a"}, "then": False}}, "/items", '["a"]'),
    ("'not'", {"type": "array", "items": {**INT, "not": {"const": 1}}}, "/items", "[1]"),
    ("'dependentRequired'", {"properties": PAIR, "dependentRequired": {"a": ["b"]}}, "/", '{"a":1}'),
    ("'dependentSchemas'", {"properties": PAIR, "dependentSchemas": {"a": {"required": ["b"]}}}, "/", '{"a":1}'),
    ("'dependencies'", {"properties": PAIR, "dependencies": {"a": ["b"]}}, "/", '{"a":1}'),
    (
        "'patternProperties'",
        {"type": "object", "additionalProperties": INT, "patternProperties": {"^a": {"type": "string"}}},
        "/",
        '{"ab":1}',
    ),
    (
        "'propertyNames'",
        {"type": "object", "additionalProperties": INT, "propertyNames": {"maxLength": 1}},
        "/",
        '{"ab":1}',
    ),
    ("'maxProperties'", {"type": "object", "additionalProperties": INT, "maxProperties": 1}, "/", '{"a":1,"b":2}'),
    ("'minProperties together with properties, or above 1'", {"properties": PAIR, "minProperties": 1}, "/", "{}"),
    (
        "'minProperties together with properties, or above 1'",
        {"type": "object", "additionalProperties": INT, "minProperties": 2},
        "/",
        '{"a":1}',
    ),
    # Checking these two against the engine needs the unconstrained-object regex, which takes ~10 s to build.
    (
        "'unevaluatedProperties without properties or additionalProperties'",
        {"type": "object", "unevaluatedProperties": False},
        "/",
        None,
    ),
    ("'unevaluatedItems without items or prefixItems'", {"type": "array", "unevaluatedItems": False}, "/", None),
    (
        "'pattern together with minLength/maxLength'",
        {"type": "array", "items": {"type": "string", "pattern": "^a+$", "maxLength": 5}},
        "/items",
        '["b"]',
    ),
    (
        "'format together with minLength/maxLength/pattern'",
        {"type": "array", "items": {"type": "string", "format": "date", "maxLength": 10}},
        "/items",
        '["hello"]',
    ),
    ("'format': 'int32'", {"type": "array", "items": {**INT, "format": "int32"}}, "/items", "[99999999999]"),
    (
        "'allOf with more than one subschema'",
        {"allOf": [{"properties": {"a": INT}, "required": ["a"]}, {"properties": {"b": INT}, "required": ["b"]}]},
        "/",
        '{"a":1}{"b":2}',
    ),
    (
        "'required naming a property that properties does not define'",
        {"anyOf": [{"properties": PAIR}], "required": ["a"]},
        "/",
        "{}",
    ),
    (
        "'properties together with allOf/anyOf/oneOf/$ref/enum/const'",
        {"properties": PAIR, "anyOf": [{"properties": {"a": INT}, "required": ["a"]}]},
        "/",
        "{}",
    ),
    (
        "'prefixItems together with minItems/maxItems'",
        {"type": "array", "prefixItems": [INT, INT], "maxItems": 1},
        "/",
        "[1,2]",
    ),
    (
        "'recursive $ref'",
        {"properties": {"list": {"$ref": "#/$defs/node"}}, "required": ["list"], "$defs": {"node": LINKED_LIST}},
        "/properties/list",
        '{"list":{"v":1,"next":{"v":1,"next":{"v":1,"next":{"v":1,}}}}}',
    ),
    (
        "'maxLength': 13",
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 13}}},
        "/properties/s",
        None,
    ),
]


@pytest.mark.parametrize(("feature", "schema", "pointer", "violating_instance"), REFUSED_FEATURES)
def test_schema_features_outlines_core_would_ignore_are_refused(
    smollm2_backend, feature, schema, pointer, violating_instance
):
    grammar = compile_grammar(smollm2_backend, "json", schema)
    assert isinstance(grammar, InvalidGrammarObject)
    message = grammar.error_message
    assert feature in message and f"(at {pointer})" in message and "outlines" in message
    assert json.dumps(schema) not in message and json.dumps(schema, separators=(",", ":")) not in message


BYTE_VOCABULARY = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


@pytest.mark.parametrize(
    ("feature", "schema", "violating_instance"),
    [(feature, schema, instance) for feature, schema, _, instance in REFUSED_FEATURES if instance is not None],
)
def test_outlines_core_really_ignores_each_refused_feature(feature, schema, violating_instance):
    """Why each refusal exists: outlines-core's own regex lets an instance violating the feature through."""
    index = outlines_core.Index(build_regex_from_schema(json.dumps(schema), ""), BYTE_VOCABULARY)
    state: int | None = index.get_initial_state()
    for byte in violating_instance.encode():
        state = index.get_next_state(state, byte)
        assert state is not None, f"outlines-core now honours {feature}: drop its refusal"
    assert index.is_final_state(state), f"outlines-core now honours {feature}: drop its refusal"
