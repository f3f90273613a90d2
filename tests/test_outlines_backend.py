"""The outlines backend on the real SmolLM2 and Qwen3.5 tokenizers (few Qwen cases: each index takes ~0.2-1 s)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import outlines_core
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from outlines_core.json_schema import build_regex_from_schema

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import (
    BaseGrammarObject,
    InvalidGrammarObject,
    TokenRejectedError,
    create_grammar_backend,
)
from sglang_constrained.constraint_spec import choices_to_regex, make_grammar_key
from sglang_constrained.outlines_backend import OutlinesGrammar, OutlinesGrammarBackend
from sglang_constrained.vocabulary import tokenizer_special_token_ids
from tests.conftest import TokenizerCase

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age"],
}
PERSON = {"name": "Zoë Ng", "age": 42, "tags": ["a b", "c"]}
CHOICES = ["yes", "no", "maybe so"]
EMAIL_REGEX = r"[a-z]+@[a-z]+\.com"


def make_backend(
    case: TokenizerCase, eos_token_ids: list[int] | None = None, **overrides: Any
) -> OutlinesGrammarBackend:
    server_args = replace(ServerArgs(grammar_backend="outlines"), **overrides)
    return OutlinesGrammarBackend(server_args, case.tokenizer, case.vocab_size, eos_token_ids or case.eos_token_ids)


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_tokenizer: TokenizerCase) -> Iterator[OutlinesGrammarBackend]:
    backend = make_backend(smollm2_tokenizer)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def qwen35_backend(qwen35_tokenizer: TokenizerCase) -> Iterator[OutlinesGrammarBackend]:
    backend = make_backend(qwen35_tokenizer)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def smollm2_variant(smollm2_tokenizer: TokenizerCase) -> Iterator[Callable[..., OutlinesGrammarBackend]]:
    """Backends with other server settings, built once per setting."""
    built: dict[str, OutlinesGrammarBackend] = {}

    def variant(**overrides: Any) -> OutlinesGrammarBackend:
        key = repr(sorted(overrides.items()))
        if key not in built:
            built[key] = make_backend(smollm2_tokenizer, **overrides)
        return built[key]

    yield variant
    for backend in built.values():
        backend.shutdown()


@pytest.fixture
def tokenizer_and_backend(request: pytest.FixtureRequest) -> tuple[TokenizerCase, OutlinesGrammarBackend]:
    name = request.param
    return request.getfixturevalue(f"{name}_tokenizer"), request.getfixturevalue(f"{name}_backend")


def compile_grammar(backend: OutlinesGrammarBackend, kind: str, spec: Any) -> BaseGrammarObject:
    grammar, _ = backend.get_cached_or_future_value(make_grammar_key(kind, spec))
    assert not isinstance(grammar, BaseGrammarObject)
    return grammar.result()


def compile_valid(backend: OutlinesGrammarBackend, kind: str, spec: Any) -> OutlinesGrammar:
    grammar = compile_grammar(backend, kind, spec)
    assert isinstance(grammar, OutlinesGrammar), grammar
    return grammar


def allowed_tokens(grammar: BaseGrammarObject, vocab_size: int) -> set[int]:
    """The token ids row 1 of a fresh two-row mask allows (bit ``t % 32`` of word ``t // 32``, little-endian)."""
    mask = grammar.allocate_vocab_mask(vocab_size, 2, "cpu")
    grammar.fill_vocab_mask(mask, 1)
    assert (mask[0] == -1).all(), "a fill must touch only its own row"
    bits = np.unpackbits(mask[1].numpy().view(np.uint8), bitorder="little")
    assert not bits[vocab_size:].any()
    return set(np.flatnonzero(bits).tolist())


def spec_regex(backend: OutlinesGrammarBackend, kind: str, spec: Any) -> str:
    """The regex the constraint stands for (Python's ``re`` is the oracle for where the text is complete)."""
    if kind == "regex":
        return spec
    if kind == "choice":
        return choices_to_regex(spec)
    schema = {"type": "object"} if kind == "json_object" else spec
    return build_regex_from_schema(json.dumps(schema), backend.whitespace_pattern)


def walk_to_termination(grammar: BaseGrammarObject, case: TokenizerCase, text: str, regex: str) -> None:
    """Feed ``text``'s tokens and a stop token, checking every mask on the way."""
    ids = case.tokenizer.encode(text, add_special_tokens=False)
    assert case.tokenizer.decode(ids) == text
    eos = set(case.eos_token_ids)
    never = (tokenizer_special_token_ids(case.tokenizer) - eos) | set(range(len(case.tokenizer), case.vocab_size))
    for step in range(len(ids) + 1):
        allowed = allowed_tokens(grammar, case.vocab_size)
        assert not allowed & never, "a special token or padding id was allowed"
        is_complete = re.fullmatch(regex, case.tokenizer.decode(ids[:step])) is not None
        assert (eos <= allowed) == is_complete and bool(eos & allowed) == is_complete
        if step < len(ids):
            assert ids[step] in allowed
            grammar.accept_token(ids[step])
    assert not grammar.is_terminated()
    grammar.accept_token(case.eos_token_ids[0])
    assert grammar.is_terminated()
    assert allowed_tokens(grammar, case.vocab_size) == eos


def is_rejected(grammar: BaseGrammarObject, case: TokenizerCase, text: str) -> bool:
    """Whether the grammar refuses some token of ``text`` or the stop token after it; mask and accept agree."""
    for token in [*case.tokenizer.encode(text, add_special_tokens=False), case.eos_token_ids[0]]:
        if token not in allowed_tokens(grammar, case.vocab_size):
            with pytest.raises(TokenRejectedError):
                grammar.accept_token(token)
            return True
        grammar.accept_token(token)
    return False


WALKS = [
    ("smollm2", "json", PERSON_SCHEMA, json.dumps(PERSON, ensure_ascii=False)),
    ("smollm2", "json", PERSON_SCHEMA, json.dumps(PERSON, separators=(",", ":"), ensure_ascii=False)),
    ("smollm2", "json", PERSON_SCHEMA, json.dumps(PERSON, indent=2, ensure_ascii=False)),
    ("smollm2", "json", PERSON_SCHEMA, '{"name": "Ann", "age": -7}'),
    ("smollm2", "regex", EMAIL_REGEX, "bob@example.com"),
    ("smollm2", "regex", r"[0-9]+", "20250101"),
    ("smollm2", "choice", CHOICES, "maybe so"),
    ("smollm2", "json_object", None, '{"a": [1, {"b": null}], "c": "d"}'),
    ("qwen35", "json", PERSON_SCHEMA, json.dumps(PERSON, ensure_ascii=False)),
    ("qwen35", "choice", CHOICES, "no"),
]


@pytest.mark.parametrize(("tokenizer_and_backend", "kind", "spec", "text"), WALKS, indirect=["tokenizer_and_backend"])
def test_valid_text_walks_to_termination(
    tokenizer_and_backend: tuple[TokenizerCase, OutlinesGrammarBackend], kind, spec, text
):
    case, backend = tokenizer_and_backend
    walk_to_termination(compile_valid(backend, kind, spec), case, text, spec_regex(backend, kind, spec))


REJECTIONS = [
    ("smollm2", "json", PERSON_SCHEMA, '{"name": 1, "age": 2}'),
    ("smollm2", "json", PERSON_SCHEMA, '{"age": 3}'),
    ("smollm2", "json", PERSON_SCHEMA, '{"name": "a", "age": 1.5}'),
    ("smollm2", "json", PERSON_SCHEMA, '{"name": "a", "age": 1}}'),
    ("smollm2", "regex", EMAIL_REGEX, "bob@example.org"),
    ("smollm2", "choice", CHOICES, "nope"),
    ("smollm2", "choice", CHOICES, "maybe"),
    ("qwen35", "json", PERSON_SCHEMA, '{"name": null, "age": 2}'),
]


@pytest.mark.parametrize(
    ("tokenizer_and_backend", "kind", "spec", "text"), REJECTIONS, indirect=["tokenizer_and_backend"]
)
def test_invalid_text_is_rejected(
    tokenizer_and_backend: tuple[TokenizerCase, OutlinesGrammarBackend], kind, spec, text
):
    case, backend = tokenizer_and_backend
    assert is_rejected(compile_valid(backend, kind, spec), case, text)


OUTLINES_CORE_LIMITS = [
    pytest.param("json", PERSON_SCHEMA, json.dumps(PERSON), id="no-unicode-escapes-in-strings"),
    pytest.param("json", {"type": "number"}, "1.5", id="top-level-number-cannot-take-a-fraction"),
    pytest.param("choice", ["a", "a!"], "a!", id="token-one-byte-past-a-complete-choice-dropped"),
]


@pytest.mark.parametrize(("kind", "spec", "text"), OUTLINES_CORE_LIMITS)
def test_outlines_core_refuses_these_valid_texts(smollm2_tokenizer, smollm2_backend, kind, spec, text):
    """Known outlines-core 0.2.14 limits (see the module docstring): if this fails, the engine got better."""
    assert is_rejected(compile_valid(smollm2_backend, kind, spec), smollm2_tokenizer, text)


def test_stop_tokens_all_allowed_exactly_at_final_states(smollm2_tokenizer: TokenizerCase):
    case = smollm2_tokenizer
    stop_ids = [case.eos_token_ids[0], case.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    backend = make_backend(case, eos_token_ids=stop_ids)
    try:
        grammar = compile_valid(backend, "choice", ["yes", "no"])
        assert not set(stop_ids) & allowed_tokens(grammar, case.vocab_size)
        for token in case.tokenizer.encode("yes", add_special_tokens=False):
            grammar.accept_token(token)
        assert set(stop_ids) <= allowed_tokens(grammar, case.vocab_size)
        for stop_id in stop_ids:
            grammar.accept_token(stop_id)
            assert grammar.is_terminated()
            assert allowed_tokens(grammar, case.vocab_size) == set(stop_ids)
            grammar.rollback(1)
    finally:
        backend.shutdown()


def test_rollback_across_an_accepted_stop_token(smollm2_tokenizer: TokenizerCase, smollm2_backend):
    case, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_ids[0]
    grammar = compile_valid(smollm2_backend, "regex", r"[0-9]+")
    ids = case.tokenizer.encode("123", add_special_tokens=False)
    masks = []
    for token in ids:
        masks.append(allowed_tokens(grammar, case.vocab_size))
        grammar.accept_token(token)
    final_mask = allowed_tokens(grammar, case.vocab_size)
    grammar.accept_token(eos)
    grammar.rollback(1)
    assert not grammar.is_terminated() and allowed_tokens(grammar, case.vocab_size) == final_mask
    grammar.accept_token(eos)
    grammar.rollback(3)
    assert not grammar.is_terminated() and allowed_tokens(grammar, case.vocab_size) == masks[-2]
    for bad_k in (len(ids), -1):
        with pytest.raises(ValueError, match="roll back"):
            grammar.rollback(bad_k)
    assert allowed_tokens(grammar, case.vocab_size) == masks[-2]
    grammar.rollback(0)
    assert allowed_tokens(grammar, case.vocab_size) == masks[-2]


def test_copy_starts_fresh_and_shares_only_the_index(smollm2_tokenizer: TokenizerCase, smollm2_backend):
    case = smollm2_tokenizer
    grammar = compile_valid(smollm2_backend, "json", PERSON_SCHEMA)
    start_mask = allowed_tokens(grammar, case.vocab_size)
    grammar.accept_token(case.tokenizer.encode("{", add_special_tokens=False)[0])
    copied = grammar.copy()
    assert copied.compiled is grammar.compiled and copied.memory_size_bytes() == grammar.memory_size_bytes() > 0
    assert allowed_tokens(copied, case.vocab_size) == start_mask
    after_brace = allowed_tokens(grammar, case.vocab_size)
    copied.accept_token(case.tokenizer.encode("{", add_special_tokens=False)[0])
    copied.accept_token(case.tokenizer.encode('"', add_special_tokens=False)[0])
    assert allowed_tokens(grammar, case.vocab_size) == after_brace != start_mask


def test_validate_tokens_leaves_the_state_unchanged(smollm2_tokenizer: TokenizerCase, smollm2_backend):
    case, eos = smollm2_tokenizer, smollm2_tokenizer.eos_token_ids[0]
    grammar = compile_valid(smollm2_backend, "regex", EMAIL_REGEX)
    grammar.accept_token(case.tokenizer.encode("bob", add_special_tokens=False)[0])
    before = allowed_tokens(grammar, case.vocab_size)
    rest = case.tokenizer.encode("@example.com", add_special_tokens=False)
    bad = case.tokenizer.encode("!", add_special_tokens=False)[0]
    assert grammar.validate_tokens([*rest, eos, rest[0]]) == len(rest) + 1
    assert grammar.validate_tokens([*rest[:1], bad, *rest[1:]]) == 1
    assert grammar.validate_tokens([*rest[:1], eos]) == 1
    assert grammar.validate_tokens([]) == 0
    assert allowed_tokens(grammar, case.vocab_size) == before
    for token in [*rest, eos]:
        grammar.accept_token(token)
    assert grammar.validate_tokens([eos]) == 0


@pytest.mark.parametrize(
    ("overrides", "text", "is_accepted"),
    [
        ({}, json.dumps(PERSON, indent=2, ensure_ascii=False), True),
        ({"constrained_json_disable_any_whitespace": True}, json.dumps(PERSON, ensure_ascii=False), False),
        ({"constrained_json_disable_any_whitespace": True}, '{"name":"a","age":1}', True),
        ({"constrained_json_disable_any_whitespace": True}, '{"name": "a","age":1}', False),
        ({"constrained_json_whitespace_pattern": "[ ]?"}, '{"name": "a", "age": 1}', True),
        ({"constrained_json_whitespace_pattern": "[ ]?"}, '{\n"name": "a", "age": 1}', False),
    ],
)
def test_json_whitespace_settings(smollm2_tokenizer, smollm2_variant, overrides, text, is_accepted):
    grammar = compile_valid(smollm2_variant(**overrides), "json", PERSON_SCHEMA)
    assert is_rejected(grammar, smollm2_tokenizer, text) != is_accepted


def test_registry_builds_the_outlines_backend_by_name(smollm2_tokenizer: TokenizerCase):
    case = smollm2_tokenizer
    backend = create_grammar_backend(
        ServerArgs(grammar_backend="outlines"), case.tokenizer, case.vocab_size, case.eos_token_ids
    )
    assert isinstance(backend, OutlinesGrammarBackend) and backend.name == "outlines"
    backend.shutdown()


def test_contradictory_whitespace_settings_are_refused(smollm2_tokenizer: TokenizerCase):
    with pytest.raises(ValueError, match="not both"):
        make_backend(
            smollm2_tokenizer, constrained_json_whitespace_pattern=" ?", constrained_json_disable_any_whitespace=True
        )


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("ebnf", 'root ::= "a"', "the outlines grammar backend does not support ebnf constraints"),
        ("structural_tag", {"type": "structural_tag"}, "does not support structural_tag constraints"),
        ("regex", "(abc", "invalid regex: missing ), unterminated subpattern at position 0"),
        ("regex", "(?=a)b", "look-around, back-references"),
        ("regex", r"(a)\1", "look-around, back-references"),
        ("regex", "^ab$", "does not support anchors"),
        ("regex", "[" + "a" * 2000, "invalid regex: unterminated character set"),
        ("json", {"type": "string", "format": "ipv4"}, "'format': 'ipv4' (at /)"),
        ("json", {"description": "no type"}, "outlines-core cannot turn this JSON schema into a regex"),
    ],
)
def test_unsupported_or_malformed_constraints_get_a_clear_message(smollm2_backend, kind, spec, message):
    grammar = compile_grammar(smollm2_backend, kind, spec)
    assert isinstance(grammar, InvalidGrammarObject)
    assert message in grammar.error_message and len(grammar.error_message) < 400
    if isinstance(spec, dict):
        assert json.dumps(spec, separators=(",", ":")) not in grammar.error_message


