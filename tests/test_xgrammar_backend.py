"""The xgrammar backend against real tokenizers (SmolLM2 49k, Qwen3.5 248k): masks, stop tokens, state, errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import InvalidGrammarObject, TokenRejectedError, create_grammar_backend
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.xgrammar_backend import XGrammarGrammar, XGrammarGrammarBackend

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
NOTE_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TAG_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY_TAG = {"structures": [{"begin": "<f=weather>", "schema": TAG_SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
NEW_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f="],
        "tags": [
            {
                "type": "tag",
                "begin": "<f=weather>",
                "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
                "end": "</f>",
            }
        ],
    },
}
EBNF = 'root ::= "SELECT " column " FROM t"\ncolumn ::= "a" | "bb"'


@pytest.fixture(scope="module")
def backend(tokenizer_case: Any, server_args: ServerArgs) -> Iterator[XGrammarGrammarBackend]:
    built = XGrammarGrammarBackend(
        server_args, tokenizer_case.tokenizer, tokenizer_case.vocab_size, tokenizer_case.eos_token_ids
    )
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def compact_backend(tokenizer_case: Any, server_args: ServerArgs) -> Iterator[XGrammarGrammarBackend]:
    args = replace(server_args, constrained_json_disable_any_whitespace=True)
    built = XGrammarGrammarBackend(
        args, tokenizer_case.tokenizer, tokenizer_case.vocab_size, tokenizer_case.eos_token_ids
    )
    yield built
    built.shutdown()


def compile_grammar(backend: XGrammarGrammarBackend, kind: str, spec: Any) -> Any:
    """A fresh grammar object for the constraint, compiled once per backend through the backend's own cache."""
    key = make_grammar_key(kind, spec)
    value, is_cache_hit = backend.get_cached_or_future_value(key)
    if is_cache_hit:
        return value
    grammar = value.result()
    backend.set_cache(key, grammar)
    return grammar.copy()


