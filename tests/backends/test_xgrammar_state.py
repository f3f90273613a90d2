"""An xgrammar grammar's state: rollback, copies, validation without advancing, termination, and jump-forward
(forced text, retokenised at the boundary), on both real tokenizers."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.base import BaseGrammarObject, TokenRejectedError
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import allowed_tokens, compile_grammar, encode_exactly

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
EBNF = 'root ::= "SELECT " column " FROM t"\ncolumn ::= "a" | "bb"'


@pytest.fixture(scope="module")
def backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> XGrammarGrammarBackend:
    return build_backend("xgrammar", tokenizer_case)


def walked(backend: XGrammarGrammarBackend, setup: TokenizerSetup, kind: str, spec: Any, text: str):
    """A grammar that has accepted ``text`` (no stop token), and the masks seen before each token and at the end."""
    grammar, masks = compile_grammar(backend, kind, spec), []
    for token in encode_exactly(setup, text):
        masks.append(allowed_tokens(grammar, backend.backend.vocabulary.model_vocab_size))
        grammar.accept_token(token)
    masks.append(allowed_tokens(grammar, backend.backend.vocabulary.model_vocab_size))
    return grammar, masks


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_rollback_then_reaccept_gives_identical_masks(backend, tokenizer_case, data):
    text = '{"name": "Zoë O\'Neil", "age": 101}'
    grammar, masks = walked(backend, tokenizer_case, "json", PERSON_SCHEMA, text)
    ids = encode_exactly(tokenizer_case, text)
    k = data.draw(st.integers(0, len(ids)))
    grammar.rollback(k)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == masks[len(ids) - k]
    for step, token in enumerate(ids[len(ids) - k :], start=len(ids) - k):
        assert allowed_tokens(grammar, tokenizer_case.vocab_size) == masks[step]
        grammar.accept_token(token)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == masks[-1]


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_fill_repeated_at_one_state_matches_a_fresh_walk_whatever_came_between(backend, tokenizer_case, data):
    """A fill at the state of the previous fill reuses its row; accepts, rollbacks and validations between fills
    must never leave a stale row: every fill equals a fresh grammar's after the same tokens."""
    vocab_size = tokenizer_case.vocab_size
    grammar = compile_grammar(backend, "json", PERSON_SCHEMA)
    history: list[int] = []
    for _ in range(data.draw(st.integers(1, 12))):
        action = data.draw(st.sampled_from(["accept", "rollback", "validate", "fill"]))
        allowed = sorted(allowed_tokens(grammar, vocab_size))
        if action == "accept" and allowed and not grammar.is_terminated():
            token = data.draw(st.sampled_from(allowed))
            grammar.accept_token(token)
            history.append(token)
        elif action == "rollback" and history:
            k = data.draw(st.integers(1, len(history)))
            grammar.rollback(k)
            del history[-k:]
        elif action == "validate" and allowed:
            grammar.validate_tokens([data.draw(st.sampled_from(allowed)), data.draw(st.integers(0, vocab_size - 1))])
        fresh = grammar.copy()
        for token in history:
            fresh.accept_token(token)
        assert allowed_tokens(grammar, vocab_size) == allowed_tokens(fresh, vocab_size)


def test_rollback_past_the_start_is_a_value_error(backend, tokenizer_case):
    grammar, _ = walked(backend, tokenizer_case, "regex", r"[0-9]+", "12")
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(encode_exactly(tokenizer_case, "12")) + 1)
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(-1)


def test_copy_starts_fresh_on_the_same_compiled_grammar(backend, tokenizer_case):
    vocab_size = tokenizer_case.vocab_size
    grammar, masks = walked(backend, tokenizer_case, "json", PERSON_SCHEMA, '{"name": "Ada", ')
    copied = grammar.copy()
    assert copied.compiled_grammar is grammar.compiled_grammar
    assert copied.matcher is not grammar.matcher
    assert allowed_tokens(copied, vocab_size) == masks[0]
    for token in encode_exactly(tokenizer_case, '{"name": "Bob", "age": 7}'):
        copied.accept_token(token)
    copied.accept_token(tokenizer_case.eos_token_ids[0])
    assert copied.is_terminated() and not grammar.is_terminated()
    assert allowed_tokens(grammar, vocab_size) == masks[-1]
    assert grammar.memory_size_bytes() == copied.memory_size_bytes() > 0


