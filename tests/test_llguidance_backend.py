"""The llguidance backend against both real tokenizers: every constraint kind, masks, state, jump-forward, errors."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import (
    BaseGrammarObject,
    InvalidGrammarObject,
    TokenRejectedError,
    create_grammar_backend,
)
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.llguidance_backend import GuidanceBackend, GuidanceGrammar
from sglang_constrained.text_acceptance import allowed_token_ids, walk_tokens
from sglang_constrained.tokenizer_loading import TokenizerSetup
from sglang_constrained.vocabulary import tokenizer_special_token_ids

SERVER_ARGS = ServerArgs(grammar_backend="llguidance")
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<function=get_weather>",
            "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "end": "</function>",
        },
        {"begin": "<function=get_time>", "schema": {"type": "object"}, "end": "</function>"},
    ],
    "triggers": ["<func", "<function="],
}
CITY_GBNF = """# xgrammar-style EBNF: comments, classes, bounded repetition, groups
root ::= city | city " is " status
city ::= "Paris" | "Rome" | [A-Z] [a-z]{2,8}
status ::= "the capital of " country ("!")?
country ::= "France" | "Italy"
"""


def _build(server_args: ServerArgs, case: TokenizerSetup, eos_token_ids: list[int] | None = None) -> GuidanceBackend:
    return GuidanceBackend(server_args, case.tokenizer, case.vocab_size, eos_token_ids or case.eos_token_ids)


@pytest.fixture(scope="module")
def backend(tokenizer_case: TokenizerSetup) -> Iterator[GuidanceBackend]:
    built = _build(SERVER_ARGS, tokenizer_case)
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def forbidden(tokenizer_case: TokenizerSetup) -> frozenset[int]:
    """Special ids other than the stop tokens, and the padding ids past the tokenizer's end."""
    padding = range(len(tokenizer_case.tokenizer), tokenizer_case.vocab_size)
    return (tokenizer_special_token_ids(tokenizer_case.tokenizer) - set(tokenizer_case.eos_token_ids)) | set(padding)


def compile_grammar(backend: GuidanceBackend, kind: str, spec: Any) -> BaseGrammarObject:
    value, _ = backend.get_cached_or_future_value(make_grammar_key(kind, spec))
    return value if isinstance(value, BaseGrammarObject) else value.result(timeout=60)


def compile_valid(backend: GuidanceBackend, kind: str, spec: Any) -> GuidanceGrammar:
    grammar = compile_grammar(backend, kind, spec)
    assert isinstance(grammar, GuidanceGrammar), grammar
    return grammar