def encode(backend: XGrammarGrammarBackend, tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(backend.vocabulary.decoded_vocab[t] for t in ids) == text.encode(), "text must round-trip"
    return ids


def allowed_tokens(grammar: Any, vocab_size: int) -> torch.Tensor:
    """The grammar's current mask as bools ``[vocab_size]``."""
    mask = grammar.allocate_vocab_mask(vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    bits = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")  # bit t of the row is token t
    return torch.from_numpy(bits[:vocab_size].astype(bool))


def never_allowed_ids(backend: XGrammarGrammarBackend) -> torch.Tensor:
    """Special tokens other than the stop tokens, and the padding ids above the tokenizer's vocabulary."""
    vocab = backend.vocabulary
    padding = range(vocab.tokenizer_vocab_size, vocab.model_vocab_size)
    return torch.tensor(sorted((vocab.special_token_ids - set(vocab.stop_token_ids)) | set(padding)))


def walk(backend: XGrammarGrammarBackend, tokenizer: Any, grammar: Any, text: str, can_end: Callable[[str], bool]):
    """Accept ``text`` then EOS, checking every mask: the token is allowed, no special or padding id ever is,
    and the stop tokens are allowed exactly where ``can_end(prefix)`` says the grammar may end."""
    vocab, never = backend.vocabulary, never_allowed_ids(backend)
    ids, prefix = encode(backend, tokenizer, text), b""
    for token in [*ids, None]:
        allowed = allowed_tokens(grammar, vocab.model_vocab_size)
        assert not allowed[never].any(), f"a special or padding token is allowed after {prefix!r}"
        text_so_far = _decoded_or_none(prefix)
        expected_end = text_so_far is not None and can_end(text_so_far)
        assert all(bool(allowed[stop]) == expected_end for stop in vocab.stop_token_ids), prefix
        if token is None:
            break
        assert allowed[token], f"token {token} ({vocab.decoded_vocab[token]!r}) is masked after {prefix!r}"
        grammar.accept_token(token)
        prefix += vocab.decoded_vocab[token]
    grammar.accept_token(vocab.stop_token_ids[0])
    assert grammar.is_terminated()


def _decoded_or_none(prefix: bytes) -> str | None:
    try:
        return prefix.decode()
    except UnicodeDecodeError:
        return None


def json_can_end(schema: Any) -> Callable[[str], bool]:
    def can_end(text: str) -> bool:
        try:
            return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        except json.JSONDecodeError:
            return False

    return can_end


def accepts(grammar: Any, backend: XGrammarGrammarBackend, tokenizer: Any, text: str) -> bool:
    """Whether the grammar accepts all of ``text`` and may then stop; the grammar's state does not change."""
    ids = [*encode(backend, tokenizer, text), backend.vocabulary.stop_token_ids[0]]
    return grammar.validate_tokens(ids) == len(ids)


# kind, spec, a valid text, an invalid text, where the grammar may end
WALK_CASES = [
    ("json", PERSON_SCHEMA, '{"name": "Ada", "age": 36}', '{"name": "Ada"}', json_can_end(PERSON_SCHEMA)),
    ("json", {"type": "integer"}, "-120", "12a", json_can_end({"type": "integer"})),
    ("json_object", None, '{"a": [1, {"b": null}]}', "[1]", json_can_end({"type": "object"})),
    (
        "regex",
        r"user-[0-9]{3}@example\.com",
        "user-042@example.com",
        "user-42@example.com",
        lambda t: re.fullmatch(r"user-[0-9]{3}@example\.com", t) is not None,
    ),
    ("regex", r"[0-9]+", "2024", "20x4", lambda t: re.fullmatch(r"[0-9]+", t) is not None),
    ("ebnf", EBNF, "SELECT bb FROM t", "SELECT b FROM t", lambda t: t in ("SELECT a FROM t", "SELECT bb FROM t")),
    ("choice", ["yes", "no", "maybe"], "maybe", "perhaps", lambda t: t in ("yes", "no", "maybe")),
]


@pytest.mark.parametrize(("kind", "spec", "valid", "invalid", "can_end"), WALK_CASES, ids=lambda v: None)
def test_constraint_walks_valid_text_and_rejects_invalid(backend, tokenizer_case, kind, spec, valid, invalid, can_end):
    walk(backend, tokenizer_case.tokenizer, compile_grammar(backend, kind, spec), valid, can_end)
    grammar = compile_grammar(backend, kind, spec)
    ids = [*encode(backend, tokenizer_case.tokenizer, invalid), *backend.vocabulary.stop_token_ids]
    num_ok = grammar.validate_tokens(ids)
    assert num_ok < len(ids)
    for token in ids[:num_ok]:
        grammar.accept_token(token)
    assert not allowed_tokens(grammar, tokenizer_case.vocab_size)[ids[num_ok]]
    with pytest.raises(TokenRejectedError):
        grammar.accept_token(ids[num_ok])


def test_special_tokens_never_allowed_inside_json_string(backend, tokenizer_case):
    grammar = compile_grammar(backend, "json", NOTE_SCHEMA)
    text = '{"text": "Hi <b>, wörld! \\"quoted\\" \\n\\t 42 <|fake|> ok"}'
    walk(backend, tokenizer_case.tokenizer, grammar, text, json_can_end(NOTE_SCHEMA))
    grammar = compile_grammar(backend, "json", NOTE_SCHEMA)
    for token in encode(backend, tokenizer_case.tokenizer, '{"text": "in a string'):
        grammar.accept_token(token)
    for special in sorted(backend.vocabulary.special_token_ids):
        with pytest.raises(TokenRejectedError):
            grammar.accept_token(special)
    assert len(backend.vocabulary.special_token_ids) == {"smollm2": 17, "qwen35": 33}[tokenizer_case.name]


def test_padding_and_specials_never_allowed_in_free_text(backend, tokenizer_case):
    grammar = compile_grammar(backend, "structural_tag", NEW_TAG)
    allowed = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert not allowed[never_allowed_ids(backend)].any()
    assert allowed[tokenizer_case.eos_token_ids].all()
    assert allowed.sum() > 0.9 * backend.vocabulary.tokenizer_vocab_size  # free text allows nearly everything


def test_xgrammar_sees_the_vocabulary_bytes_unchanged(backend):
    """xgrammar must take the decoded bytes raw: re-decoding them as byte-level mangles non-ASCII tokens."""
    assert list(backend.tokenizer_info.decoded_vocab) == list(backend.vocabulary.decoded_vocab)
    assert backend.tokenizer_info.stop_token_ids == list(backend.vocabulary.stop_token_ids)


def test_builtin_registry_builds_this_backend(smollm2_tokenizer, server_args):
    case = smollm2_tokenizer
    built = create_grammar_backend(server_args, case.tokenizer, case.vocab_size, case.eos_token_ids)
    assert isinstance(built, XGrammarGrammarBackend) and built.name == server_args.grammar_backend == "xgrammar"
    built.shutdown()


@pytest.mark.parametrize(
    ("text", "flexible", "compact"),
    [
        ('{"name":"Ada","age":36}', True, True),
        ('{"name": "Ada", "age": 36}', True, False),
        ('{\n  "name" : "Ada",\n  "age" : 36\n}', True, False),
        ('{"name":"Ada" ,"age":36}', True, False),
    ],
)
def test_whitespace_flexible_by_default_and_compact_on_request(
    backend, compact_backend, tokenizer_case, text, flexible, compact
):
    tokenizer = tokenizer_case.tokenizer
    assert accepts(compile_grammar(backend, "json", PERSON_SCHEMA), backend, tokenizer, text) is flexible
    assert accepts(compile_grammar(compact_backend, "json", PERSON_SCHEMA), compact_backend, tokenizer, text) is compact


def test_whitespace_pattern_is_refused_with_the_flag_to_use(smollm2_tokenizer, server_args):
    case = smollm2_tokenizer
    args = replace(server_args, constrained_json_whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="--constrained-json-disable-any-whitespace"):
        XGrammarGrammarBackend(args, case.tokenizer, case.vocab_size, case.eos_token_ids)


def tag_can_end(text: str) -> bool:
    """Outside a tag anything may end the output; inside one (a begun but unclosed tag) it may not."""
    last_begin = text.rfind("<f=")
    return last_begin == -1 or "</f>" in text[last_begin:]


@pytest.mark.parametrize(
    "tag", [LEGACY_TAG, NEW_TAG, {**LEGACY_TAG, "type": "structural_tag"}], ids=["legacy", "new", "legacy-typed"]
)
def test_structural_tag_walks_trigger_json_and_end(backend, tokenizer_case, tag):
    text = 'Let me check. <f=weather>{"city": "Paris"}</f> Done.'
    walk(backend, tokenizer_case.tokenizer, compile_grammar(backend, "structural_tag", tag), text, tag_can_end)
    grammar = compile_grammar(backend, "structural_tag", tag)
    assert accepts(grammar, backend, tokenizer_case.tokenizer, "No tool needed.")
    assert not accepts(grammar, backend, tokenizer_case.tokenizer, 'Check <f=weather>{"town": "Paris"}</f>')
    assert not accepts(grammar, backend, tokenizer_case.tokenizer, 'Check <f=weather>{"city": "Paris"} and more')


def walked(backend: XGrammarGrammarBackend, tokenizer: Any, kind: str, spec: Any, text: str):
    """A grammar that has accepted ``text`` (no stop token), and the masks seen before each token and at the end."""
    grammar, masks = compile_grammar(backend, kind, spec), []
    for token in encode(backend, tokenizer, text):
        masks.append(allowed_tokens(grammar, backend.vocabulary.model_vocab_size))
        grammar.accept_token(token)
    masks.append(allowed_tokens(grammar, backend.vocabulary.model_vocab_size))
    return grammar, masks


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_rollback_then_reaccept_gives_identical_masks(backend, tokenizer_case, data):
    text = '{"name": "Zoë O\'Neil", "age": 101}'
    grammar, masks = walked(backend, tokenizer_case.tokenizer, "json", PERSON_SCHEMA, text)
    ids = encode(backend, tokenizer_case.tokenizer, text)
    k = data.draw(st.integers(0, len(ids)))
    grammar.rollback(k)
    assert torch.equal(allowed_tokens(grammar, tokenizer_case.vocab_size), masks[len(ids) - k])
    for step, token in enumerate(ids[len(ids) - k :], start=len(ids) - k):
        assert torch.equal(allowed_tokens(grammar, tokenizer_case.vocab_size), masks[step])
        grammar.accept_token(token)
    assert torch.equal(allowed_tokens(grammar, tokenizer_case.vocab_size), masks[-1])


def test_rollback_past_the_start_is_a_value_error(backend, tokenizer_case):
    grammar, _ = walked(backend, tokenizer_case.tokenizer, "regex", r"[0-9]+", "12")
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(encode(backend, tokenizer_case.tokenizer, "12")) + 1)
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(-1)


def test_copy_starts_fresh_on_the_same_compiled_grammar(backend, tokenizer_case):
    vocab_size = tokenizer_case.vocab_size
    grammar, masks = walked(backend, tokenizer_case.tokenizer, "json", PERSON_SCHEMA, '{"name": "Ada", ')
    copied = grammar.copy()
    assert copied.compiled_grammar is grammar.compiled_grammar
    assert copied.matcher is not grammar.matcher
    assert torch.equal(allowed_tokens(copied, vocab_size), masks[0])
    for token in encode(backend, tokenizer_case.tokenizer, '{"name": "Bob", "age": 7}'):
        copied.accept_token(token)
    copied.accept_token(tokenizer_case.eos_token_ids[0])
    assert copied.is_terminated() and not grammar.is_terminated()
    assert torch.equal(allowed_tokens(grammar, vocab_size), masks[-1])
    assert grammar.memory_size_bytes() == copied.memory_size_bytes() > 0


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(0, 40), junk=st.sampled_from(["", "x", "}", '"', " 1"]), start=st.integers(0, 6))
def test_validate_tokens_finds_longest_prefix_and_keeps_state(backend, tokenizer_case, cut, junk, start):
    text = '{"name": "Ada", "age": 36}'
    ids = encode(backend, tokenizer_case.tokenizer, text)
    start = min(start, len(ids))
    grammar, _ = walked(backend, tokenizer_case.tokenizer, "json", PERSON_SCHEMA, "")
    for token in ids[:start]:
        grammar.accept_token(token)
    candidate = (
        ids[start : start + cut] + encode(backend, tokenizer_case.tokenizer, junk) + tokenizer_case.eos_token_ids
    )
    before = allowed_tokens(grammar, tokenizer_case.vocab_size)
    num_valid = grammar.validate_tokens(candidate)
    assert torch.equal(allowed_tokens(grammar, tokenizer_case.vocab_size), before)
    reference = grammar.copy()
    for token in ids[:start]:
        reference.accept_token(token)
    expected = 0
    for token in candidate:
        try:
            reference.accept_token(token)
        except TokenRejectedError:
            break
        expected += 1
        if reference.is_terminated():
            break
    assert num_valid == expected
    for token in candidate[:num_valid]:
        grammar.accept_token(token)


