"""Reasoning models: no constraint while the model thinks; the grammar starts after the think-end token.

The think-end token itself is never fed to the inner grammar; every token after it is. Rolling back across
the boundary re-enters the thinking phase. Compiled grammars are cached unwrapped, so requests with and
without reasoning share them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from sglang_constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    InvalidGrammarObject,
    common_prefix_length,
)
from sglang_constrained.compile_service import CompileControl, map_future
from sglang_constrained.constraint_spec import GrammarKey

THINKING = -1
"""``tokens_after_think_end`` while the model is still thinking."""


class ReasonerGrammarObject(BaseGrammarObject):
    """Gates an inner grammar on the think-end token.

    ``tokens_after_think_end`` is ``THINKING`` (-1) before the think-end token, 0 right after it (or from the
    start when reasoning is off), and ``k`` once the inner grammar has accepted ``k`` tokens.
    """

    def __init__(self, grammar: BaseGrammarObject, think_end_id: int, require_reasoning: bool = True) -> None:
        super().__init__()
        self.grammar = grammar
        self.think_end_id = think_end_id
        self.grammar_stats = grammar.grammar_stats
        self.starts_thinking = require_reasoning
        self.tokens_after_think_end = THINKING if require_reasoning else 0
        self.num_thinking_tokens = 0
        self._inner_tokens: list[int] = []

    @property
    def is_thinking(self) -> bool:
        return self.tokens_after_think_end == THINKING

    def maybe_init_reasoning(self, reasoning: bool) -> None:
        """Choose the start phase; only meaningful before the first token."""
        if self.num_thinking_tokens or self._inner_tokens or self.tokens_after_think_end > 0:
            raise ValueError("maybe_init_reasoning must be called before any token is accepted")
        self.starts_thinking = reasoning
        self.tokens_after_think_end = THINKING if reasoning else 0

    def accept_token(self, token: int) -> None:
        if self.is_thinking:
            self.num_thinking_tokens += 1
            if token == self.think_end_id:
                self.tokens_after_think_end = 0
            return
        self.grammar.accept_token(token)
        self._inner_tokens.append(token)
        self.tokens_after_think_end += 1

    def rollback(self, k: int) -> None:
        """Undo ``k`` tokens, crossing back over the think-end token into the thinking phase if needed."""
        if k < 0 or k > len(self._inner_tokens) + self.num_thinking_tokens:
            raise ValueError(f"cannot roll back {k} tokens: only {self.num_accepted} were accepted")
        num_inner = min(k, len(self._inner_tokens))
        if num_inner:
            self.grammar.rollback(num_inner)
            del self._inner_tokens[-num_inner:]
            self.tokens_after_think_end -= num_inner
        num_thinking = k - num_inner
        if num_thinking:
            self.num_thinking_tokens -= num_thinking
            self.tokens_after_think_end = THINKING

    @property
    def num_accepted(self) -> int:
        return self.num_thinking_tokens + len(self._inner_tokens)

    def is_terminated(self) -> bool:
        return not self.is_thinking and self.grammar.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Thinking leaves row ``idx`` as it is (the caller resets rows to all-allowed)."""
        if not self.is_thinking:
            self.grammar.fill_vocab_mask(vocab_mask, idx)

    def validate_tokens(self, tokens: list[int]) -> int:
        if not self.is_thinking:
            return self.grammar.validate_tokens(tokens)
        if self.think_end_id not in tokens:
            return len(tokens)
        boundary = tokens.index(self.think_end_id) + 1
        return boundary + self.grammar.validate_tokens(tokens[boundary:])

    def copy(self) -> ReasonerGrammarObject:
        """A clone: same phase and counters, the inner grammar replayed to the same state."""
        copied = ReasonerGrammarObject(self.grammar.copy(), self.think_end_id, self.starts_thinking)
        copied.tokens_after_think_end = self.tokens_after_think_end
        copied.num_thinking_tokens = self.num_thinking_tokens
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
        return None if self.is_thinking else self.grammar.try_jump_forward(tokenizer)

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return self.grammar.jump_forward_str_state(helper)

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Only valid after think-end: the ids are the inner grammar's tail of the output."""
        if self.is_thinking:
            raise ValueError("cannot jump forward while the model is thinking")
        common = common_prefix_length(old_output_ids, new_output_ids)
        self.rollback(len(old_output_ids) - common)
        for token in new_output_ids[common:]:
            self.accept_token(token)