@settings(max_examples=30, deadline=None)
@given(cut=st.integers(0, 40), junk=st.sampled_from(["", "x", "}", '"', " 1"]), start=st.integers(0, 6))
def test_validate_tokens_finds_longest_prefix_and_keeps_state(backend, tokenizer_case, cut, junk, start):
    text = '{"name": "Ada", "age": 36}'
    ids = encode_exactly(tokenizer_case, text)
    start = min(start, len(ids))
    grammar, _ = walked(backend, tokenizer_case, "json", PERSON_SCHEMA, "")
    for token in ids[:start]:
        grammar.accept_token(token)
    candidate = ids[start : start + cut] + encode_exactly(tokenizer_case, junk) + tokenizer_case.eos_token_ids
    before = allowed_tokens(grammar, tokenizer_case.vocab_size)
    num_valid = grammar.validate_tokens(candidate)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == before
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
    grammar, _ = walked(backend, tokenizer_case, "choice", ["yes", "no"], "yes")
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()
    grammar.accept_token(encode_exactly(tokenizer_case, "no")[0])
    allowed = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert allowed == set(tokenizer_case.eos_token_ids)
    assert grammar.try_jump_forward(tokenizer_case.tokenizer) is None
    assert grammar.validate_tokens(tokenizer_case.eos_token_ids) == 0


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
    build_backend, tokenizer_case, kind, spec, text, compact
):
    backend = build_backend("xgrammar", tokenizer_case, constrained_json_disable_any_whitespace=compact)
    tokenizer, vocab = tokenizer_case.tokenizer, backend.backend.vocabulary
    ids, grammar = encode_exactly(tokenizer_case, text), compile_grammar(backend, kind, spec)
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
            jumped.jump_and_retokenize(prefix_ids, encode_exactly(tokenizer_case, prefix + forced), state)
            rest = text[len(prefix) + len(forced) :]
            for token in encode_exactly(tokenizer_case, rest) if rest else []:
                jumped.accept_token(token)
            jumped.accept_token(tokenizer_case.eos_token_ids[0])
            assert jumped.is_terminated()
            num_jumps += 1
        if step < len(ids):
            grammar.accept_token(ids[step])
    assert num_jumps > 0


def test_jump_and_retokenize_restores_the_state_when_a_token_is_rejected(backend, tokenizer_case):
    closed_person = {**PERSON_SCHEMA, "additionalProperties": False}
    grammar, masks = walked(backend, tokenizer_case, "json", closed_person, '{"name": "Ada", ')
    old_ids = encode_exactly(tokenizer_case, '{"name": "Ada", ')
    new_ids = encode_exactly(tokenizer_case, '{"name": "Ada", "height"')
    with pytest.raises(TokenRejectedError):
        grammar.jump_and_retokenize(old_ids, new_ids, -1)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == masks[-1]
    for token in encode_exactly(tokenizer_case, '"age": 36}'):
        grammar.accept_token(token)


def test_jump_and_retokenize_rolls_back_a_non_canonical_prefix(backend, tokenizer_case):
    tokenizer, choices = tokenizer_case.tokenizer, ["Lyon, France", "Paris, France"]
    grammar = compile_grammar(backend, "choice", choices)
    old_ids = [token for char in "Ly" for token in encode_exactly(tokenizer_case, char)]  # one token per letter
    for token in old_ids:
        grammar.accept_token(token)
    helper = grammar.try_jump_forward(tokenizer)
    assert helper is not None
    forced, state = grammar.jump_forward_str_state(helper)
    assert forced == "on, France"
    new_ids = encode_exactly(tokenizer_case, "Ly" + forced)
    assert new_ids[: len(old_ids)] != old_ids, "the retokenisation must change an accepted token"
    grammar.jump_and_retokenize(old_ids, new_ids, state)
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()


NESTED = 'root ::= "a" X "b" | "c" X "ddd"\nX ::= "x" | "(" X ")"'


