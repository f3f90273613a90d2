"""Walk token ids through a grammar exactly as decoding does: fill the mask, check the token, accept it.

This is how the conformance suite checks a backend and how tests check that a model's output obeys its
grammar (for EBNF there is no other validator). Every step also checks the invariants a server relies on:
no special token and no padding id is ever allowed, and what the mask allows is what ``accept_token`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.errors import TokenRejectedError
from triton_ops.bitmask_format import allowed_token_ids, bitmask_from_token_ids, is_token_allowed


@dataclass(frozen=True)
class WalkResult:
    """``rejected_at`` is the index of the first token the mask disallowed (None if all were allowed)."""

    num_tokens: int
    rejected_at: int | None
    can_terminate: bool

    @property
    def is_accepted(self) -> bool:
        """Every token allowed and accepted, and the grammar can end right after them."""
        return self.rejected_at is None and self.can_terminate


class GrammarInvariantError(AssertionError):
    """The grammar broke a rule the server relies on (a forbidden token allowed, mask and accept disagreeing)."""


def walk_tokens(
    grammar: BaseGrammarObject,
    token_ids: list[int],
    vocab_size: int,
    stop_token_ids: list[int],
    forbidden_token_ids: frozenset[int] = frozenset(),
) -> WalkResult:
    """Feed ``token_ids`` to ``grammar`` (which advances) one by one, as a decoding loop would.

    ``forbidden_token_ids`` (special tokens other than the stop tokens, padding ids) must never be allowed;
    stop tokens may be allowed only where the grammar can end. Raises ``GrammarInvariantError`` otherwise.
    """
    mask = grammar.allocate_vocab_mask(vocab_size, 1, "cpu")
    forbidden = bitmask_from_token_ids(forbidden_token_ids, vocab_size)
    for index, token in enumerate(token_ids):
        _fill(grammar, mask, forbidden, vocab_size)
        if not is_token_allowed(mask[0], token):
            return WalkResult(len(token_ids), index, can_terminate=False)
        try:
            grammar.accept_token(token)
        except TokenRejectedError as e:
            raise GrammarInvariantError(f"token {token} at step {index} was allowed by the mask but rejected") from e
    if grammar.is_terminated():
        return WalkResult(len(token_ids), None, can_terminate=True)
    _fill(grammar, mask, forbidden, vocab_size)
    return WalkResult(len(token_ids), None, can_terminate=any(is_token_allowed(mask[0], t) for t in stop_token_ids))


def _fill(grammar: BaseGrammarObject, mask: torch.Tensor, forbidden: torch.Tensor, vocab_size: int) -> None:
    mask.fill_(0)
    grammar.fill_vocab_mask(mask, 0)
    leaked = mask[0, : forbidden.numel()] & forbidden
    if bool(leaked.any()):
        ids = allowed_token_ids(leaked, vocab_size).tolist()
        raise GrammarInvariantError(f"forbidden token ids allowed by the mask: {ids[:10]}")
