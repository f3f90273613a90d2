"""The outlines backend on the real SmolLM2 and Qwen3.5 tokenizers (few Qwen cases: each index takes ~0.2-1 s)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from outlines_core.json_schema import build_regex_from_schema

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.base_grammar_backend import (
    BaseGrammarObject,
    InvalidGrammarObject,
    TokenRejectedError,
    create_grammar_backend,
)
from sglang_constrained.cache.vocabulary import tokenizer_special_token_ids
from sglang_constrained.constraint_spec import choices_to_regex
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import allowed_tokens, compile_grammar, compile_valid

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


@pytest.fixture(scope="module")
def smollm2_backend(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> OutlinesGrammarBackend:
    return build_backend("outlines", smollm2_tokenizer)


@pytest.fixture(scope="module")
def qwen35_backend(build_backend: BackendBuilder, qwen35_tokenizer: TokenizerSetup) -> OutlinesGrammarBackend:
    return build_backend("outlines", qwen35_tokenizer)


@pytest.fixture
def tokenizer_and_backend(request: pytest.FixtureRequest) -> tuple[TokenizerSetup, OutlinesGrammarBackend]:
    name = request.param
    return request.getfixturevalue(f"{name}_tokenizer"), request.getfixturevalue(f"{name}_backend")


def spec_regex(backend: OutlinesGrammarBackend, kind: str, spec: Any) -> str:
    """The regex the constraint stands for (Python's ``re`` is the oracle for where the text is complete)."""
    if kind == "regex":
        return spec
    if kind == "choice":
        return choices_to_regex(spec)
    schema = {"type": "object"} if kind == "json_object" else spec
    return build_regex_from_schema(json.dumps(schema), backend.backend.whitespace_pattern)


def walk_to_termination(grammar: BaseGrammarObject, case: TokenizerSetup, text: str, regex: str) -> None:
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


def is_rejected(grammar: BaseGrammarObject, case: TokenizerSetup, text: str) -> bool:
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
    tokenizer_and_backend: tuple[TokenizerSetup, OutlinesGrammarBackend], kind, spec, text
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
    tokenizer_and_backend: tuple[TokenizerSetup, OutlinesGrammarBackend], kind, spec, text
):
    case, backend = tokenizer_and_backend
    assert is_rejected(compile_valid(backend, kind, spec), case, text)


OUTLINES_CORE_LIMITS = [
    pytest.param("json", PERSON_SCHEMA, json.dumps(PERSON), id="no-unicode-escapes-in-strings"),
    pytest.param("json", {"type": "number"}, "1.5", id="top-level-number-cannot-take-a-fraction"),
    # Choices avoid this by listing longer options first (test_conformance's "choice with prefixes").
    pytest.param("regex", "a|a!", "a!", id="leftmost-first-alternation-stops-at-a-prefix"),
]


@pytest.mark.parametrize(("kind", "spec", "text"), OUTLINES_CORE_LIMITS)
def test_outlines_core_refuses_these_valid_texts(smollm2_tokenizer, smollm2_backend, kind, spec, text):
    """Known outlines-core 0.2.14 limits (see the module docstring): if this fails, the engine got better."""
    assert is_rejected(compile_valid(smollm2_backend, kind, spec), smollm2_tokenizer, text)


def test_stop_tokens_all_allowed_exactly_at_final_states(build_backend, smollm2_tokenizer: TokenizerSetup):
    case = smollm2_tokenizer
    stop_ids = [case.eos_token_ids[0], case.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    grammar = compile_valid(build_backend("outlines", case, stop_ids), "choice", ["yes", "no"])
    assert not set(stop_ids) & allowed_tokens(grammar, case.vocab_size)
    for token in case.encode("yes"):
        grammar.accept_token(token)
    assert set(stop_ids) <= allowed_tokens(grammar, case.vocab_size)
    for stop_id in stop_ids:
        grammar.accept_token(stop_id)
        assert grammar.is_terminated()
        assert allowed_tokens(grammar, case.vocab_size) == set(stop_ids)
        grammar.rollback(1)


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
def test_json_whitespace_settings(build_backend, smollm2_tokenizer, overrides, text, is_accepted):
    grammar = compile_valid(build_backend("outlines", smollm2_tokenizer, **overrides), "json", PERSON_SCHEMA)
    assert is_rejected(grammar, smollm2_tokenizer, text) != is_accepted


def test_registry_builds_the_outlines_backend_by_name(smollm2_tokenizer: TokenizerSetup):
    case = smollm2_tokenizer
    backend = create_grammar_backend(
        GrammarArgs(grammar_backend="outlines"), case.tokenizer, case.vocab_size, case.eos_token_ids
    )
    assert backend is not None and isinstance(backend.backend, OutlinesGrammarBackend) and backend.name == "outlines"
    backend.shutdown()


def test_contradictory_whitespace_settings_are_refused(build_backend, smollm2_tokenizer: TokenizerSetup):
    conflict = {"constrained_json_whitespace_pattern": " ?", "constrained_json_disable_any_whitespace": True}
    with pytest.raises(ValueError, match="not both"):
        build_backend("outlines", smollm2_tokenizer, **conflict)


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
        ("json", {"type": "string", "format": "hostname"}, "'format': 'hostname' (at /)"),
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


def test_supported_schema_features_compile(smollm2_tokenizer: TokenizerSetup, smollm2_backend):
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