def encode(case: TokenizerSetup, text: str) -> list[int]:
    return case.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def allowed(grammar: BaseGrammarObject, case: TokenizerSetup) -> set[int]:
    mask = grammar.allocate_vocab_mask(case.vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    return set(allowed_token_ids(mask[0], case.vocab_size).tolist())


KIND_CASES = [
    ("json", PERSON_SCHEMA, '{"name": "Ada", "age": 36}', '{"name": "Ada", "age": "36"}'),
    ("json_object", None, '{\n  "k": [1, 2.5, null]\n}', "[1, 2]"),
    ("regex", r"\d{3}-[a-z]+", "123-abc", "12-abc"),
    ("choice", ["red", "green"], "green", "blue"),
    ("ebnf", CITY_GBNF, "Paris is the capital of France!", "Paris is the capital of Spain"),
    ("ebnf", 'start: answer\nanswer: "yes" | "no"', "no", "maybe"),
    ("structural_tag", WEATHER_TAG, 'Hi <function=get_weather>{"city": "Oslo"}</function>', "<function=get_weather>{}"),
    ("structural_tag", WEATHER_TAG, 'A <function=get_time>{"tz": 1}</function>', '<function=get_weather>{"town": "x"}'),
]


@pytest.mark.parametrize(("kind", "spec", "valid", "invalid"), KIND_CASES)
def test_each_kind_walks_a_valid_text_and_refuses_an_invalid_one(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, forbidden: frozenset[int], kind, spec, valid, invalid
) -> None:
    case = tokenizer_case
    grammar = compile_valid(backend, kind, spec)
    assert walk_tokens(grammar, encode(case, valid), case.vocab_size, case.eos_token_ids, forbidden).is_accepted
    grammar.accept_token(case.eos_token_ids[0])
    assert grammar.is_terminated()
    refused = walk_tokens(grammar.copy(), encode(case, invalid), case.vocab_size, case.eos_token_ids, forbidden)
    assert not refused.is_accepted


def test_special_tokens_are_never_allowed_and_stop_tokens_only_at_the_end(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, forbidden: frozenset[int]
) -> None:
    grammar = compile_valid(backend, "json", {"type": "object", "properties": {"s": {"type": "string"}}})
    for token in encode(tokenizer_case, '{"s": "'):
        grammar.accept_token(token)
    inside_string = allowed(grammar, tokenizer_case)
    assert len(inside_string) > 1000
    assert not inside_string & (forbidden | set(tokenizer_case.eos_token_ids))
    special = min(forbidden)
    with pytest.raises(TokenRejectedError, match="special tokens are allowed only as a stop token"):
        grammar.accept_token(special)
    assert allowed(grammar, tokenizer_case) == inside_string
    for token in encode(tokenizer_case, 'x"}'):
        grammar.accept_token(token)
    assert allowed(grammar, tokenizer_case) == set(tokenizer_case.eos_token_ids)


def test_padding_bits_stay_zero_in_wider_rows_and_narrow_rows_are_refused(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "regex", r"(.|\n)*")
    num_words = -(-tokenizer_case.vocab_size // 32)
    wide = torch.full((2, num_words + 3), -1, dtype=torch.int32)
    grammar.fill_vocab_mask(wide, 1)
    ids = allowed_token_ids(wide[1], 32 * wide.shape[1])
    assert ids.max().item() < len(tokenizer_case.tokenizer)
    assert wide[0].eq(-1).all()
    with pytest.raises(ValueError, match="at least"):
        grammar.fill_vocab_mask(torch.zeros((1, num_words - 1), dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="int32"):
        grammar.fill_vocab_mask(torch.zeros((1, num_words), dtype=torch.int64), 0)


def test_every_stop_token_ends_the_grammar(smollm2_tokenizer: TokenizerSetup) -> None:
    """llguidance takes a list of EOS ids: each is allowed exactly where the grammar may end."""
    eos_ids = [smollm2_tokenizer.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    two_stops = _build(SERVER_ARGS, smollm2_tokenizer, eos_ids)
    grammar = compile_valid(two_stops, "regex", "a+")
    assert not allowed(grammar, smollm2_tokenizer) & set(eos_ids)
    grammar.accept_token(encode(smollm2_tokenizer, "aa")[0])
    assert set(eos_ids) <= allowed(grammar, smollm2_tokenizer)
    for eos in eos_ids:
        ended = grammar.copy()
        ended.accept_token(encode(smollm2_tokenizer, "a")[0])
        ended.accept_token(eos)
        assert ended.is_terminated()
    two_stops.shutdown()


WHITESPACE_TEXTS = ('{"a":1,"b":[1,2]}', '{"a": 1, "b": [1, 2]}', '{\n  "a": 1,\n  "b": [1, 2]\n}')


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, (True, True, True)),
        ({"constrained_json_disable_any_whitespace": True}, (True, False, False)),
        ({"constrained_json_whitespace_pattern": "[ ]?"}, (True, True, False)),
    ],
)
def test_json_whitespace_follows_the_server_flags(smollm2_tokenizer: TokenizerSetup, overrides, expected) -> None:
    variant = _build(replace(SERVER_ARGS, **overrides), smollm2_tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    grammar = compile_valid(variant, "json", schema)
    case = smollm2_tokenizer
    walked = [
        walk_tokens(grammar.copy(), encode(case, t), case.vocab_size, case.eos_token_ids) for t in WHITESPACE_TEXTS
    ]
    assert tuple(w.is_accepted for w in walked) == expected
    own_options = compile_valid(variant, "json", {**schema, "x-guidance": {"whitespace_pattern": "[ \\n]*"}})
    assert walk_tokens(own_options, encode(case, WHITESPACE_TEXTS[2]), case.vocab_size, case.eos_token_ids).is_accepted
    variant.shutdown()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"constrained_json_whitespace_pattern": "((", "constrained_json_disable_any_whitespace": True}, "conflict"),
        ({"constrained_json_whitespace_pattern": "(("}, "not a valid regex"),
    ],
)
def test_bad_whitespace_flags_are_refused_at_start(smollm2_tokenizer: TokenizerSetup, overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        _build(replace(SERVER_ARGS, **overrides), smollm2_tokenizer)


def test_the_registry_builds_this_backend_lazily(smollm2_tokenizer: TokenizerSetup) -> None:
    case = smollm2_tokenizer
    built = create_grammar_backend(SERVER_ARGS, case.tokenizer, case.vocab_size, case.eos_token_ids)
    assert isinstance(built, GuidanceBackend)
    built.shutdown()


SPECIAL_TRIGGERS = {"smollm2": "<|im_start|>", "qwen35": "<tool_call>"}


def test_a_trigger_spelled_like_a_special_token_is_matched_as_text(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, forbidden: frozenset[int]
) -> None:
    """The special token itself stays forbidden; the trigger's text, spelled by ordinary tokens, opens the tag."""
    trigger = SPECIAL_TRIGGERS[tokenizer_case.name]
    assert tokenizer_case.tokenizer.convert_tokens_to_ids(trigger) in forbidden
    tag = {"structures": [{"begin": trigger, "schema": PERSON_SCHEMA, "end": "</call>"}], "triggers": [trigger]}
    grammar = compile_valid(backend, "structural_tag", tag)
    text = f'Sure. {trigger}{{"name": "Ada", "age": 3}}</call>'
    case = tokenizer_case
    assert walk_tokens(grammar, encode(case, text), case.vocab_size, case.eos_token_ids, forbidden).is_accepted


def walked_masks(grammar: BaseGrammarObject, case: TokenizerSetup, tokens: list[int]) -> list[torch.Tensor]:
    """The mask before each token and after the last; ``grammar`` advances."""
    mask = grammar.allocate_vocab_mask(case.vocab_size, len(tokens) + 1, "cpu")
    for step, token in enumerate(tokens):
        grammar.fill_vocab_mask(mask, step)
        grammar.accept_token(token)
    grammar.fill_vocab_mask(mask, len(tokens))
    return list(mask)


def test_rollback_restores_every_earlier_mask(backend: GuidanceBackend, tokenizer_case: TokenizerSetup) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    tokens = encode(tokenizer_case, '{"name": "Bo", "age": 7}')
    masks = walked_masks(grammar, tokenizer_case, tokens)
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    grammar.accept_token(tokens[0])  # after termination: ignored, yet counted by rollback
    grammar.rollback(2)
    assert grammar.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(tokens) + 1)
    for step in range(len(tokens), -1, -1):
        assert torch.equal(walked_masks(grammar, tokenizer_case, [])[0], masks[step]), step
        if step:
            grammar.rollback(1)
    assert not grammar.is_terminated()


