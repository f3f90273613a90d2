"""Constraint keys and the checks every backend shares: canonical keys, choice lowering, clear spec errors."""

from __future__ import annotations

import json
import re
from unittest import mock

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_constrained import constraint_spec
from sglang_constrained.constraint_spec import (
    MAX_OBJECTS_FOR_BEST_ERROR,
    GrammarSpecError,
    check_schema_is_valid,
    choices_to_regex,
    escape_regex_literal,
    lower_constraint,
    make_grammar_key,
)
from sglang_constrained.schema.features import iter_subschemas


def _no_feature_check(schema: object) -> None:
    return None


def test_json_keys_ignore_spacing_but_keep_property_order() -> None:
    spaced = make_grammar_key("json", '{ "type": "object",\n  "properties": {"b": {}, "a": {}} }')
    as_dict = make_grammar_key("json", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert spaced == as_dict == ("json", '{"type":"object","properties":{"b":{},"a":{}}}')
    reordered = make_grammar_key("json", {"type": "object", "properties": {"a": {}, "b": {}}})
    assert reordered != as_dict  # property order is output order


def test_json_key_of_invalid_text_is_kept_for_the_compile_error() -> None:
    assert make_grammar_key("json", "INVALID") == ("json", "INVALID")


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("unknown", "x", "unknown constraint kind"),
        ("choice", "not a list", "list of strings"),
        ("choice", ["ok", 3], "list of strings"),
        ("regex", {"a": 1}, "is a string"),
    ],
)
def test_make_grammar_key_refuses_malformed_specs(kind: str, spec: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_grammar_key(kind, spec)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (("json", "INVALID"), "the JSON schema is not valid JSON: Expecting value at line 1 column 1"),
        (("json", '{"type": "strin"}'), "invalid JSON schema at /type"),
        (("json", '{"properties": {"a": {"minLength": -1}}}'), "at /properties/a/minLength"),
        (("json", "[1, 2]"), "must be an object or a boolean, not an array"),
        (("regex", "   "), "the regex spec is empty"),
        (("ebnf", ""), "the ebnf spec is empty"),
        (("structural_tag", "[]"), "a structural tag must be a JSON object"),
        (("choice", "[]"), "non-empty list of strings"),
    ],
)
def test_bad_specs_get_a_specific_message(key: tuple[str, str], message: str) -> None:
    with pytest.raises(GrammarSpecError, match=re.escape(message)):
        lower_constraint(key, 10_000, _no_feature_check)


def test_oversized_spec_is_refused_without_echoing_it() -> None:
    schema = json.dumps({"type": "object", "description": "x" * 5000})
    with pytest.raises(GrammarSpecError) as error:
        lower_constraint(("json", schema), 4096, _no_feature_check)
    assert "over the limit of 4,096 bytes" in str(error.value)
    assert "xxxxxxxxxx" not in str(error.value)


def test_meta_schema_error_does_not_echo_the_schema() -> None:
    schema = {"type": "object", "description": "secret-" * 200, "properties": {"a": {"type": "strin"}}}
    with pytest.raises(GrammarSpecError) as error:
        lower_constraint(make_grammar_key("json", schema), 100_000, _no_feature_check)
    assert "/properties/a/type" in str(error.value)
    assert "secret" not in str(error.value) and len(str(error.value)) < 200


DRAFTS = {
    None: jsonschema.Draft202012Validator,
    "http://json-schema.org/draft-04/schema#": jsonschema.Draft4Validator,
    "http://json-schema.org/draft-07/schema#": jsonschema.Draft7Validator,
    "https://json-schema.org/draft/2019-09/schema": jsonschema.Draft201909Validator,
}
KEYWORD_VALUES = st.deferred(
    lambda: st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-3, max_value=2**70),
        st.floats(min_value=-2, max_value=4, allow_nan=False),
        st.sampled_from(["string", "strin", "integer", "object", "array", "null", "#/$defs/a", "^a+$", "uri"]),
        st.lists(st.one_of(st.sampled_from(["a", "b", "string", "number"]), SCHEMAS), max_size=3),
        st.dictionaries(st.sampled_from(["a", "b", "c"]), SCHEMAS, max_size=3),
        SCHEMAS,
    )
)
SCHEMAS = st.deferred(
    lambda: st.one_of(
        st.booleans(),
        st.dictionaries(
            st.sampled_from(
                ["type", "properties", "required", "items", "prefixItems", "additionalProperties", "minLength",
                 "maxItems", "enum", "const", "anyOf", "allOf", "oneOf", "not", "$defs", "definitions", "$ref",
                 "pattern", "format", "minimum", "exclusiveMinimum", "multipleOf", "dependentRequired",
                 "dependencies", "uniqueItems", "$id", "id", "title", "unevaluatedProperties", "contains"]
            ),
            KEYWORD_VALUES,
            max_size=4,
        ),
    )
)  # fmt: skip