class ReasonerGrammarBackend(BaseGrammarBackend):
    """Wraps another backend's grammars in ``ReasonerGrammarObject``.

    It shares the inner backend's compile service (one pool, one cache of unwrapped grammars), its mask layout
    and its name; compiling dispatches to the inner backend.
    """

    def __init__(self, grammar_backend: BaseGrammarBackend, think_end_id: int) -> None:
        super().__init__(
            grammar_backend.server_args, grammar_backend.vocab_size, compile_service=grammar_backend.compile_service
        )
        self.grammar_backend = grammar_backend
        self.think_end_id = think_end_id
        self.name = grammar_backend.name
        self.mask_layout = grammar_backend.mask_layout

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self.grammar_backend.dispatch_json(key_string)

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self.grammar_backend.dispatch_regex(key_string)

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self.grammar_backend.dispatch_ebnf(key_string)

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self.grammar_backend.dispatch_structural_tag(key_string)

    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        return self.grammar_backend.build_grammar(key, control)

    @property
    def can_share_grammars(self) -> bool:
        return self.grammar_backend.can_share_grammars

    def serialize_grammar(self, grammar: BaseGrammarObject) -> bytes | str:
        """The inner grammar's form (the cache and the exports hold unwrapped grammars)."""
        inner = grammar.grammar if isinstance(grammar, ReasonerGrammarObject) else grammar
        return self.grammar_backend.serialize_grammar(inner)

    def deserialize_grammar(self, payload: bytes | str) -> BaseGrammarObject:
        return self.grammar_backend.deserialize_grammar(payload)

    def wait_until_ready(self) -> None:
        self.grammar_backend.wait_until_ready()

    def shutdown(self) -> None:
        self.grammar_backend.shutdown()  # the shared compile service with it

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        self.grammar_backend.check_json_schema(schema)

    def get_cached_or_future_value(
        self, key: GrammarKey, require_reasoning: bool = False
    ) -> tuple[BaseGrammarObject | Future[BaseGrammarObject], bool]:
        value, cache_hit = super().get_cached_or_future_value(key, require_reasoning)
        if isinstance(value, Future):
            return map_future(value, lambda grammar: _wrap(grammar, self.think_end_id, require_reasoning)), cache_hit
        return _wrap(value, self.think_end_id, require_reasoning), cache_hit

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        """Cache the inner grammar at its start state, so that requests without reasoning share it."""
        inner = value.grammar.copy() if isinstance(value, ReasonerGrammarObject) else value
        super().set_cache(key, inner)


def _wrap(grammar: BaseGrammarObject, think_end_id: int, require_reasoning: bool) -> BaseGrammarObject:
    if isinstance(grammar, InvalidGrammarObject):
        return grammar
    return ReasonerGrammarObject(grammar, think_end_id, require_reasoning)


THINK_END_TOKENS = {"deepseek-r1": "</think>", "qwen3": "</think>", "qwen3-thinking": "</think>", "glm45": "</think>"}
"""The think-end token of each ``--reasoning-parser``."""


def think_end_token_id(tokenizer: Any, reasoning_parser: str | None) -> int | None:
    """The id of the parser's think-end token in ``tokenizer``, or None when off or the token does not exist."""
    if reasoning_parser is None:
        return None
    if reasoning_parser not in THINK_END_TOKENS:
        raise ValueError(f"unknown --reasoning-parser {reasoning_parser!r}; choose one of {sorted(THINK_END_TOKENS)}")
    token_id = tokenizer.convert_tokens_to_ids(THINK_END_TOKENS[reasoning_parser])
    return token_id if isinstance(token_id, int) and token_id != tokenizer.unk_token_id else None