def test_terminated_grammar_ignores_tokens_and_allows_only_stop_tokens(backend, tokenizer_case):
    grammar, _ = walked(backend, tokenizer_case.tokenizer, "choice", ["yes", "no"], "yes")
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()
    grammar.accept_token(encode(backend, tokenizer_case.tokenizer, "no")[0])
    allowed = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert allowed.nonzero().flatten().tolist() == sorted(tokenizer_case.eos_token_ids)
    assert grammar.try_jump_forward(tokenizer_case.tokenizer) is None
    assert grammar.validate_tokens(tokenizer_case.eos_token_ids) == 0


BAD_TRIGGER_TAG = {**NEW_TAG, "format": {**NEW_TAG["format"], "triggers": ["<g="]}}
# kind, spec, words the message must contain
MALFORMED_CASES = [
    ("regex", "user-(", ["regex", "parenthesis is not closed"]),
    ("regex", "(?=a)b", ["regex", "Lookahead is not supported"]),
    ("ebnf", 'root ::= item\nitem ::= "a" | missing', ["EBNF", 'Rule "missing" is not defined']),
    ("ebnf", 'start ::= "a"', ["EBNF", 'root rule with name "root" is not found']),
    ("ebnf", 'root ::= "a', ["EBNF", "string literal"]),
    (
        "json",
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}]},
        ["JSON schema", "items must be a boolean or an object"],
    ),
    ("json", {"$ref": "#/$defs/missing"}, ["JSON schema", "$defs"]),
    ("structural_tag", {"type": "structural_tag"}, ["needs 'format'", "'structures' and 'triggers'"]),
    ("structural_tag", {"type": "tool_calls", "format": {}}, ["type 'structural_tag'", "tool_calls"]),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "nope"}},
        ["invalid structural tag at format", "nope"],
    ),
    ("structural_tag", BAD_TRIGGER_TAG, ["structural tag", "does not match any trigger"]),
    ("structural_tag", {"structures": [{"begin": "<f>", "schema": {}}], "triggers": ["<f"]}, ["structure 0 lacks end"]),
    ("structural_tag", {"structures": "x", "triggers": ["<f"]}, ["'structures' must be a list of objects"]),
    (
        "structural_tag",
        {
            **LEGACY_TAG,
            "structures": [{**LEGACY_TAG["structures"][0], "schema": {"type": "integer", "not": {"const": 3}}}],
        },
        ["structural tag's JSON schema at /format/tags/0/content", "'not'"],
    ),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": 5}}},
        ["structural tag's JSON schema at /format", "invalid JSON schema"],
    ),
]


