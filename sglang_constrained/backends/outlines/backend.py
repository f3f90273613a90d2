"""The outlines grammar backend: outlines-core's token index over a regex (JSON schemas become regexes first).

outlines-core speaks regex only: EBNF and structural tags are refused as unsupported. Facts about
outlines-core 0.2.14 this module is built around (timings in docs/benchmarks.md):

* ``Guide.advance(eos)`` raises even at a final state, so stop tokens are handled here, never given to the Guide.
* Building an ``Index`` releases the GIL; it grows with the vocabulary, and ``{"type": "object"}`` (what
  ``json_object`` lowers to) takes seconds to tens of seconds.
* A string length bound makes the automaton double with every character, so bounds above
  ``OUTLINES_MAX_STRING_LENGTH_BOUND`` are refused up front.
* The index drops a token that ends one byte past a point where the text already matches the whole regex
  and does not itself complete a match (so ``1(\\.5)?`` cannot take the token ``.`` after ``1``; ``.5`` is fine).
  Such texts stay reachable only through other tokenisations.
* Alternations follow leftmost-first semantics: in ``a|a!`` the match ends at ``a`` and ``a!`` is refused.
  Choice constraints list longer options first for this reason (``choices_to_regex``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import outlines_core
import torch
from outlines_core.json_schema import build_regex_from_schema

from sglang_constrained.backends.base import BaseGrammarBackend, BaseGrammarObject, GrammarBackendArgs
from sglang_constrained.backends.bitmask_rows import BitmaskRowAddresser
from sglang_constrained.backends.outlines.schema_rules import outlines_narrowing, refuse_outlines_unsupported
from sglang_constrained.cache.identity import engine_version
from sglang_constrained.cache.per_tokenizer import per_tokenizer
from sglang_constrained.cache.vocabulary import TokenizerVocabulary, tokenizer_vocabulary, vocabulary_fingerprint
from sglang_constrained.errors import GrammarSpecError, TokenRejectedError, bounded_message
from sglang_constrained.schema.whitespace import OUTLINES_JSON_WHITESPACE_PATTERN, json_whitespace_pattern
from triton_ops.bitmask_format import allocate_bitmask, set_token_bits, token_word_bits, words_per_row

MAX_ROLLBACK_TOKENS = 200


@dataclass(frozen=True)
class OutlinesCompiledGrammar:
    """An outlines-core index with what every grammar object over it needs; shared by all copies.

    ``eos_mask_words`` maps a bitmask word to the bits of every stop token; ``extra_eos_mask_words`` the same
    for the stop tokens outlines-core does not know (it knows one, ``Vocabulary``'s EOS).
    """

    index: outlines_core.Index
    eos_token_ids: frozenset[int]
    eos_mask_words: tuple[tuple[int, int], ...]
    extra_eos_mask_words: tuple[tuple[int, int], ...]
    num_mask_words: int
    num_bytes: int


class OutlinesGrammar(BaseGrammarObject):
    """One request's walk over an outlines-core index: a ``Guide`` plus whether a stop token was accepted."""

    def __init__(self, compiled: OutlinesCompiledGrammar) -> None:
        super().__init__()
        self.compiled = compiled
        self._guide = outlines_core.Guide(compiled.index, max_rollback=MAX_ROLLBACK_TOKENS)
        self._is_terminated = False
        self._rows = BitmaskRowAddresser(compiled.num_mask_words, "outlines")

    def accept_token(self, token: int) -> None:
        if self._is_terminated:
            raise TokenRejectedError(token, "the grammar has already accepted a stop token")
        if token in self.compiled.eos_token_ids:
            if not self._guide.is_finished():
                raise TokenRejectedError(token, "a stop token before the output matches the grammar")
            self._is_terminated = True
            return
        try:  # outlines-core leaves the state unchanged when it refuses a token
            self._guide.advance(token, return_tokens=False)
        except (ValueError, OverflowError):
            raise TokenRejectedError(token) from None

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (a stop token counts as one); raises ``ValueError`` beyond history."""
        if k < 0:
            raise ValueError(f"cannot roll back a negative number of tokens ({k})")
        num_guide_steps = k - 1 if self._is_terminated and k > 0 else k
        num_kept = self._guide.get_allowed_rollback()
        if num_guide_steps > num_kept:
            raise ValueError(
                f"cannot roll back {k} tokens: only {num_kept + self._is_terminated} are kept "
                f"(at most {MAX_ROLLBACK_TOKENS} before a stop token)"
            )
        if k > 0:
            self._is_terminated = False
        if num_guide_steps > 0:
            self._guide.rollback_state(num_guide_steps)

    def is_terminated(self) -> bool:
        return self._is_terminated

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """An all-allowed int32 bitmask on the CPU whatever ``device`` is: outlines-core fills host memory, and
        ``move_vocab_mask`` takes the filled mask to the device (as SGLang does)."""
        return allocate_bitmask(batch_size, vocab_size, "cpu")

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Overwrite row ``idx`` of a contiguous int32 CPU bitmask; stop tokens are set only at final states."""
        compiled = self.compiled
        address = self._rows.row_address(vocab_mask, idx)
        if self._is_terminated:
            row = vocab_mask[idx]
            row.zero_()
            set_token_bits(row, compiled.eos_mask_words)
            return
        # outlines-core writes every word of the row: tokens it does not know (special, padding) become 0.
        self._guide.write_mask_into(address, self._rows.row_words, 4)
        if compiled.extra_eos_mask_words and self._guide.is_finished():
            set_token_bits(vocab_mask[idx], compiled.extra_eos_mask_words)

    def copy(self) -> OutlinesGrammar:
        return OutlinesGrammar(self.compiled)

    def state_key(self) -> tuple[int, bool]:
        """The index's DFA state and whether a stop token was accepted: the whole state of a walk."""
        return self._guide.get_state(), self._is_terminated

    def validate_tokens(self, tokens: list[int]) -> int:
        if self._is_terminated:
            return 0
        index = self.compiled.index
        state: int | None = self._guide.get_state()
        for num_valid, token in enumerate(tokens):
            if token in self.compiled.eos_token_ids:
                return num_valid + 1 if index.is_final_state(state) else num_valid
            state = index.get_next_state(state, token)
            if state is None:
                return num_valid
        return len(tokens)

    def memory_size_bytes(self) -> int:
        """The index's serialised size, measured once at compile time (serialising holds the GIL); its resident size
        is of that order."""
        return self.compiled.num_bytes


class OutlinesGrammarBackend(BaseGrammarBackend):
    """JSON schemas and regexes compiled to outlines-core indexes over one shared ``Vocabulary``."""

    name = "outlines"

    def __init__(
        self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        super().__init__(server_args, vocab_size)
        self.whitespace_pattern = json_whitespace_pattern(
            server_args.constrained_json_whitespace_pattern,
            server_args.constrained_json_disable_any_whitespace,
            OUTLINES_JSON_WHITESPACE_PATTERN,
        )
        if any(not 0 <= token < vocab_size for token in eos_token_ids):
            raise ValueError(f"stop token ids {eos_token_ids} must lie in the model's vocabulary [0, {vocab_size})")
        vocab = tokenizer_vocabulary(tokenizer, vocab_size, eos_token_ids, server_args.vocabulary_cache_path)
        self.vocabulary = per_tokenizer(
            tokenizer,
            ("outlines", vocab_size, tuple(eos_token_ids)),
            lambda: _outlines_vocabulary(vocab, eos_token_ids),
        )
        self.eos_token_ids = tuple(eos_token_ids)
        self.num_mask_words = words_per_row(vocab_size)
        self._fingerprint = vocabulary_fingerprint(vocab)

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        refuse_outlines_unsupported(schema, self.name)

    def json_schema_narrowing(self, schema: Any) -> str | None:
        return outlines_narrowing(schema)

    def dispatch_json(self, key_string: str) -> OutlinesGrammar:
        try:
            regex = build_regex_from_schema(key_string, self.whitespace_pattern)
        except ValueError as e:
            raise GrammarSpecError(_schema_error_message(e)) from e
        return self._compile(regex)

    def dispatch_regex(self, key_string: str) -> OutlinesGrammar:
        return self._compile(key_string)

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self.unsupported("ebnf")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self.unsupported("structural_tag")

    @property
    def can_share_grammars(self) -> bool:
        return True

    def compile_identity(self) -> dict[str, Any]:
        return {**super().compile_identity(), "engine": engine_version("outlines-core"), "tokenizer": self._fingerprint}

    def serialize_grammar(self, grammar: BaseGrammarObject) -> bytes:
        """The index's binary form (what ``Index.from_binary`` reads)."""
        if not isinstance(grammar, OutlinesGrammar):
            raise TypeError(f"not an outlines grammar: {type(grammar).__name__}")
        return _index_binary(grammar.compiled.index)

    def deserialize_grammar(self, payload: bytes | str) -> OutlinesGrammar:
        binary = payload.encode() if isinstance(payload, str) else payload
        return self._grammar(outlines_core.Index.from_binary(binary), len(binary))

    def _compile(self, regex: str) -> OutlinesGrammar:
        try:
            index = outlines_core.Index(regex, self.vocabulary)
        except ValueError as e:
            raise GrammarSpecError(_index_error_message(regex, e)) from e
        return self._grammar(index, len(_index_binary(index)))

    def _grammar(self, index: outlines_core.Index, num_bytes: int) -> OutlinesGrammar:
        return OutlinesGrammar(
            OutlinesCompiledGrammar(
                index=index,
                eos_token_ids=frozenset(self.eos_token_ids),
                eos_mask_words=token_word_bits(self.eos_token_ids),
                extra_eos_mask_words=token_word_bits(self.eos_token_ids[1:]),
                num_mask_words=self.num_mask_words,
                num_bytes=num_bytes,
            )
        )


def _outlines_vocabulary(vocab: TokenizerVocabulary, eos_token_ids: list[int]) -> outlines_core.Vocabulary:
    """outlines-core's vocabulary of ``vocab`` (costly at 248k tokens), shared by every backend on the tokenizer: no
    backend changes it after it is built."""
    stop_ids = set(eos_token_ids)
    token_ids_by_bytes: dict[bytes, list[int]] = {}
    for token_id, token_bytes in enumerate(vocab.decoded_vocab):
        if token_bytes and token_id not in stop_ids:
            token_ids_by_bytes.setdefault(token_bytes, []).append(token_id)
    # outlines-core knows one stop token: it allows it at final states; the others are set by hand.
    return outlines_core.Vocabulary(eos_token_ids[0], token_ids_by_bytes)


def _index_binary(index: outlines_core.Index) -> bytes:
    """The index's binary form. outlines-core 0.2.14 exposes it only through pickling: ``Index.__reduce__`` gives
    ``(Index.from_binary, (binary,))``; reading it there avoids pickle's own framing."""
    _, (binary,) = index.__reduce__()
    return bytes(binary)


def _schema_error_message(error: ValueError) -> str:
    text = bounded_message(str(error))
    if text.startswith("Unsupported JSON Schema structure"):  # it goes on to echo the (sub)schema
        text = "a (sub)schema has no keyword it can translate (type, properties, enum, const, $ref, anyOf, ...)"
    return f"outlines-core cannot turn this JSON schema into a regex: {text}"


def _index_error_message(regex: str, error: ValueError) -> str:
    """outlines-core's reason for refusing a regex, without echoing the regex back."""
    text = str(error)
    if "anchored universal start state" in text:
        return "outlines-core does not support anchors (^, $) in a regex; the whole output must match it anyway"
    if text.startswith("Failed to build DFA"):
        try:
            re.compile(regex)
        except re.error as e:
            return f"invalid regex: {e}"
        return (
            "outlines-core cannot build an automaton for this regex (look-around, back-references and "
            f"Unicode word boundaries are unsupported): {bounded_message(text)}"
        )
    if "incompatible with the regex" in text:  # the message echoes the regex first
        detail = bounded_message(text[text.find("Found no") :])
        return f"no sequence of this tokenizer's tokens can match the regex: {detail}"
    return bounded_message(text)
