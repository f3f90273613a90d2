"""Reasoning models: no constraint while the model thinks; the grammar starts after the think-end token.

The think-end token itself is never fed to the inner grammar; every token after it is. Rolling back across
the boundary re-enters the thinking phase. A thinking budget makes the think-end token the only one allowed once
that many reasoning tokens are out. A model that may open its thinking itself (Qwen3's hybrids) is offered the
think-start token beside the grammar's first tokens: if it answers at once, the grammar holds from its first token.
Compiled grammars are cached unwrapped, so requests with and without reasoning share them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch

from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject, common_prefix_length
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.reasoning_formats import ReasoningStart, reasoning_format
from sglang_constrained.cache.compiled import CompiledGrammarStore, GrammarExport
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.futures import map_future
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.errors import TokenRejectedError
from triton_ops.bitmask_format import reset_rows, token_word_bits

THINKING = -1
"""``tokens_after_think_end`` while the model is still thinking (or may still open its thinking)."""


class ReasonerGrammarObject(BaseGrammarObject):
    """Gates an inner grammar on the think-end token, with an optional thinking budget.

    Phases: thinking (every token allowed; none is fed to the inner grammar), answering (the inner grammar's mask,
    every token fed to it), and at the first output token of a ``may_think`` start both at once: the inner grammar's
    tokens or the think-start token, which opens the thinking. Once ``thinking_budget`` reasoning tokens are out (the
    think-start token that opened a ``may_think`` output is not counted), the mask allows the think-end token alone:
    a forced token, which jump-forward appends and speculation drafts, so both stay exact.

    ``tokens_after_think_end`` is ``THINKING`` (-1) before the answer starts, and ``k`` once the inner grammar has
    accepted ``k`` tokens. ``num_reasoning_tokens`` counts the output tokens before the answer, tags included.
    """

    def __init__(
        self,
        grammar: BaseGrammarObject,
        think_end_id: int,
        require_reasoning: bool = True,
        think_start_id: int | None = None,
        thinking_budget: int | None = None,
    ) -> None:
        super().__init__()
        self.grammar = grammar
        self.think_end_id = think_end_id
        self.think_start_id = think_start_id
        self.grammar_stats = grammar.grammar_stats
        self.start: ReasoningStart = "thinking" if require_reasoning else "answering"
        self.thinking_budget = thinking_budget
        self._reasoning: list[int] = []
        self._inner_tokens: list[int] = []
        self._think_end_bits = token_word_bits([think_end_id])[0]

    @property
    def starts_thinking(self) -> bool:
        return self.start == "thinking"

    @property
    def is_undecided(self) -> bool:
        """At the first output token of a ``may_think`` start: the model may open its thinking or answer."""
        return self.start == "may_think" and not self._reasoning and not self._inner_tokens

    @property
    def is_thinking(self) -> bool:
        if self._inner_tokens or self.start == "answering" or self.is_undecided:
            return False
        return not self._reasoning or self._reasoning[-1] != self.think_end_id

    @property
    def is_answering(self) -> bool:
        return not self.is_thinking and not self.is_undecided

    @property
    def tokens_after_think_end(self) -> int:
        return len(self._inner_tokens) if self.is_answering else THINKING

    @property
    def num_thinking_tokens(self) -> int:
        return len(self._reasoning)

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens before the answer: the think block with its tags (all of the output while thinking)."""
        return len(self._reasoning)

    def split_output(self, output_ids: list[int]) -> tuple[list[int], list[int]]:
        """``output_ids`` (the tokens this grammar accepted, then any it did not see, such as a final stop token) as
        the reasoning without its think tags, and the answer."""
        num_reasoning = len(self._reasoning)
        tags = (self.think_start_id, self.think_end_id)
        return [t for t in output_ids[:num_reasoning] if t not in tags], output_ids[num_reasoning:]

    @property
    def num_budgeted_tokens(self) -> int:
        """Reasoning tokens the budget counts: all but the think-start token that opened a ``may_think`` output (and
        the think-end token, after which nothing is counted)."""
        return len(self._reasoning) - (self.start == "may_think" and bool(self._reasoning))

    @property
    def is_budget_spent(self) -> bool:
        """Thinking, with the budget spent: only the think-end token may come next."""
        return (
            self.is_thinking and self.thinking_budget is not None and self.num_budgeted_tokens >= self.thinking_budget
        )

    def maybe_init_reasoning(self, reasoning: bool) -> None:
        """Choose the start phase (thinking or answering); only meaningful before the first token."""
        self.set_reasoning("thinking" if reasoning else "answering", self.thinking_budget)

    def set_reasoning(self, start: ReasoningStart, thinking_budget: int | None) -> None:
        """Choose the start phase and the thinking budget (None: unlimited); only before the first token."""
        if self._reasoning or self._inner_tokens:
            raise ValueError("the reasoning phase must be set before any token is accepted")
        if thinking_budget is not None and thinking_budget < 0:
            raise ValueError(f"the thinking budget must be >= 0, got {thinking_budget}")
        self.start = start
        self.thinking_budget = thinking_budget

    def accept_token(self, token: int) -> None:
        if self.is_undecided and token == self.think_start_id:
            self._reasoning.append(token)
        elif self.is_thinking:
            if self.is_budget_spent and token != self.think_end_id:
                raise TokenRejectedError(token, f"the thinking budget of {self.thinking_budget} tokens is spent")
            self._reasoning.append(token)
        else:
            self.grammar.accept_token(token)
            self._inner_tokens.append(token)

    def rollback(self, k: int) -> None:
        """Undo ``k`` tokens, crossing back over the think-end token into the thinking phase if needed."""
        if k < 0 or k > len(self._inner_tokens) + len(self._reasoning):
            raise ValueError(f"cannot roll back {k} tokens: only {self.num_accepted} were accepted")
        num_inner = min(k, len(self._inner_tokens))
        if num_inner:
            self.grammar.rollback(num_inner)
            del self._inner_tokens[-num_inner:]
        del self._reasoning[len(self._reasoning) - (k - num_inner) :]

    @property
    def num_accepted(self) -> int:
        return len(self._reasoning) + len(self._inner_tokens)

    def is_terminated(self) -> bool:
        return self.is_answering and self.grammar.is_terminated()

    def state_key(self) -> Hashable | None:
        """The answer grammar's state key while answering (a search from there stays in the answer); None while
        thinking or undecided."""
        return self.grammar.state_key() if self.is_answering else None

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Thinking: every token (the row is reset), or the think-end token alone once the budget is spent;
        answering: the inner grammar's row; undecided: that row and the think-start token."""
        if self.is_budget_spent:
            word, bits = self._think_end_bits
            vocab_mask[idx].zero_()
            vocab_mask[idx, word] = bits
        elif self.is_thinking:
            reset_rows(vocab_mask, [idx])
        else:
            self.grammar.fill_vocab_mask(vocab_mask, idx)
            if self.is_undecided and self.think_start_id is not None:
                word, bits = token_word_bits([self.think_start_id])[0]
                vocab_mask[idx, word] |= bits

    def validate_tokens(self, tokens: list[int]) -> int:
        """The longest prefix the gate and then the inner grammar accept (the budget included); no state change."""
        i = 0
        if self.is_undecided:
            if not tokens or tokens[0] != self.think_start_id:
                return self.grammar.validate_tokens(tokens)
            i, spent = 1, 0
        elif self.is_thinking:
            spent = self.num_budgeted_tokens
        else:
            return self.grammar.validate_tokens(tokens)
        while i < len(tokens):
            token = tokens[i]
            if token == self.think_end_id:
                return i + 1 + self.grammar.validate_tokens(tokens[i + 1 :])
            if self.thinking_budget is not None and spent >= self.thinking_budget:
                return i
            spent += 1
            i += 1
        return i

    def copy(self) -> ReasonerGrammarObject:
        """A clone: same phase, budget and counters, the inner grammar replayed to the same state."""
        copied = ReasonerGrammarObject(
            self.grammar.copy(), self.think_end_id, True, self.think_start_id, self.thinking_budget
        )
        copied.start = self.start
        copied._reasoning = list(self._reasoning)
        for token in self._inner_tokens:
            copied.grammar.accept_token(token)
        copied._inner_tokens = list(self._inner_tokens)
        return copied

    def memory_size_bytes(self) -> int:
        return self.grammar.memory_size_bytes()

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: torch.device | str) -> torch.Tensor:
        return self.grammar.allocate_vocab_mask(vocab_size, batch_size, device)

    def move_vocab_mask(self, vocab_mask: torch.Tensor, device: torch.device | str) -> torch.Tensor:  # type: ignore[override]
        return self.grammar.move_vocab_mask(vocab_mask, device)

    def apply_vocab_mask(self, logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:  # type: ignore[override]
        self.grammar.apply_vocab_mask(logits, vocab_mask)

    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """Answering: the inner grammar's; with the budget spent: the think-end token, then what the inner grammar
        forces at its start (so that a draft runs across the boundary); else None."""
        if self.is_budget_spent:
            inner = self.grammar.try_jump_forward(tokenizer)
            return ([self.think_end_id, *inner[0]], inner[1]) if inner is not None else ([self.think_end_id], "")
        return self.grammar.try_jump_forward(tokenizer) if self.is_answering else None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return self.grammar.jump_forward_str_state(helper)

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Only valid after think-end: the ids are the inner grammar's tail of the output."""
        if not self.is_answering:
            raise ValueError("cannot jump forward while the model is thinking")
        common = common_prefix_length(old_output_ids, new_output_ids)
        self.rollback(len(old_output_ids) - common)
        for token in new_output_ids[common:]:
            self.accept_token(token)


class FreeGrammarObject(BaseGrammarObject):
    """No constraint: every token allowed, never terminated. The inner grammar of a free request that reasons, so
    that its think block is gated (budget, phase) like a constrained one's."""

    def __init__(self) -> None:
        super().__init__()
        self.num_accepted = 0

    def accept_token(self, token: int) -> None:
        self.num_accepted += 1

    def rollback(self, k: int) -> None:
        if not 0 <= k <= self.num_accepted:
            raise ValueError(f"cannot roll back {k} tokens: only {self.num_accepted} were accepted")
        self.num_accepted -= k

    def is_terminated(self) -> bool:
        return False

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        reset_rows(vocab_mask, [idx])

    def validate_tokens(self, tokens: list[int]) -> int:
        return len(tokens)

    def copy(self) -> FreeGrammarObject:
        return FreeGrammarObject()


class ReasonerGrammarBackend(GrammarPipeline):
    """Another pipeline whose grammars it hands out wrapped in ``ReasonerGrammarObject``.

    It shares the inner pipeline's backend, compile service (one pool, one cache of unwrapped grammars) and disk
    cache: compiles, exports and the disk cache see unwrapped grammars.
    """

    def __init__(self, grammar_backend: GrammarPipeline, think_end_id: int, think_start_id: int | None = None) -> None:
        super().__init__(grammar_backend.backend, compile_service=grammar_backend.compile_service)
        self.grammar_backend = grammar_backend
        self.disk_cache = grammar_backend.disk_cache
        self.think_end_id = think_end_id
        self.think_start_id = think_start_id

    def compile_or_load_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        return self.grammar_backend.compile_or_load_exportable(key, control)

    def use_disk_cache(self, disk_cache: CompiledGrammarStore) -> None:
        """The inner pipeline's: the disk cache holds unwrapped grammars, as the memory cache does."""
        self.grammar_backend.use_disk_cache(disk_cache)
        self.disk_cache = disk_cache

    def export_grammar(self, grammar: BaseGrammarObject) -> GrammarExport:
        """The inner grammar's export (the cache and the exports hold unwrapped grammars)."""
        inner = grammar.grammar if isinstance(grammar, ReasonerGrammarObject) else grammar
        return self.grammar_backend.export_grammar(inner)

    def shutdown(self) -> None:
        self.grammar_backend.shutdown()  # the shared compile service with it

    def get_cached_or_future_value(
        self, key: GrammarKey, require_reasoning: bool = False
    ) -> tuple[BaseGrammarObject | Future[BaseGrammarObject], bool]:
        value, cache_hit = super().get_cached_or_future_value(key, require_reasoning)
        if isinstance(value, Future):
            return map_future(value, lambda grammar: self._wrap(grammar, require_reasoning)), cache_hit
        return self._wrap(value, require_reasoning), cache_hit

    def _wrap(self, grammar: BaseGrammarObject, require_reasoning: bool) -> BaseGrammarObject:
        if isinstance(grammar, InvalidGrammarObject):
            return grammar
        return ReasonerGrammarObject(grammar, self.think_end_id, require_reasoning, self.think_start_id)

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        """Cache the inner grammar at its start state, so that requests without reasoning share it."""
        inner = value.grammar.copy() if isinstance(value, ReasonerGrammarObject) else value
        super().set_cache(key, inner)


def think_end_token_id(tokenizer: Any, reasoning_parser: str | None) -> int | None:
    """The id of the parser's think-end token in ``tokenizer``, or None when off or the token does not exist."""
    if reasoning_parser is None:
        return None
    return _token_id(tokenizer, reasoning_format(reasoning_parser).think_end)


def think_start_token_id(tokenizer: Any, reasoning_parser: str | None) -> int | None:
    """The id of the parser's think-start token in ``tokenizer``, or None when off or the token does not exist."""
    if reasoning_parser is None:
        return None
    return _token_id(tokenizer, reasoning_format(reasoning_parser).think_start)


def _token_id(tokenizer: Any, token: str) -> int | None:
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None


def reasoning_start(
    prompt_ids: list[int], think_start_id: int | None, think_end_id: int, default: ReasoningStart, tokenizer: Any
) -> ReasoningStart:
    """Where the output of ``prompt_ids`` starts: ``thinking`` if the prompt's last think tag opens a block (a chat
    template that opens ``<think>`` for the model), ``answering`` if it ends with a closed block and nothing but
    whitespace after it (a template turning thinking off, as Qwen3's ``enable_thinking=False``), else ``default``."""
    last_start = _last_index(prompt_ids, think_start_id)
    last_end = _last_index(prompt_ids, think_end_id)
    if last_start > last_end:
        return "thinking"
    if last_end >= 0 and not tokenizer.decode(prompt_ids[last_end + 1 :]).strip():
        return "answering"
    return default


def _last_index(ids: list[int], token: int | None) -> int:
    if token is None:
        return -1
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