@pytest.mark.parametrize(("kind", "spec", "words"), MALFORMED_CASES, ids=lambda v: None)
def test_malformed_constraints_give_invalid_grammar_with_clear_message(backend, kind, spec, words):
    grammar = backend.get_cached_or_future_value(make_grammar_key(kind, spec))[0].result()
    assert isinstance(grammar, InvalidGrammarObject)
    for word in words:
        assert word in grammar.error_message
    assert ".cc:" not in grammar.error_message and "Check failed" not in grammar.error_message
    assert "\n" not in grammar.error_message


def test_structural_tag_requiring_a_special_token_is_refused(backend, tokenizer_case):
    special = min(backend.vocabulary.special_token_ids - set(tokenizer_case.eos_token_ids))
    for token in (special, tokenizer_case.vocab_size - 1):
        tag = {"type": "structural_tag", "format": {"type": "token", "token": token}}
        grammar = backend.get_cached_or_future_value(make_grammar_key("structural_tag", tag))[0].result()
        assert isinstance(grammar, InvalidGrammarObject)
        assert f"token {token}" in grammar.error_message and "not a regular token" in grammar.error_message


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


def xgrammar_says_valid(backend: XGrammarGrammarBackend, tokenizer: Any, schema: Any, instance: Any) -> bool:
    """xgrammar's own verdict, compiling without our refusals."""
    grammar = XGrammarGrammar(
        backend.compiler.compile_json_schema(json.dumps(schema)), backend.vocabulary.stop_token_ids
    )
    return accepts(grammar, backend, tokenizer, json.dumps(instance))