INT = {"type": "integer"}
PAIR = {"a": INT, "b": INT}
LINKED_LIST = {
    "type": "object",
    "properties": {"v": INT, "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}},
    "required": ["v", "next"],
}
REFUSED_FEATURES = [
    ("'multipleOf'", {"type": "array", "items": {**INT, "multipleOf": 3}}, "/items", "[4]"),
    ("'minimum'", {"type": "object", "properties": {"n": {**INT, "minimum": 5}}}, "/properties/n", '{"n":1}'),
    ("'maximum'", {"type": "array", "items": {"type": "number", "maximum": 5}}, "/items", "[9]"),
    ("'exclusiveMinimum'", {"type": "array", "items": {**INT, "exclusiveMinimum": 5}}, "/items", "[5]"),
    ("'exclusiveMaximum'", {"type": "array", "items": {**INT, "exclusiveMaximum": 5}}, "/items", "[5]"),
    ("'uniqueItems'", {"type": "array", "items": INT, "uniqueItems": True}, "/", "[1,1]"),
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


def test_supported_schema_features_compile(smollm2_tokenizer: TokenizerCase, smollm2_backend):
    schema = {
        "$defs": {"Color": {"enum": ["red", "green"], "type": "string"}},
        "type": "object",
        "properties": {
            "color": {"$ref": "#/$defs/Color", "description": "a color"},
            "nickname": {"anyOf": [{"type": "string", "minLength": 1, "maxLength": 12}, {"type": "null"}]},
            "born": {"type": "string", "format": "date"},
            "pair": {"type": "array", "prefixItems": [INT, {"type": "boolean"}]},
        },
        "required": ["color", "born"],
        "additionalProperties": False,
    }
    grammar = compile_valid(smollm2_backend, "json", schema)
    text = '{"color": "red", "nickname": null, "born": "2024-02-29", "pair": [3, true]}'
    walk_to_termination(grammar, smollm2_tokenizer, text, spec_regex(smollm2_backend, "json", schema))


def _is_prefix_free(choices: list[str]) -> bool:
    return not any(a != b and b.startswith(a) for a in choices for b in choices)


CHOICE_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("\\.^$|?*+()[]{}\"'\n\t -_é中😀")), st.characters(exclude_categories=("Cs",))
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(choices=st.lists(CHOICE_TEXT, min_size=1, max_size=4, unique=True), pick=st.integers(0, 3), extra=CHOICE_TEXT)
def test_every_choice_walks_and_nothing_else_does(smollm2_tokenizer, smollm2_backend, choices, pick, extra):
    # Prefix-free lists only: outlines-core drops tokens one byte past a complete choice (see the limits above).
    case, tokenizer = smollm2_tokenizer, smollm2_tokenizer.tokenizer
    assume(_is_prefix_free(choices))
    assume(all(tokenizer.decode(tokenizer.encode(c, add_special_tokens=False)) == c for c in [*choices, extra]))
    grammar = compile_valid(smollm2_backend, "choice", choices)
    walk_to_termination(grammar.copy(), case, choices[pick % len(choices)], choices_to_regex(choices))
    # choices[0] + extra is never a choice: the list is prefix-free.
    for outsider in {choices[0] + extra, extra} - set(choices):
        assert is_rejected(grammar.copy(), case, outsider)
