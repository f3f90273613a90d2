"""One request's position in a compiled xgrammar grammar: its matcher, masks, rollback, jump-forward and state key."""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import xgrammar

from sglang_constrained.backends.base import (
    BaseGrammarObject,
    common_prefix_length,
)
from sglang_constrained.backends.xgrammar.parser_state import is_keyed_grammar, matcher_state_key
from sglang_constrained.errors import TokenRejectedError, bounded_message
from triton_ops.bitmask_format import set_token_bits, token_word_bits


class XGrammarGrammar(BaseGrammarObject):
    """One request's position in an xgrammar ``CompiledGrammar`` (a ``GrammarMatcher``); EOS is the stop token.

    A fill at the state of the previous fill copies that fill's row: a decode step fills a request's mask once to see
    whether the grammar forces its next token and again, unchanged, for the next forward's logits (a copy costs a
    small fraction of a fill). ``_version`` counts the changes of the matcher's state.

    Given the vocabulary's pieces (``decoded_vocab``, the bytes xgrammar's ``TokenizerInfo`` was built over) it keeps
    the bytes it accepted, and keys its state (``state_key``, see ``parser_state``)."""

    def __init__(
        self,
        compiled_grammar: xgrammar.CompiledGrammar,
        stop_token_ids: tuple[int, ...],
        decoded_vocab: Sequence[bytes] | None = None,
        *,
        is_keyed: bool | None = None,
    ) -> None:
        """``is_keyed``: ``parser_state.is_keyed_grammar`` of the compiled grammar where known (a copy passes it on),
        else worked out when a key is first asked for."""
        super().__init__()
        self.compiled_grammar = compiled_grammar
        self.stop_token_ids = stop_token_ids
        self._stop_word_bits = token_word_bits(stop_token_ids)
        self.matcher = xgrammar.GrammarMatcher(compiled_grammar, override_stop_tokens=list(stop_token_ids))
        self._version = 0
        self._last_fill: tuple[int, torch.Tensor] | None = None  # (version, the row the fill wrote)
        self._decoded_vocab = decoded_vocab
        self._is_keyed = is_keyed
        self._accepted = bytearray()  # the bytes of the accepted tokens, kept given decoded_vocab
        self._token_ends: list[int] = []  # len(self._accepted) after each accepted token

    def accept_token(self, token: int) -> None:
        """Advance by ``token``; a no-op once terminated. Raises ``TokenRejectedError`` for a disallowed token."""
        self._version += 1
        if not self._accept(token) and not self.matcher.is_terminated():
            raise TokenRejectedError(token)

    def _accept(self, token: int) -> bool:
        """The matcher's ``accept_token``, keeping the accepted bytes (a stop token has none)."""
        if not self.matcher.accept_token(token):
            return False
        if self._decoded_vocab is not None:
            if token not in self.stop_token_ids:
                self._accepted += self._decoded_vocab[token]
            self._token_ends.append(len(self._accepted))
        return True

    def rollback(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"cannot roll back {k} tokens")
        if k == 0:
            return
        self._version += 1
        try:
            self.matcher.rollback(k)
        except RuntimeError as e:
            raise ValueError(f"cannot roll back {k} tokens: {xgrammar_message(e)}") from e
        if self._decoded_vocab is not None:
            del self._token_ends[-k:]
            del self._accepted[self._token_ends[-1] if self._token_ends else 0 :]

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Fill row ``idx`` of the int32 CPU bitmask; once terminated only the stop tokens are allowed."""
        row = vocab_mask[idx]
        last = self._last_fill
        if last is not None and last[0] == self._version and last[1].shape == row.shape:
            row.copy_(last[1])
            return
        try:  # no termination check up front: it would cost a tenth of a fill
            self.matcher.fill_next_token_bitmask(vocab_mask, idx)
        except RuntimeError:
            if not self.matcher.is_terminated():
                raise
            row.zero_()
            set_token_bits(row, self._stop_word_bits)
        self._last_fill = (self._version, row.clone())

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled_grammar, self.stop_token_ids, self._decoded_vocab, is_keyed=self._is_keyed)

    def state_key(self) -> Hashable | None:
        """The parser's printed states, whether the root has completed and the bytes the open rules return to (exact:
        ``parser_state``); None without the vocabulary's pieces, for a grammar with budgets or token terminals, or
        where the printout is not what ``parser_state`` reads. The state does not change."""
        if self._decoded_vocab is None or not self._keyed():
            return None
        return matcher_state_key(self.matcher, self._accepted)

    def _keyed(self) -> bool:
        """Whether the grammar moves byte by byte with no budget or token terminal (worked out once)."""
        if self._is_keyed is None:
            self._is_keyed = is_keyed_grammar(self.compiled_grammar)
        return self._is_keyed

    def memory_size_bytes(self) -> int:
        return self.compiled_grammar.memory_size_bytes

    def validate_tokens(self, tokens: list[int]) -> int:
        """Length of the longest acceptable prefix of ``tokens``; the matcher ends where it started."""
        num_accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self._accept(token):
                break
            num_accepted += 1
        self.rollback(num_accepted)
        return num_accepted

    def accepts_to_end(self, tokens: Sequence[int]) -> bool | None:
        """Whether ``tokens`` take the grammar from here to its end: their bytes accepted as one string by a fork of
        the matcher, then the stop token if they end with one. For a keyed grammar (it moves byte by byte, with no
        budget or token terminal) that is the answer of accepting them one by one, at half the cost; None for other
        grammars, without the vocabulary's pieces, or for a special token that is not the last stop token (its piece
        is empty). The state does not change (``accept_string`` cannot be rolled back, hence the fork)."""
        if self._decoded_vocab is None or not tokens or not self._keyed():
            return None
        body = tokens[:-1] if tokens[-1] in self.stop_token_ids else tokens
        pieces = [self._decoded_vocab[token] if 0 <= token < len(self._decoded_vocab) else b"" for token in body]
        if not all(pieces):
            return None
        if self.matcher.is_terminated():
            return False
        fork = self.matcher.fork()
        if pieces and not fork.accept_string(b"".join(pieces)):
            return False
        if len(body) < len(tokens):
            return fork.accept_token(tokens[-1])
        return fork.is_terminated()

    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """``([], text)`` where ``text`` is what every continuation starts with; the caller tokenises it."""
        if self.matcher.is_terminated():
            return None
        text = self.matcher.find_jump_forward_string()
        return ([], text) if text else None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return helper[1], -1

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Move from ``old_output_ids`` to their retokenisation ``new_output_ids`` (which add the forced text).

        Rolls back to the common prefix and accepts the rest. If a new token is rejected the grammar is put
        back where it was and ``TokenRejectedError`` is raised.
        """
        common = common_prefix_length(old_output_ids, new_output_ids)
        self._version += 1
        self.rollback(len(old_output_ids) - common)
        for num_accepted, token in enumerate(new_output_ids[common:]):
            if not self._accept(token):
                self.rollback(num_accepted)
                for old_token in old_output_ids[common:]:
                    self._accept(old_token)
                raise TokenRejectedError(token, "the retokenised jump-forward text leaves the grammar")


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")


def xgrammar_message(error: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ file, failed check), first line, bounded."""
    lines = str(error).strip().splitlines()
    return bounded_message(_XGRAMMAR_LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__)