def test_copies_start_fresh_and_share_no_state(backend: GuidanceBackend, tokenizer_case: TokenizerSetup) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    start = allowed(grammar, tokenizer_case)
    tokens = encode(tokenizer_case, '{"name": "Bo"')
    for token in tokens:
        grammar.accept_token(token)
    advanced = allowed(grammar, tokenizer_case)
    copied = grammar.copy()
    assert allowed(copied, tokenizer_case) == start
    for token in encode(tokenizer_case, '{"name": "Zed'):
        copied.accept_token(token)
    assert allowed(grammar, tokenizer_case) == advanced
    key = make_grammar_key("json", PERSON_SCHEMA)
    backend.set_cache(key, grammar)
    cached, is_hit = backend.get_cached_or_future_value(key)
    assert is_hit and isinstance(cached, GuidanceGrammar) and allowed(cached, tokenizer_case) == start
    larger = compile_valid(backend, "json", {"allOf": [PERSON_SCHEMA, {"required": ["name"]}]})
    assert 0 < grammar.memory_size_bytes() < larger.memory_size_bytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_validate_tokens_agrees_with_accepting_and_changes_nothing(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, data: st.DataObject
) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    tokens = encode(tokenizer_case, '{"name": "Grace Hopper", "age": 85}') + tokenizer_case.eos_token_ids
    start = data.draw(st.integers(0, len(tokens)))
    noise = data.draw(st.lists(st.integers(-2, tokenizer_case.vocab_size + 2), max_size=3))
    for token in tokens[:start]:
        grammar.accept_token(token)
    before = allowed(grammar, tokenizer_case)
    draft = tokens[start : start + data.draw(st.integers(0, 6))] + noise
    num_valid = grammar.validate_tokens(draft)
    assert allowed(grammar, tokenizer_case) == before
    probe = grammar.copy()
    for token in tokens[:start] + draft[:num_valid]:
        probe.accept_token(token)
    if num_valid < len(draft) and not probe.is_terminated():
        with pytest.raises(TokenRejectedError):
            probe.accept_token(draft[num_valid])


JUMP_CASES = [
    ("json", PERSON_SCHEMA, '{"name": "Ada Lovelace", "age": 36}'),
    ("regex", r"Name: [A-Z][a-z]+, born (18|19)[0-9]{2}\.", "Name: Ada, born 1815."),
    ("json", {"type": "array", "items": {"enum": ["alpha-centauri", "beta"]}}, '["alpha-centauri", "beta"]'),
]