def key_after(backend: XGrammarGrammarBackend, setup: TokenizerSetup, kind: str, spec: Any, text: str) -> Any:
    grammar, _ = walked(backend, setup, kind, spec, text)
    return grammar.state_key()


def test_state_key_tells_apart_states_whose_parser_printouts_agree(backend, tokenizer_case):
    """After ``a((`` and ``c((`` xgrammar prints the same parser rows, but one ends ``x))b`` and the other
    ``x))ddd``: the keys differ. The same state reached through other nestings once closed, other bytes of a
    character class's run, or after a rollback and another tokenisation, has one key."""
    assert key_after(backend, tokenizer_case, "ebnf", NESTED, "a((") is not None
    assert key_after(backend, tokenizer_case, "ebnf", NESTED, "a((") != key_after(
        backend, tokenizer_case, "ebnf", NESTED, "c(("
    )
    closed = [key_after(backend, tokenizer_case, "ebnf", NESTED, text) for text in ("c(x)", "c((x))")]
    assert closed[0] is not None and closed[0] == closed[1]
    run = [key_after(backend, tokenizer_case, "regex", "a[0-9]*b", text) for text in ("a1", "a123")]
    assert run[0] is not None and run[0] == run[1]
    grammar, _ = walked(backend, tokenizer_case, "json", PERSON_SCHEMA, '{"name": "Al", "age": 7')
    key = grammar.state_key()
    grammar.rollback(len(encode_exactly(tokenizer_case, '{"name": "Al", "age": 7')))
    for byte in b'{"name": "Al", "age": 7':
        grammar.accept_token(backend.backend.vocabulary.decoded_vocab.index(bytes([byte])))
    assert grammar.state_key() == key


def one_token_at_a_time(grammar: BaseGrammarObject, tokens: list[int]) -> bool:
    """Whether ``tokens``, accepted one by one, take ``grammar`` to its end (the reference for ``accepts_to_end``)."""
    if grammar.validate_tokens(tokens) != len(tokens):
        return False
    for token in tokens:
        grammar.accept_token(token)
    terminated = grammar.is_terminated()
    grammar.rollback(len(tokens))
    return terminated


ENDS_TO_TEST = [
    ("json", PERSON_SCHEMA, '{"name": "Zoë O\'Neil", "age": 101}'),
    ("regex", r"(cat|dog)( and (cat|dog)){0,3}\.", "cat and dog and cat."),
    ("ebnf", EBNF, "SELECT bb FROM t"),
]


@pytest.mark.parametrize("kind,spec,text", ENDS_TO_TEST, ids=[case[0] for case in ENDS_TO_TEST])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_an_ending_accepted_as_one_string_is_accepted_token_by_token(backend, tokenizer_case, kind, spec, text, data):
    """``accepts_to_end`` (the tokens' bytes as one string, on a fork) answers as accepting them one by one does, on
    endings, their cut and extended forms, tokens that do not fit, and stop tokens, from any point of a walk; and the
    state does not change."""
    vocab_size = tokenizer_case.vocab_size
    ids = encode_exactly(tokenizer_case, text)
    grammar = compile_grammar(backend, kind, spec)
    taken = data.draw(st.integers(0, len(ids)))
    for token in ids[:taken]:
        grammar.accept_token(token)
    stop = tokenizer_case.eos_token_ids[0]
    pieces = backend.backend.vocabulary.decoded_vocab
    rest = ids[taken:]
    allowed = sorted(allowed_tokens(grammar, vocab_size))
    candidates = [[*rest, stop], rest, [*rest[:-1], stop], [stop]]
    candidates.append([data.draw(st.sampled_from(allowed)), *rest, stop])
    candidates.append([data.draw(st.integers(0, vocab_size - 1)), stop])
    candidates.append([*rest, data.draw(st.integers(0, vocab_size - 1))])
    before = allowed_tokens(grammar, vocab_size)
    for tokens in candidates:
        if not tokens:
            continue
        answer = grammar.accepts_to_end(tokens)
        body = tokens[:-1] if tokens[-1] == stop else tokens
        assert answer is not None or not all(pieces[t] for t in body), tokens  # None only for a special token
        if answer is not None:
            assert answer == one_token_at_a_time(grammar, tokens), tokens
        assert allowed_tokens(grammar, vocab_size) == before