@given(SCHEMAS, st.sampled_from(sorted(DRAFTS, key=str)), st.booleans())
def test_a_schema_is_refused_exactly_when_jsonschema_finds_it_breaks_the_meta_schema(
    schema: object, draft: str | None, large: bool
) -> None:
    """The check takes jsonschema-rs's word for a valid schema, and for an invalid one of many objects (``large``:
    as if the schema were over the size where jsonschema-rs names the error); it must refuse exactly what jsonschema
    refuses (jsonschema-rs checking formats refused a draft-07 ``$id`` jsonschema takes)."""
    validator_class = DRAFTS[None]
    if isinstance(schema, dict) and draft is not None:
        schema = {"$schema": draft, **schema}
        validator_class = DRAFTS[draft]
    refused_by_jsonschema = not validator_class(validator_class.META_SCHEMA).is_valid(schema)
    with mock.patch.object(constraint_spec, "MAX_OBJECTS_FOR_BEST_ERROR", 0 if large else MAX_OBJECTS_FOR_BEST_ERROR):
        try:
            check_schema_is_valid(schema)
        except GrammarSpecError as error:
            assert refused_by_jsonschema
            assert str(error).startswith("invalid JSON schema at /")
        else:
            assert not refused_by_jsonschema


def test_a_schema_with_many_properties_is_checked_and_its_error_named() -> None:
    """A 20,000-property schema (xgrammar's refusal and llguidance's compile wait on this check: jsonschema alone
    took 7-10 s of it, jsonschema-rs ~10 ms), and one with a bad type, named by jsonschema-rs past
    ``MAX_OBJECTS_FOR_BEST_ERROR`` (jsonschema's choice of the error took ~8 s; docs/benchmarks.md)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}}
    check_schema_is_valid(schema)
    schema["properties"]["p19999"] = {"type": "strin"}
    with pytest.raises(GrammarSpecError, match=r"^invalid JSON schema at /properties/p19999/type: .* 'anyOf' rule$"):
        check_schema_is_valid(schema)


@pytest.mark.parametrize("value", [5, None, ["http://json-schema.org/draft-07/schema#"]])
def test_a_schema_keyword_that_is_not_a_string_is_refused_by_name(value: object) -> None:
    with pytest.raises(GrammarSpecError, match=re.escape("invalid JSON schema at /$schema")):
        lower_constraint(make_grammar_key("json", {"$schema": value, "type": "string"}), 1000, _no_feature_check)


def test_backend_feature_check_runs_on_the_parsed_schema() -> None:
    seen: list[object] = []
    lower_constraint(("json", '{"type": "integer"}'), 1000, seen.append)
    assert seen == [{"type": "integer"}]


def test_choice_and_json_object_are_lowered() -> None:
    assert lower_constraint(make_grammar_key("choice", ["a.b", "c"]), 1000, _no_feature_check) == (
        "regex",
        r"(a\.b)|(c)",
    )
    assert lower_constraint(make_grammar_key("json_object", None), 1000, _no_feature_check) == (
        "json",
        '{"type":"object"}',
    )


@given(st.lists(st.text(max_size=12), min_size=1, max_size=6))
def test_choice_regex_matches_exactly_the_choices(choices: list[str]) -> None:
    pattern = re.compile(choices_to_regex(choices), re.DOTALL)
    for choice in choices:
        assert pattern.fullmatch(choice)
    assert not pattern.fullmatch(choices[0] + "\x00extra") or (choices[0] + "\x00extra") in choices


@given(st.text(max_size=30))
def test_escaped_literal_matches_only_itself(text: str) -> None:
    assert re.fullmatch(escape_regex_literal(text), text, re.DOTALL)
    assert not re.fullmatch(escape_regex_literal(text), text + "!", re.DOTALL)


def test_subschema_walk_follows_keywords_not_property_names() -> None:
    schema = {
        "properties": {"format": {"type": "string"}, "items": {"$ref": "#/$defs/x"}},
        "items": [{"type": "integer"}],
        "anyOf": [{"not": {"const": 1}}],
        "$defs": {"x/y": {"enum": [{"format": "not a schema"}]}},
    }
    pointers = [pointer for pointer, _ in iter_subschemas(schema)]
    assert pointers == [
        "",
        "/properties/format",
        "/properties/items",
        "/$defs/x~1y",
        "/anyOf/0",
        "/anyOf/0/not",
        "/items/0",
    ]
