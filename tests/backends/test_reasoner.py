"""Reasoning models: unconstrained while thinking, the grammar applies after ``</think>``, rollback crosses back."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, create_grammar_backend
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.reasoner_grammar_backend import (
    ReasonerGrammarBackend,
    ReasonerGrammarObject,
    think_end_token_id,
)
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import allowed_tokens

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
KEY = make_grammar_key("json", SCHEMA)


@pytest.fixture(scope="module")
def backend(qwen35_tokenizer: TokenizerSetup) -> Iterator[BaseGrammarBackend]:
    args = replace(ServerArgs(), reasoning_parser="qwen3")
    think_end = think_end_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    built = create_grammar_backend(
        args, qwen35_tokenizer.tokenizer, qwen35_tokenizer.vocab_size, qwen35_tokenizer.eos_token_ids, think_end
    )
    assert isinstance(built, ReasonerGrammarBackend)
    yield built
    built.shutdown()


def reasoner(backend: BaseGrammarBackend, require_reasoning: bool = True) -> ReasonerGrammarObject:
    value, _ = backend.get_cached_or_future_value(KEY, require_reasoning)
    grammar = value if isinstance(value, BaseGrammarObject) else value.result()
    assert isinstance(grammar, ReasonerGrammarObject)
    return grammar


def test_thinking_is_unconstrained_and_the_grammar_starts_after_think_end(
    backend: BaseGrammarBackend, qwen35_tokenizer: TokenizerSetup
) -> None:
    grammar = reasoner(backend)
    vocab = qwen35_tokenizer.vocab_size
    assert len(allowed_tokens(grammar, vocab)) == vocab  # the row is left all-allowed while thinking
    for token in qwen35_tokenizer.encode("Let me think: 6 times 7."):
        grammar.accept_token(token)
    grammar.accept_token(grammar.think_end_id)
    fresh = compile_grammar(backend, KEY)
    assert isinstance(fresh, ReasonerGrammarObject)
    fresh.maybe_init_reasoning(False)
    # the think-end token was not fed to the grammar
    assert allowed_tokens(grammar, vocab) == allowed_tokens(fresh, vocab)
    for token in qwen35_tokenizer.encode('{"answer": 42}'):
        grammar.accept_token(token)
    assert qwen35_tokenizer.eos_token_ids[0] in allowed_tokens(grammar, vocab)


def test_reasoning_off_starts_constrained(backend: BaseGrammarBackend, qwen35_tokenizer: TokenizerSetup) -> None:
    grammar = reasoner(backend, require_reasoning=False)
    allowed_at_start = allowed_tokens(grammar, qwen35_tokenizer.vocab_size)
    assert len(allowed_at_start) < 100 and grammar.think_end_id not in allowed_at_start


def test_rollback_crosses_back_into_thinking(backend: BaseGrammarBackend, qwen35_tokenizer: TokenizerSetup) -> None:
    grammar = reasoner(backend)
    vocab = qwen35_tokenizer.vocab_size
    thinking = qwen35_tokenizer.encode("Hmm, 42.")
    answer = qwen35_tokenizer.encode('{"answer": 4')
    for token in [*thinking, grammar.think_end_id, *answer]:
        grammar.accept_token(token)
    mask_in_answer = allowed_tokens(grammar, vocab)
    grammar.rollback(len(answer) + 2)  # the answer, the think-end token, and one thinking token
    assert grammar.is_thinking and len(allowed_tokens(grammar, vocab)) == vocab
    for token in [thinking[-1], grammar.think_end_id, *answer]:
        grammar.accept_token(token)
    assert allowed_tokens(grammar, vocab) == mask_in_answer
    with pytest.raises(ValueError, match="cannot roll back"):
        grammar.rollback(len(thinking) + len(answer) + 2)


def test_copy_keeps_the_counters_and_the_state(backend: BaseGrammarBackend, qwen35_tokenizer: TokenizerSetup) -> None:
    grammar = reasoner(backend)
    for token in [*qwen35_tokenizer.encode("ok"), grammar.think_end_id, *qwen35_tokenizer.encode('{"ans')]:
        grammar.accept_token(token)
    copied = grammar.copy()
    assert copied.tokens_after_think_end == grammar.tokens_after_think_end > 0
    assert copied.num_thinking_tokens == grammar.num_thinking_tokens
    assert allowed_tokens(copied, qwen35_tokenizer.vocab_size) == allowed_tokens(grammar, qwen35_tokenizer.vocab_size)
    for token in qwen35_tokenizer.encode('wer": 1}'):
        copied.accept_token(token)
    assert copied.is_terminated() is False and grammar.tokens_after_think_end < copied.tokens_after_think_end


def test_compiled_grammars_are_cached_unwrapped(backend: BaseGrammarBackend) -> None:
    backend.set_cache(KEY, reasoner(backend))
    with_reasoning, hit = backend.get_cached_or_future_value(KEY, require_reasoning=True)
    without, hit_again = backend.get_cached_or_future_value(KEY, require_reasoning=False)
    assert hit and hit_again
    assert isinstance(with_reasoning, ReasonerGrammarObject) and with_reasoning.is_thinking
    assert isinstance(without, ReasonerGrammarObject) and not without.is_thinking


def test_no_wrapping_without_a_think_end_token(smollm2_tokenizer: TokenizerSetup) -> None:
    assert think_end_token_id(smollm2_tokenizer.tokenizer, "qwen3") is None
    args = replace(ServerArgs(), reasoning_parser="qwen3")
    built = create_grammar_backend(
        args, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids, None
    )
    assert built is not None and not isinstance(built, ReasonerGrammarBackend)
    built.shutdown()


def test_unknown_reasoning_parser_is_refused(smollm2_tokenizer: TokenizerSetup) -> None:
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'nope'"):
        think_end_token_id(smollm2_tokenizer.tokenizer, "nope")