@pytest.mark.parametrize(("kind", "spec", "instance"), JUMP_CASES)
def test_jump_forward_text_is_what_the_instance_says_next(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, kind, spec, instance
) -> None:
    grammar = compile_valid(backend, kind, spec)
    instance_bytes = instance.encode()
    tokens = encode(tokenizer_case, instance)
    num_jumps = 0
    for step in range(len(tokens) + 1):
        helper = grammar.try_jump_forward(tokenizer_case.tokenizer)
        if helper is not None:
            num_jumps += 1
            ff_ids, text = helper
            assert grammar.jump_forward_str_state(helper) == (text, -1)
            done = tokenizer_case.tokenizer.decode(tokens[:step]).encode()
            forced = backend.ll_tokenizer.decode_bytes(ff_ids) + text.encode()
            assert instance_bytes[len(done) :].startswith(forced), (step, forced)
            assert_jump_then_finish(grammar.copy(), tokens[:step], helper, instance, tokenizer_case)
        if step < len(tokens):
            grammar.accept_token(tokens[step])
    assert num_jumps > 0


def assert_jump_then_finish(
    grammar: BaseGrammarObject, old_ids: list[int], helper: tuple[list[int], str], instance: str, case: TokenizerSetup
) -> None:
    """Take the jump as a scheduler does (append the ids, retokenise with the text), then finish the instance."""
    for token in old_ids:
        grammar.accept_token(token)
    ff_ids, _ = helper
    text = case.tokenizer.decode(old_ids + ff_ids) + grammar.jump_forward_str_state(helper)[0]
    assert instance.startswith(text)
    new_ids = encode(case, text)
    grammar.jump_and_retokenize(old_ids, new_ids, -1)
    walk = walk_tokens(grammar, encode(case, instance[len(text) :]), case.vocab_size, case.eos_token_ids)
    assert walk.is_accepted


def test_a_refused_retokenisation_leaves_the_state_unchanged(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    old_ids = encode(tokenizer_case, '{"name": "A')
    for token in old_ids:
        grammar.accept_token(token)
    before = allowed(grammar, tokenizer_case)
    with pytest.raises(TokenRejectedError, match="retokenised"):
        grammar.jump_and_retokenize(old_ids, encode(tokenizer_case, '{"age": "A'), -1)
    assert allowed(grammar, tokenizer_case) == before


def test_rejected_tokens_say_why_and_terminated_grammars_ignore_tokens(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "regex", "ab")
    with pytest.raises(TokenRejectedError, match="doesn't satisfy the grammar"):
        grammar.accept_token(encode(tokenizer_case, "b")[0])
    with pytest.raises(TokenRejectedError, match="outside the model's vocabulary"):
        grammar.accept_token(tokenizer_case.vocab_size)
    for token in encode(tokenizer_case, "ab"):
        grammar.accept_token(token)
    assert grammar.is_terminated()
    grammar.accept_token(encode(tokenizer_case, "b")[0])
    assert grammar.is_terminated()


LONG_DESCRIPTION = "a field described at great length " * 20
IGNORED_FEATURES = [
    ({"type": "string", "contentEncoding": "base64"}, '"!!!"', "contentEncoding"),
    ({"type": "string", "contentMediaType": "application/json"}, '"not json"', "contentMediaType"),
]


@pytest.mark.parametrize(("schema", "violating", "feature"), IGNORED_FEATURES)
def test_the_refusal_table_lists_what_llguidance_ignores(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, schema, violating, feature
) -> None:
    raw = LLMatcher(backend.ll_tokenizer, LLMatcher.grammar_from_json_schema(schema), log_level=0)
    assert raw.consume_tokens(encode(tokenizer_case, violating)) and raw.is_accepting()
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
    assert walk_tokens(grammar.copy(), encode(case, valid), case.vocab_size, case.eos_token_ids).is_accepted
    assert not walk_tokens(grammar, encode(case, violating), case.vocab_size, case.eos_token_ids).is_accepted


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
    ("structural_tag", {"type": "structural_tag", "format": {"type": "any_text"}}, "only the structures/triggers"),
    ("structural_tag", {"structures": [], "triggers": ["<f"]}, "non-empty 'structures'"),
    ("structural_tag", {**WEATHER_TAG, "triggers": ["<tool"]}, "structures[0]: its begin"),
    ("structural_tag", {**WEATHER_TAG, "triggers": []}, "non-empty 'triggers'"),
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
