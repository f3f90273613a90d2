"""Every change a decode step makes to its requests' grammar states, in one place: a token accepted for good
(``accept_token``: sampled, verified or forced), and tokens accepted to look ahead, then rolled back (``Lookahead``:
while drafts are proposed, and while the mask rows after each draft are filled). Nothing else in the scheduler calls
a grammar's ``accept_token`` or ``rollback``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from scheduler.io_struct import AbortCause
from scheduler.request import Abort, Req
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.errors import TokenRejectedError

logger = logging.getLogger(__name__)


def accept_token(req: Req, token: int, tokenizer: Any) -> Abort | None:
    """Feed ``token`` (already in ``req``'s output) to ``req``'s grammar, unless it has none or has terminated;
    returns why the request must fail where the grammar rejects the token or fails on it."""
    grammar = req.ready_grammar
    if grammar is None or grammar.is_terminated():
        return None
    kind = req.grammar_key[0] if req.grammar_key else "request's"
    try:
        grammar.accept_token(token)
    except TokenRejectedError as e:
        piece = tokenizer.decode([token])
        return Abort(AbortCause.GRAMMAR_ENGINE, f"token {token} ({piece!r}) was rejected by the {kind} grammar: {e}")
    except Exception as e:  # an engine failure must not take the other requests down
        logger.exception("request %s: the %s grammar failed on token %d", req.rid, kind, token)
        return Abort(AbortCause.GRAMMAR_ENGINE, f"the {kind} grammar failed on token {token}: {e}")
    return None


class Lookahead:
    """A context that advances ``grammar`` through tokens that may not stand, and on exit rolls it back to where it
    started. With no grammar (a free request) every token stands and nothing changes."""

    def __init__(self, grammar: BaseGrammarObject | None) -> None:
        self.grammar = grammar
        self.num_accepted = 0

    def __enter__(self) -> Lookahead:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self.grammar is not None:
            self.grammar.rollback(self.num_accepted)
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        return self.grammar is not None and self.grammar.is_terminated()

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts from here, one after another (its state does not change)."""
        if self.grammar is None or not tokens:
            return len(tokens)
        return self.grammar.validate_tokens(list(tokens))

    def advance(self, tokens: Sequence[int]) -> list[int]:
        """Accept the longest prefix of ``tokens`` the grammar allows; returns it."""
        valid = list(tokens[: self.num_valid(tokens)])
        for token in valid:
            self.accept(token)
        return valid

    def accept(self, token: int) -> None:
        """Accept ``token``; raises ``TokenRejectedError`` where the grammar does not allow it."""
        if self.grammar is not None:
            self.grammar.accept_token(token)
            self.num_accepted += 1

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Row ``idx`` of ``vocab_mask``: what the grammar allows after the tokens accepted so far."""
        if self.grammar is not None:
            self.grammar.fill_vocab_mask(vocab_mask, idx)