@pytest.fixture(scope="module")
def smollm2_backend(smollm2_tokenizer, server_args) -> Iterator[XGrammarGrammarBackend]:
    case = smollm2_tokenizer
    built = XGrammarGrammarBackend(server_args, case.tokenizer, case.vocab_size, case.eos_token_ids)
    yield built
    built.shutdown()


def test_every_refusal_rule_has_a_case():
    from sglang_constrained.xgrammar_backend import XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES

    assert {rule.feature for rule in XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES} == {row[0] for row in REFUSED_FEATURES}


@pytest.mark.parametrize(("feature", "subschema", "value", "root_extras"), REFUSED_FEATURES, ids=lambda v: None)
def test_ignored_schema_feature_is_refused_by_name_and_place(
    smollm2_backend, smollm2_tokenizer, feature, subschema, value, root_extras
):
    schema = in_property_x(subschema, root_extras)
    # The refusal is warranted: compiled as is, xgrammar would give another verdict than JSON Schema.
    tokenizer = smollm2_tokenizer.tokenizer
    instance = {"x": value}
    assert xgrammar_says_valid(smollm2_backend, tokenizer, schema, instance) != json_schema_says_valid(schema, instance)
    grammar = smollm2_backend.get_cached_or_future_value(make_grammar_key("json", schema))[0].result()
    assert isinstance(grammar, InvalidGrammarObject)
    assert feature in grammar.error_message and "(at /properties/x)" in grammar.error_message
    assert json.dumps(subschema) not in grammar.error_message and len(grammar.error_message) < 400


