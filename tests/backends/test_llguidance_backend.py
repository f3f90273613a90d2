"""The llguidance backend against both real tokenizers: every constraint kind, masks, stop tokens, whitespace,
structural tags. Grammar state: ``test_llguidance_state``; schema features and errors: ``..._schema_features``."""

from __future__ import annotations

import pytest
import torch
from llguidance.hf import from_tokenizer

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.llguidance.backend import GuidanceBackend, ll_tokenizer
from sglang_constrained.base_grammar_backend import (
    TokenRejectedError,
    create_grammar_backend,
)
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import PERSON_SCHEMA as OPEN_PERSON_SCHEMA
from tests.helpers import allowed_tokens, compile_valid
from triton_ops.bitmask_format import allowed_token_ids

SERVER_ARGS = GrammarArgs(grammar_backend="llguidance")
PERSON_SCHEMA = {**OPEN_PERSON_SCHEMA, "additionalProperties": False}
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


@pytest.fixture(scope="module")
def backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> GuidanceBackend:
    return build_backend("llguidance", tokenizer_case)


@pytest.fixture(scope="module")
def forbidden(tokenizer_case: TokenizerSetup) -> frozenset[int]:
    return tokenizer_case.forbidden_token_ids


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
    assert walk_tokens(grammar, case.encode(valid), case.vocab_size, case.eos_token_ids, forbidden).is_accepted
    grammar.accept_token(case.eos_token_ids[0])
    assert grammar.is_terminated()
    refused = walk_tokens(grammar.copy(), case.encode(invalid), case.vocab_size, case.eos_token_ids, forbidden)
    assert not refused.is_accepted


def test_special_tokens_are_never_allowed_and_stop_tokens_only_at_the_end(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, forbidden: frozenset[int]
) -> None:
    grammar = compile_valid(backend, "json", {"type": "object", "properties": {"s": {"type": "string"}}})
    for token in tokenizer_case.encode('{"s": "'):
        grammar.accept_token(token)
    inside_string = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert len(inside_string) > 1000
    assert not inside_string & (forbidden | set(tokenizer_case.eos_token_ids))
    special = min(forbidden)
    with pytest.raises(TokenRejectedError, match="special tokens are allowed only as a stop token"):
        grammar.accept_token(special)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == inside_string
    for token in tokenizer_case.encode('x"}'):
        grammar.accept_token(token)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == set(tokenizer_case.eos_token_ids)


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


def test_every_stop_token_ends_the_grammar(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> None:
    """llguidance takes a list of EOS ids: each is allowed exactly where the grammar may end."""
    eos_ids = [smollm2_tokenizer.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    two_stops = build_backend("llguidance", smollm2_tokenizer, eos_ids)
    grammar = compile_valid(two_stops, "regex", "a+")
    assert not allowed_tokens(grammar, smollm2_tokenizer.vocab_size) & set(eos_ids)
    grammar.accept_token(smollm2_tokenizer.encode("aa")[0])
    assert set(eos_ids) <= allowed_tokens(grammar, smollm2_tokenizer.vocab_size)
    for eos in eos_ids:
        ended = grammar.copy()
        ended.accept_token(smollm2_tokenizer.encode("a")[0])
        ended.accept_token(eos)
        assert ended.is_terminated()


WHITESPACE_TEXTS = ('{"a":1,"b":[1,2]}', '{"a": 1, "b": [1, 2]}', '{\n  "a": 1,\n  "b": [1, 2]\n}')


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, (True, True, True)),
        ({"constrained_json_disable_any_whitespace": True}, (True, False, False)),
        ({"constrained_json_whitespace_pattern": "[ ]?"}, (True, True, False)),
    ],
)
def test_json_whitespace_follows_the_server_flags(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, overrides, expected
) -> None:
    variant = build_backend("llguidance", smollm2_tokenizer, **overrides)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array"}}}
    grammar = compile_valid(variant, "json", schema)
    case = smollm2_tokenizer
    walked = [
        walk_tokens(grammar.copy(), case.encode(t), case.vocab_size, case.eos_token_ids) for t in WHITESPACE_TEXTS
    ]
    assert tuple(w.is_accepted for w in walked) == expected
    own_options = compile_valid(variant, "json", {**schema, "x-guidance": {"whitespace_pattern": "[ \\n]*"}})
    assert walk_tokens(own_options, case.encode(WHITESPACE_TEXTS[2]), case.vocab_size, case.eos_token_ids).is_accepted


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"constrained_json_whitespace_pattern": "((", "constrained_json_disable_any_whitespace": True}, "conflict"),
        ({"constrained_json_whitespace_pattern": "(("}, "not a valid regex"),
    ],
)
def test_bad_whitespace_flags_are_refused_at_start(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, overrides, message
) -> None:
    with pytest.raises(ValueError, match=message):
        build_backend("llguidance", smollm2_tokenizer, **overrides)


def test_the_registry_builds_this_backend_lazily(smollm2_tokenizer: TokenizerSetup) -> None:
    case = smollm2_tokenizer
    built = create_grammar_backend(SERVER_ARGS, case.tokenizer, case.vocab_size, case.eos_token_ids)
    assert built is not None and isinstance(built.backend, GuidanceBackend)
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
    tokens = case.encode(text, split_special_tokens=True)
    assert walk_tokens(grammar, tokens, case.vocab_size, case.eos_token_ids, forbidden).is_accepted


def test_its_tokenizer_is_the_one_llguidance_builds_from_the_hugging_face_tokenizer(
    smollm2_tokenizer: TokenizerSetup,
) -> None:
    """Built without ``from_tokenizer``'s copy of the Rust tokenizer: the same vocabulary size, stop tokens and bytes
    of every token, and the same tokenisation of text with special tokens, non-ASCII and control characters. (What
    is built is the same for any tokenizer: the same JSON text reaches ``LLTokenizer``; the 248k one would spend 6 s
    on ``from_tokenizer`` to show it again.)"""
    setup = smollm2_tokenizer
    ours = ll_tokenizer(setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    theirs = from_tokenizer(setup.tokenizer, n_vocab=setup.vocab_size, eos_token=list(setup.eos_token_ids))
    assert (ours.vocab_size, ours.eos_tokens) == (theirs.vocab_size, theirs.eos_tokens)
    every_token = range(setup.vocab_size)
    assert [ours.decode_bytes([t]) for t in every_token] == [theirs.decode_bytes([t]) for t in every_token]
    text = '<|im_start|>user\n{"é": "\t ok"} ünïcode 😀\x01<|im_end|>'
    assert ours.tokenize_str(text) == theirs.tokenize_str(text)
    assert [ours.is_special_token(t) for t in every_token] == [theirs.is_special_token(t) for t in every_token]
