"""An outlines grammar's state: rollback across an accepted stop token, copies that share only the index, and
validation that changes nothing."""

from __future__ import annotations

import pytest

from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import PERSON_SCHEMA, allowed_tokens, compile_valid

EMAIL_REGEX = r"[a-z]+@[a-z]+\.com"


@pytest.fixture(scope="module")
def smollm2_backend(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> OutlinesGrammarBackend:
    return build_backend("outlines", smollm2_tokenizer)


def test_rollback_across_an_accepted_stop_token(smollm2_tokenizer: TokenizerSetup, smollm2_backend):
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


def test_copy_starts_fresh_and_shares_only_the_index(smollm2_tokenizer: TokenizerSetup, smollm2_backend):
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


def test_validate_tokens_leaves_the_state_unchanged(smollm2_tokenizer: TokenizerSetup, smollm2_backend):
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