@pytest.mark.parametrize(("subschema", "valid", "invalid", "root_extras"), ENFORCED_FEATURES, ids=lambda v: None)
def test_enforced_schema_feature_is_accepted_and_enforced(
    smollm2_backend, smollm2_tokenizer, subschema, valid, invalid, root_extras
):
    schema, tokenizer = in_property_x(subschema, root_extras), smollm2_tokenizer.tokenizer
    grammar = smollm2_backend.get_cached_or_future_value(make_grammar_key("json", schema))[0].result()
    assert isinstance(grammar, XGrammarGrammar)
    for value, expected in ((valid, True), (invalid, False)):
        assert json_schema_says_valid(schema, {"x": value}) is expected
        assert accepts(grammar, smollm2_backend, tokenizer, json.dumps({"x": value})) is expected


ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"enum": ["green tea", "black coffee"]},
        "count": {"type": "integer"},
        "express": {"type": "boolean"},
    },
    "required": ["item", "count", "express"],
}
# kind, spec, a valid text, whether to compile it with compact JSON whitespace
JUMP_FORWARD_CASES = [
    ("json", ORDER_SCHEMA, '{"item":"black coffee","count":2,"express":false}', True),
    ("json", ORDER_SCHEMA, '{"item": "green tea", "count": 12, "express": true}', False),
    ("json", PERSON_SCHEMA, '{"name":"Ada","age":36}', True),
    ("regex", r"user-[0-9]{3}@example\.com", "user-042@example.com", False),
    ("ebnf", EBNF, "SELECT bb FROM t", False),
    ("choice", ["Paris, France", "Lyon, France"], "Lyon, France", False),
]


@pytest.mark.parametrize(("kind", "spec", "text", "compact"), JUMP_FORWARD_CASES, ids=lambda v: None)
def test_jump_forward_text_is_forced_and_retokenises_into_a_finishable_state(
    request, tokenizer_case, kind, spec, text, compact
):
    backend = request.getfixturevalue("compact_backend" if compact else "backend")
    tokenizer, vocab = tokenizer_case.tokenizer, backend.vocabulary
    ids, grammar = encode(backend, tokenizer, text), compile_grammar(backend, kind, spec)
    num_jumps = 0
    for step in range(len(ids) + 1):
        prefix_ids = ids[:step]
        prefix = b"".join(vocab.decoded_vocab[t] for t in prefix_ids).decode()
        helper = grammar.try_jump_forward(tokenizer)
        if helper is not None:
            forced, state = grammar.jump_forward_str_state(helper)
            assert state == -1 and forced
            assert text[len(prefix) :].startswith(forced), f"{forced!r} is forced after {prefix!r}"
            jumped = compile_grammar(backend, kind, spec)
            for token in prefix_ids:
                jumped.accept_token(token)
            jumped.jump_and_retokenize(prefix_ids, encode(backend, tokenizer, prefix + forced), state)
            rest = text[len(prefix) + len(forced) :]
            for token in encode(backend, tokenizer, rest) if rest else []:
                jumped.accept_token(token)
            jumped.accept_token(tokenizer_case.eos_token_ids[0])
            assert jumped.is_terminated()
            num_jumps += 1
        if step < len(ids):
            grammar.accept_token(ids[step])
    assert num_jumps > 0


def test_jump_and_retokenize_restores_the_state_when_a_token_is_rejected(backend, tokenizer_case):
    tokenizer = tokenizer_case.tokenizer
    closed_person = {**PERSON_SCHEMA, "additionalProperties": False}
    grammar, masks = walked(backend, tokenizer, "json", closed_person, '{"name": "Ada", ')
    old_ids = encode(backend, tokenizer, '{"name": "Ada", ')
    new_ids = encode(backend, tokenizer, '{"name": "Ada", "height"')
    with pytest.raises(TokenRejectedError):
        grammar.jump_and_retokenize(old_ids, new_ids, -1)
    assert torch.equal(allowed_tokens(grammar, tokenizer_case.vocab_size), masks[-1])
    for token in encode(backend, tokenizer, '"age": 36}'):
        grammar.accept_token(token)


def test_jump_and_retokenize_rolls_back_a_non_canonical_prefix(backend, tokenizer_case):
    tokenizer, choices = tokenizer_case.tokenizer, ["Lyon, France", "Paris, France"]
    grammar = compile_grammar(backend, "choice", choices)
    old_ids = [token for char in "Ly" for token in encode(backend, tokenizer, char)]  # one token per letter
    for token in old_ids:
        grammar.accept_token(token)
    helper = grammar.try_jump_forward(tokenizer)
    assert helper is not None
    forced, state = grammar.jump_forward_str_state(helper)
    assert forced == "on, France"
    new_ids = encode(backend, tokenizer, "Ly" + forced)
    assert new_ids[: len(old_ids)] != old_ids, "the retokenisation must change an accepted token"
    grammar.jump_and_retokenize(old_ids, new_ids, state)
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()
