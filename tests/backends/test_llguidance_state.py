"""An llguidance grammar's state: rollback, copies, validation without advancing, termination, and jump-forward
(fast-forward tokens and forced text), on both real tokenizers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.base import BaseGrammarObject, TokenRejectedError
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.llguidance.grammar import GuidanceGrammar
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import PERSON_SCHEMA as OPEN_PERSON_SCHEMA
from tests.helpers import allowed_tokens, compile_valid

PERSON_SCHEMA = {**OPEN_PERSON_SCHEMA, "additionalProperties": False}


@pytest.fixture(scope="module")
def backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> GuidanceBackend:
    return build_backend("llguidance", tokenizer_case)


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
    tokens = tokenizer_case.encode('{"name": "Bo", "age": 7}')
    masks = walked_masks(grammar, tokenizer_case, tokens)
    assert not grammar.is_terminated(), "the closed object still needs its stop token, as on xgrammar"
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    grammar.accept_token(tokens[0])  # after termination: ignored, yet counted by rollback
    grammar.rollback(1)
    assert grammar.is_terminated()
    grammar.rollback(1)
    assert not grammar.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(tokens) + 1)
    for step in range(len(tokens), -1, -1):
        assert torch.equal(walked_masks(grammar, tokenizer_case, [])[0], masks[step]), step
        if step:
            grammar.rollback(1)
    assert not grammar.is_terminated()


def test_copies_start_fresh_and_share_no_state(backend: GuidanceBackend, tokenizer_case: TokenizerSetup) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    start = allowed_tokens(grammar, tokenizer_case.vocab_size)
    tokens = tokenizer_case.encode('{"name": "Bo"')
    for token in tokens:
        grammar.accept_token(token)
    advanced = allowed_tokens(grammar, tokenizer_case.vocab_size)
    copied = grammar.copy()
    assert allowed_tokens(copied, tokenizer_case.vocab_size) == start
    for token in tokenizer_case.encode('{"name": "Zed'):
        copied.accept_token(token)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == advanced
    key = make_grammar_key("json", PERSON_SCHEMA)
    backend.set_cache(key, grammar)
    cached, is_hit = backend.get_cached_or_future_value(key)
    assert is_hit and isinstance(cached, GuidanceGrammar) and allowed_tokens(cached, tokenizer_case.vocab_size) == start
    larger = compile_valid(backend, "json", {"allOf": [PERSON_SCHEMA, {"required": ["name"]}]})
    assert 0 < grammar.memory_size_bytes() < larger.memory_size_bytes()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_validate_tokens_agrees_with_accepting_and_changes_nothing(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup, data: st.DataObject
) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    tokens = tokenizer_case.encode('{"name": "Grace Hopper", "age": 85}') + tokenizer_case.eos_token_ids
    start = data.draw(st.integers(0, len(tokens)))
    noise = data.draw(st.lists(st.integers(-2, tokenizer_case.vocab_size + 2), max_size=3))
    for token in tokens[:start]:
        grammar.accept_token(token)
    before = allowed_tokens(grammar, tokenizer_case.vocab_size)
    draft = tokens[start : start + data.draw(st.integers(0, 6))] + noise
    num_valid = grammar.validate_tokens(draft)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == before
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
    tokens = tokenizer_case.encode(instance)
    num_jumps = 0
    for step in range(len(tokens) + 1):
        helper = grammar.try_jump_forward(tokenizer_case.tokenizer)
        if helper is not None:
            num_jumps += 1
            ff_ids, text = helper
            assert grammar.jump_forward_str_state(helper) == (text, -1)
            done = tokenizer_case.tokenizer.decode(tokens[:step]).encode()
            forced = backend.backend.ll_tokenizer.decode_bytes(ff_ids) + text.encode()
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
    new_ids = case.encode(text)
    grammar.jump_and_retokenize(old_ids, new_ids, -1)
    walk = walk_tokens(grammar, case.encode(instance[len(text) :]), case.vocab_size, case.eos_token_ids)
    assert walk.is_accepted


def test_a_refused_retokenisation_leaves_the_state_unchanged(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "json", PERSON_SCHEMA)
    old_ids = tokenizer_case.encode('{"name": "A')
    for token in old_ids:
        grammar.accept_token(token)
    before = allowed_tokens(grammar, tokenizer_case.vocab_size)
    with pytest.raises(TokenRejectedError, match="retokenised"):
        grammar.jump_and_retokenize(old_ids, tokenizer_case.encode('{"age": "A'), -1)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == before


def test_rejected_tokens_say_why_and_terminated_grammars_ignore_tokens(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "regex", "ab")
    b = tokenizer_case.encode("b")[0]
    with pytest.raises(TokenRejectedError, match="doesn't satisfy the grammar"):
        grammar.accept_token(b)
    with pytest.raises(TokenRejectedError, match="outside the model's vocabulary"):
        grammar.accept_token(tokenizer_case.vocab_size)
    for token in tokenizer_case.encode("ab"):
        grammar.accept_token(token)
    assert allowed_tokens(grammar, tokenizer_case.vocab_size) == set(tokenizer_case.eos_token_ids)
    assert not grammar.is_terminated()
    with pytest.raises(TokenRejectedError, match="only a stop token may follow"):
        grammar.accept_token(b)
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()
    grammar.accept_token(b)
    assert grammar.is_terminated()


def test_a_stop_token_where_the_grammar_may_go_on_ends_it_and_rolls_back(
    backend: GuidanceBackend, tokenizer_case: TokenizerSetup
) -> None:
    grammar = compile_valid(backend, "regex", "ab|abc")
    for token in tokenizer_case.encode("ab"):
        grammar.accept_token(token)
    before = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert set(tokenizer_case.eos_token_ids) < before and not grammar.is_terminated()
    assert grammar.validate_tokens(tokenizer_case.eos_token_ids[:1]) == 1
    grammar.accept_token(tokenizer_case.eos_token_ids[0])
    assert grammar.is_terminated()
    grammar.rollback(1)
    assert not grammar.is_terminated() and allowed_tokens(grammar, tokenizer_case.vocab_size) == before
