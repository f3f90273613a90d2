"""Reasoning models: unconstrained while thinking, the grammar applies after ``</think>``, rollback crosses back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.reasoner import (
    FreeGrammarObject,
    ReasonerGrammarBackend,
    ReasonerGrammarObject,
    reasoning_start,
    think_end_token_id,
    think_start_token_id,
)
from sglang_constrained.base_grammar_backend import BaseGrammarObject, create_grammar_backend
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.errors import TokenRejectedError
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import allowed_tokens

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
KEY = make_grammar_key("json", SCHEMA)


@pytest.fixture(scope="module")
def backend(qwen35_tokenizer: TokenizerSetup) -> Iterator[GrammarPipeline]:
    """The wrapper around xgrammar (``auto`` could pick llguidance for a compile slower than its hand-over, whose
    grammar ends at the closing brace where xgrammar's still takes whitespace)."""
    args = GrammarArgs(grammar_backend="xgrammar", reasoning_parser="qwen3")
    tokenizer = qwen35_tokenizer.tokenizer
    think_end, think_start = think_end_token_id(tokenizer, "qwen3"), think_start_token_id(tokenizer, "qwen3")
    built = create_grammar_backend(
        args, tokenizer, qwen35_tokenizer.vocab_size, qwen35_tokenizer.eos_token_ids, think_end, think_start
    )
    assert isinstance(built, ReasonerGrammarBackend)
    yield built
    built.shutdown()


def reasoner(backend: GrammarPipeline, require_reasoning: bool = True) -> ReasonerGrammarObject:
    value, _ = backend.get_cached_or_future_value(KEY, require_reasoning)
    grammar = value if isinstance(value, BaseGrammarObject) else value.result()
    assert isinstance(grammar, ReasonerGrammarObject)
    return grammar


def test_thinking_is_unconstrained_and_the_grammar_starts_after_think_end(
    backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup
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


def test_reasoning_off_starts_constrained(backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup) -> None:
    grammar = reasoner(backend, require_reasoning=False)
    allowed_at_start = allowed_tokens(grammar, qwen35_tokenizer.vocab_size)
    assert len(allowed_at_start) < 100 and grammar.think_end_id not in allowed_at_start


def test_rollback_crosses_back_into_thinking(backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup) -> None:
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


def test_copy_keeps_the_counters_and_the_state(backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup) -> None:
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


def test_compiled_grammars_are_cached_unwrapped(backend: GrammarPipeline) -> None:
    backend.set_cache(KEY, reasoner(backend))
    with_reasoning, hit = backend.get_cached_or_future_value(KEY, require_reasoning=True)
    without, hit_again = backend.get_cached_or_future_value(KEY, require_reasoning=False)
    assert hit and hit_again
    assert isinstance(with_reasoning, ReasonerGrammarObject) and with_reasoning.is_thinking
    assert isinstance(without, ReasonerGrammarObject) and not without.is_thinking


def test_no_wrapping_without_a_think_end_token(smollm2_tokenizer: TokenizerSetup) -> None:
    assert think_end_token_id(smollm2_tokenizer.tokenizer, "qwen3") is None
    args = GrammarArgs(reasoning_parser="qwen3")
    built = create_grammar_backend(
        args, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids, None
    )
    assert built is not None and not isinstance(built, ReasonerGrammarBackend)
    built.shutdown()


def test_unknown_reasoning_parser_is_refused(smollm2_tokenizer: TokenizerSetup) -> None:
    with pytest.raises(ValueError, match="unknown --reasoning-parser 'nope'"):
        think_end_token_id(smollm2_tokenizer.tokenizer, "nope")


def test_a_spent_budget_allows_the_think_end_alone_then_the_grammar(
    backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup
) -> None:
    grammar = reasoner(backend)
    grammar.set_reasoning("thinking", thinking_budget=3)
    vocab = qwen35_tokenizer.vocab_size
    thought = qwen35_tokenizer.encode("one two three four")
    for token in thought[:3]:
        assert len(allowed_tokens(grammar, vocab)) == vocab
        grammar.accept_token(token)
    assert allowed_tokens(grammar, vocab) == {grammar.think_end_id}  # a forced token
    with pytest.raises(TokenRejectedError, match="thinking budget of 3 tokens is spent"):
        grammar.accept_token(thought[3])
    assert grammar.validate_tokens([*thought[3:], grammar.think_end_id]) == 0
    answer = qwen35_tokenizer.encode('{"answer": 7}')
    assert grammar.validate_tokens([grammar.think_end_id, *answer]) == 1 + len(answer)
    grammar.accept_token(grammar.think_end_id)
    assert grammar.is_answering and len(allowed_tokens(grammar, vocab)) < 100
    grammar.rollback(2)  # back over the think-end token and one thinking token: the budget has room again
    assert grammar.is_thinking and len(allowed_tokens(grammar, vocab)) == vocab


def test_a_model_that_may_think_opens_its_thinking_or_answers_under_the_grammar(
    backend: GrammarPipeline, qwen35_tokenizer: TokenizerSetup
) -> None:
    think_start = think_start_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    vocab = qwen35_tokenizer.vocab_size
    grammar = reasoner(backend)
    grammar.set_reasoning("may_think", thinking_budget=2)
    answering = reasoner(backend, require_reasoning=False)
    assert allowed_tokens(grammar, vocab) == allowed_tokens(answering, vocab) | {think_start}
    answer = qwen35_tokenizer.encode('{"answer": 7}')
    assert grammar.validate_tokens(answer) == len(answer)
    assert grammar.validate_tokens(qwen35_tokenizer.encode("Hmm")) == 0  # free text only after <think>
    opened = grammar.copy()
    grammar.accept_token(answer[0])  # it answered at once: the grammar holds from the first token
    assert grammar.is_answering and grammar.num_reasoning_tokens == 0
    thought = qwen35_tokenizer.encode("a b c")
    assert opened.validate_tokens([think_start, *thought]) == 3  # <think> is not counted against the budget
    opened.accept_token(think_start)
    assert opened.is_thinking and len(allowed_tokens(opened, vocab)) == vocab
    for token in thought[:2]:
        opened.accept_token(token)
    assert allowed_tokens(opened, vocab) == {opened.think_end_id}
    opened.accept_token(opened.think_end_id)
    output = [think_start, *thought[:2], opened.think_end_id, answer[0]]
    opened.accept_token(answer[0])
    assert opened.split_output(output) == (thought[:2], [answer[0]])


def test_the_budget_forced_think_end_leads_a_jump_forward_run(
    build_backend: Any, qwen35_tokenizer: TokenizerSetup
) -> None:
    inner = build_backend("xgrammar", qwen35_tokenizer)
    think_end = think_end_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    assert think_end is not None
    compiled = inner.get_cached_or_future_value(make_grammar_key("regex", "ANSWER: (yes|no)"))[0]
    compiled = compiled if isinstance(compiled, BaseGrammarObject) else compiled.result()
    grammar = ReasonerGrammarObject(compiled, think_end, thinking_budget=0)
    assert grammar.try_jump_forward(qwen35_tokenizer.tokenizer) == ([think_end], "ANSWER: ")
    grammar.accept_token(think_end)
    assert grammar.try_jump_forward(qwen35_tokenizer.tokenizer) == ([], "ANSWER: ")


def test_a_free_request_gets_the_same_gate(qwen35_tokenizer: TokenizerSetup) -> None:
    think_end = think_end_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    assert think_end is not None
    grammar = ReasonerGrammarObject(FreeGrammarObject(), think_end, thinking_budget=1)
    vocab = qwen35_tokenizer.vocab_size
    grammar.accept_token(5)
    assert allowed_tokens(grammar, vocab) == {think_end}
    grammar.accept_token(think_end)
    assert len(allowed_tokens(grammar, vocab)) == vocab and not grammar.is_terminated()
    assert grammar.validate_tokens([1, 2, 3]) == 3


def test_the_prompt_says_where_the_output_starts(qwen35_tokenizer: TokenizerSetup) -> None:
    tokenizer = qwen35_tokenizer.tokenizer
    start, end = think_start_token_id(tokenizer, "qwen3"), think_end_token_id(tokenizer, "qwen3")
    assert start is not None and end is not None
    turn = qwen35_tokenizer.encode("<|im_start|>assistant\n")
    old_turn = [start, *qwen35_tokenizer.encode("earlier"), end, *qwen35_tokenizer.encode("an old answer")]

    def where(prompt: list[int]) -> str:
        return reasoning_start(prompt, start, end, "may_think", tokenizer)

    assert where([*turn, start, *qwen35_tokenizer.encode("\n")]) == "thinking"  # the template opened <think>
    assert where([*turn, start, *qwen35_tokenizer.encode("\n\n"), end, *qwen35_tokenizer.encode("\n\n")]) == (
        "answering"  # enable_thinking=False: an empty, closed block
    )
    assert where([*old_turn, *turn]) == "may_think"  # a closed block of an earlier turn decides nothing
    assert where(turn) == "may_think"
