"""JSON-schema features llguidance would ignore are refused; those it enforces are compiled and enforced; malformed
constraints of every kind get a clear, bounded message."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher

from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import PERSON_SCHEMA as OPEN_PERSON_SCHEMA
from tests.helpers import compile_grammar, compile_valid

PERSON_SCHEMA = {**OPEN_PERSON_SCHEMA, "additionalProperties": False}
ONE_TAG = {"structures": [{"begin": "<function=get_weather>", "schema": {"type": "object"}, "end": "</function>"}]}


@pytest.fixture(scope="module")
def backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> GuidanceBackend:
    return build_backend("llguidance", tokenizer_case)


LONG_DESCRIPTION = "a field described at great length " * 20
IGNORED_FEATURES = [
    ({"type": "string", "contentEncoding": "base64"}, '"!!!"', "contentEncoding"),
    ({"type": "string", "contentMediaType": "application/json"}, '"not json"', "contentMediaType"),
]


@pytest.mark.parametrize(("schema", "violating", "feature"), IGNORED_FEATURES)
def test_the_refusal_table_lists_what_llguidance_ignores(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, schema, violating, feature
) -> None:
    raw = LLMatcher(backend.backend.ll_tokenizer, LLMatcher.grammar_from_json_schema(schema), log_level=0)
    assert raw.consume_tokens(tokenizer_case.encode(violating)) and raw.is_accepting()
    nested = {"type": "object", "properties": {"x": {**schema, "description": LONG_DESCRIPTION}}}
    refused = compile_grammar(backend, "json", nested)
    assert isinstance(refused, InvalidGrammarObject)
    assert f"'{feature}'" in refused.error_message and "/properties/x" in refused.error_message
    assert LONG_DESCRIPTION not in refused.error_message


ENFORCED_FEATURES = [
    ({"type": "integer", "multipleOf": 3}, "9", "4"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aa"', '"aaa"'),
    ({"type": "string", "format": "email", "maxLength": 6}, '"a@b.co"', '"ab@cd.com"'),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, '{"xa": 1}', '{"xa": "s"}'),
    ({"type": "object", "minProperties": 2}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ({"type": "object", "maxProperties": 1}, '{"a": 1}', '{"a": 1, "b": 2}'),
]


@pytest.mark.parametrize(("schema", "valid", "violating"), ENFORCED_FEATURES)
def test_features_llguidance_enforces_are_compiled_and_enforced(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, schema, valid, violating
) -> None:
    case = tokenizer_case
    grammar = compile_valid(backend, "json", schema)
    assert walk_tokens(grammar.copy(), case.encode(valid), case.vocab_size, case.eos_token_ids).is_accepted
    assert not walk_tokens(grammar, case.encode(violating), case.vocab_size, case.eos_token_ids).is_accepted


MALFORMED = [
    ("json", {"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
    ("json", {"type": "array", "contains": {"const": 1}}, 'Unimplemented keys: ["contains"]'),
    ("json", {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '"if", "then"'),
    ("json", {"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),
    ("json", {"type": "object", "dependentRequired": {"a": ["b"]}}, 'Unimplemented keys: ["dependentRequired"]'),
    ("json", {"type": "object", "propertyNames": {"maxLength": 3}}, 'Unimplemented keys: ["propertyNames"]'),
    ("json", {"type": "object", "unevaluatedProperties": False}, 'Unimplemented keys: ["unevaluatedProperties"]'),
    ("json", {"type": "string", "format": "no-such-format"}, "Unknown format: no-such-format"),
    ("json", {"type": "string", "pattern": "(?=a)b"}, "look-around"),
    (
        "json",
        {"x-guidance": {"lenient": True}, "type": "array", "uniqueItems": True},
        'Unimplemented keys: ["uniqueItems"]',
    ),
    ("json", "{not json", "not valid JSON"),
    ("regex", "a(b", "unclosed group"),
    ("ebnf", 'root ::= ("a"', "cannot convert the GBNF grammar"),
    ("ebnf", 'item ::= "a"', "No 'root' rule"),
    ("ebnf", 'answer: "yes"', "no start rule found"),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "token", "token": 5}},
        "cannot compile the structural tag's format 'token' (at /format)",
    ),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "sequence", "elements": [{"type": "any_text"}, {"value": "a"}]}},
        "invalid structural tag at /format/elements/1: a format is an object with a 'type'",
    ),
    ("structural_tag", {"structures": [], "triggers": ["<f"]}, "non-empty 'structures'"),
    ("structural_tag", {**ONE_TAG, "triggers": ["<tool"]}, "structures[0]: its begin"),
    ("structural_tag", {**ONE_TAG, "triggers": []}, "non-empty 'triggers'"),
    ("structural_tag", {"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]}, "JSON object"),
    (
        "structural_tag",
        {"structures": [{"begin": "<f>", "schema": {"contentSchema": {}}, "end": ""}], "triggers": ["<f"]},
        "structures[0]: the llguidance grammar backend does not support the JSON schema feature 'contentSchema'",
    ),
]


@pytest.mark.parametrize(("kind", "spec", "expected"), MALFORMED)
def test_malformed_input_gives_a_clear_bounded_message(backend: GuidanceBackend, kind, spec, expected) -> None:
    if isinstance(spec, dict) and kind == "json":
        spec = {**spec, "description": LONG_DESCRIPTION}
    grammar = compile_grammar(backend, kind, spec)
    assert isinstance(grammar, InvalidGrammarObject)
    assert expected in grammar.error_message
    assert len(grammar.error_message) < 400 and LONG_DESCRIPTION not in grammar.error_message
