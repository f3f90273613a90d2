"""One request's position in an llguidance grammar: its matcher, masks written through row addresses, rollback and
fast-forward."""

from __future__ import annotations

import ctypes
import re
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLMatcher, LLTokenizer

from sglang_constrained.backends.base import (
    BaseGrammarObject,
    common_prefix_length,
)
from sglang_constrained.backends.bitmask_rows import BitmaskRowAddresser
from sglang_constrained.errors import TokenRejectedError, bounded_message
from triton_ops.bitmask_format import words_per_row

if TYPE_CHECKING:
    pass  # a TypedDict that exists only in llguidance's stub

_SOURCE_ECHO = re.compile(r"^\d+ \|")


class GuidanceGrammar(BaseGrammarObject):
    """The state of one request: an ``LLMatcher`` plus the bookkeeping llguidance leaves to its caller.

    The grammar terminates on a stop token, as xgrammar's and outlines' do: where llguidance's matcher has stopped
    (it can take nothing but a stop token) the stop token is still to come, so that an output is the same tokens
    whichever backend ``auto`` chose for it. That stop token, and any after it, are not fed to the matcher
    (llguidance drops a stop token that follows a stopped state from its history, so rolling it back would undo a
    real token); they are counted so that ``rollback`` stays exact. A rejected token leaves the state unchanged.
    """

    def __init__(self, ll_tokenizer: LLTokenizer, grammar: str, template: LLMatcher) -> None:
        super().__init__()
        self._ll_tokenizer = ll_tokenizer
        self._grammar = grammar
        self._template = template
        self._matcher = template.deep_copy()
        self._vocab_size = ll_tokenizer.vocab_size
        self._rows = BitmaskRowAddresser(words_per_row(ll_tokenizer.vocab_size), "llguidance")
        self._stop_token_ids = frozenset(ll_tokenizer.eos_tokens)
        self._num_consumed = 0
        self._num_ignored = 0
        self._terminated_at: int | None = None
        """How many tokens were accepted when a stop token ended the grammar (None: it has not ended)."""

    def accept_token(self, token: int) -> None:
        """Advance by ``token``; raises ``TokenRejectedError`` (state unchanged) if the grammar disallows it."""
        if not 0 <= token < self._vocab_size:
            raise TokenRejectedError(token, f"outside the model's vocabulary of {self._vocab_size} ids")
        if self._terminated_at is not None:  # after the end: ignored, yet counted by rollback
            self._num_ignored += 1
            return
        if self._awaits_stop():  # a stopped matcher consumes nothing, not even the stop token it allows
            if token not in self._stop_token_ids:
                raise TokenRejectedError(token, "the grammar has ended: only a stop token may follow")
            self._num_ignored += 1
            self._terminated_at = self._num_accepted
            return
        if self._matcher.try_consume_tokens([token]) == 1:  # one call: refuses without entering the error state
            self._num_consumed += 1
            if token in self._stop_token_ids and self._matcher.is_stopped():
                self._terminated_at = self._num_accepted
            return
        if self._matcher.is_error():  # only resource limits get here; the matcher stays in error
            raise TokenRejectedError(token, clean_message(self._matcher.get_error()))
        raise TokenRejectedError(token, self._rejection_reason(token))

    def rollback(self, k: int) -> None:
        if not 0 <= k <= self._num_accepted:
            raise ValueError(f"cannot roll back {k} tokens: {self._num_accepted} were accepted")
        num_ignored = min(k, self._num_ignored)
        self._num_ignored -= num_ignored
        if k > num_ignored:
            self._matcher.rollback(k - num_ignored)
            self._num_consumed -= k - num_ignored
        if self._terminated_at is not None and self._num_accepted < self._terminated_at:
            self._terminated_at = None

    @property
    def _num_accepted(self) -> int:
        return self._num_consumed + self._num_ignored

    def is_terminated(self) -> bool:
        """True once a stop token was accepted where the grammar may end."""
        return self._terminated_at is not None

    def _awaits_stop(self) -> bool:
        """Whether the grammar can take nothing but a stop token (llguidance's matcher has stopped before one)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write row ``idx`` of a CPU int32 ``[batch, words]`` bitmask; words past the model's vocab are zeroed.

        The row is addressed by pointer arithmetic (``BitmaskRowAddresser``): taking a row view costs more than
        llguidance's own mask for many states.
        """
        address = self._rows.row_address(vocab_mask, idx)
        num_mask_bytes = self._rows.min_words * 4
        if self._rows.row_words > self._rows.min_words:
            ctypes.memset(address + num_mask_bytes, 0, (self._rows.row_words - self._rows.min_words) * 4)
        self._matcher.unsafe_compute_mask_ptr(address, num_mask_bytes)
        if self._matcher.is_error():
            raise ValueError(f"llguidance could not compute the mask: {clean_message(self._matcher.get_error())}")

    def copy(self) -> GuidanceGrammar:
        return GuidanceGrammar(self._ll_tokenizer, self._grammar, self._template)

    @property
    def grammar_text(self) -> str:
        """The llguidance grammar this object walks (as validated when it was compiled)."""
        return self._grammar

    def validate_tokens(self, tokens: list[int]) -> int:
        in_range = next((i for i, t in enumerate(tokens) if not 0 <= t < self._vocab_size), len(tokens))
        if not in_range:
            return 0
        if self._terminated_at is None and self._awaits_stop():  # a stopped matcher validates nothing
            return int(tokens[0] in self._stop_token_ids)
        return self._matcher.validate_tokens(tokens[:in_range])

    def memory_size_bytes(self) -> int:
        """An estimate: 32 bytes per character of the serialised grammar.

        llguidance reports no sizes; building 200 matchers from JSON schemas of 5-200 properties grew the resident
        memory by 27-37 bytes per grammar character each. The shared tokenizer is not counted.
        """
        return 32 * len(self._grammar)

    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """``(token_ids, text)``: forced tokens to append as they are, then the forced text that follows them.

        ``token_ids`` are llguidance's fast-forward tokens (safe to take without retokenising); ``text`` is the
        rest of the forced bytes, up to the last complete UTF-8 character, to be retokenised with the output.
        """
        if self.is_terminated():
            return None
        token_ids = self._matcher.compute_ff_tokens()
        forced = self._matcher.compute_ff_bytes()
        head = self._ll_tokenizer.decode_bytes(token_ids)
        text = _utf8_prefix(forced[len(head) :]) if forced.startswith(head) else ""
        return (token_ids, text) if token_ids or text else None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return helper[1], -1

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Roll back to the common prefix and accept the rest of ``new_output_ids``.

        Raises ``TokenRejectedError`` with the state unchanged if the grammar disallows the new ids.
        """
        common = common_prefix_length(old_output_ids, new_output_ids)
        self.rollback(len(old_output_ids) - common)
        suffix = new_output_ids[common:]
        num_valid = len(suffix) if self.is_terminated() else self.validate_tokens(suffix)
        if num_valid < len(suffix):
            for token in old_output_ids[common:]:
                self.accept_token(token)
            bad = suffix[num_valid]
            raise TokenRejectedError(bad, f"retokenised output id {common + num_valid} is not allowed here")
        for token in suffix:
            self.accept_token(token)

    def _rejection_reason(self, token: int) -> str:
        if self._ll_tokenizer.is_special_token(token):
            return "special tokens are allowed only as a stop token where the grammar may end"
        probe = self._matcher.deep_copy()
        probe.consume_token(token)
        return clean_message(probe.get_error())

    def __repr__(self) -> str:
        return f"GuidanceGrammar(consumed={self._num_consumed}, terminated={self.is_terminated()})"


def clean_message(text: str) -> str:
    """An llguidance message on one line, without its source echoes and caret lines, bounded in length."""
    lines = (line.strip() for line in text.splitlines())
    kept = [s for s in lines if s and s != "<non-verbose/>" and not _SOURCE_ECHO.match(s) and set(s) != {"^"}]
    return bounded_message("\n".join(kept), first_line_only=False)


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of ``data`` that is complete UTF-8, decoded."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")
