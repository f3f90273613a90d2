"""The token bitmask format, in one place: every kernel, backend, test and benchmark packs and reads masks here.

A mask is int32 ``[batch, ceil(vocab / 32)]``: token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is
set, bits counted from the least significant. A word of all ones (``-1``) allows its 32 tokens. It is the layout
xgrammar, llguidance and vLLM share, so a batch can mix the masks of every backend.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass

import numpy
import torch

BITS_PER_WORD = 32
BITMASK_DTYPE = torch.int32
ALL_ALLOWED = -1
"""The word that allows all of its 32 tokens."""


def words_per_row(vocab_size: int) -> int:
    """Words in one mask row for a vocabulary of ``vocab_size`` tokens."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(
    batch_size: int, vocab_size: int, device: torch.device | str = "cpu", allow_all: bool = True
) -> torch.Tensor:
    """A ``[batch_size, words_per_row(vocab_size)]`` mask that allows every token (or none)."""
    fill = ALL_ALLOWED if allow_all else 0
    return torch.full((batch_size, words_per_row(vocab_size)), fill, dtype=BITMASK_DTYPE, device=device)


def reset_rows(bitmask: torch.Tensor, rows: Iterable[int]) -> None:
    """Make ``rows`` of ``bitmask`` allow every token again."""
    for row in rows:
        bitmask[row].fill_(ALL_ALLOWED)


def to_int32_words(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit word values held in a wider integer tensor, as the int32 words with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(BITMASK_DTYPE)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool ``[..., vocab_size]``: True where ``bitmask`` ``[..., words]`` allows the token.

    Tokens past ``32 * words`` (a mask narrower than the vocabulary) are disallowed. On the CPU the words' bytes are
    unpacked by numpy (little-endian, so bit ``t % 8`` of byte ``t // 8`` is token ``t``'s): ~5x faster at 248k
    tokens than the shifts, which serve other devices.
    """
    if bitmask.device.type == "cpu" and bitmask.dtype == BITMASK_DTYPE and sys.byteorder == "little":
        word_bytes = bitmask.contiguous().numpy().view(numpy.uint8)
        allowed = torch.from_numpy(numpy.unpackbits(word_bytes, axis=-1, bitorder="little")).view(torch.bool)
    else:
        shifts = torch.arange(BITS_PER_WORD, dtype=BITMASK_DTYPE, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        allowed = bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * BITS_PER_WORD).bool()
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    padding = torch.zeros(*allowed.shape[:-1], vocab_size - allowed.shape[-1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=-1)


def pack_bool_mask(allowed: torch.Tensor) -> torch.Tensor:
    """The int32 bitmask ``[..., words]`` of a bool mask ``[..., vocab]`` (the inverse of ``unpack_bitmask``)."""
    vocab_size = allowed.shape[-1]
    padding = words_per_row(vocab_size) * BITS_PER_WORD - vocab_size
    padded = torch.nn.functional.pad(allowed.to(torch.int64), (0, padding))
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int64, device=allowed.device)
    words = (padded.unflatten(-1, (-1, BITS_PER_WORD)) << shifts).sum(dim=-1)
    return to_int32_words(words)


def bitmask_from_token_ids(token_ids: Iterable[int], vocab_size: int) -> torch.Tensor:
    """One mask row ``[words]`` that allows exactly ``token_ids``."""
    row = allocate_bitmask(1, vocab_size, allow_all=False)[0]
    set_token_bits(row, token_word_bits(token_ids))
    return row


def allowed_token_ids(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids one mask row allows, ascending."""
    return unpack_bitmask(row, vocab_size).nonzero().flatten()


def is_token_allowed(row: torch.Tensor, token: int) -> bool:
    """Whether one mask row allows ``token`` (False past the row's end)."""
    word = token // BITS_PER_WORD
    return word < row.shape[-1] and bool((int(row[word]) >> (token % BITS_PER_WORD)) & 1)


def only_allowed_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The one token a mask row allows, or None when it allows several, none, or only one at or past
    ``vocab_size`` (reads one word per nonzero word: cheap where a grammar forces a token)."""
    nonzero = row.nonzero()
    if nonzero.numel() != 1:
        return None
    word_index = int(nonzero[0, 0])
    word = int(row[word_index]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = word_index * BITS_PER_WORD + word.bit_length() - 1
    return token if token < vocab_size else None


def lowest_allowed_token(row: torch.Tensor, vocab_size: int) -> int | None:
    """The lowest token id one mask row allows, or None when it allows none below ``vocab_size`` (finds the first
    nonzero word, without unpacking every token: 7.8k words at 248k tokens)."""
    nonzero = row.nonzero()
    if not len(nonzero):
        return None
    word_index = int(nonzero[0, 0])
    word = int(row[word_index]) & 0xFFFFFFFF
    token = word_index * BITS_PER_WORD + (word & -word).bit_length() - 1
    return token if token < vocab_size else None


def token_word_bits(token_ids: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """``(word, bits)`` pairs that set ``token_ids`` in a row, ``bits`` as int32 values; for ``set_token_bits``."""
    words: dict[int, int] = {}
    for token in token_ids:
        words[token // BITS_PER_WORD] = words.get(token // BITS_PER_WORD, 0) | (1 << (token % BITS_PER_WORD))
    return tuple((word, bits - 2**32 if bits >= 2**31 else bits) for word, bits in sorted(words.items()))


def set_token_bits(row: torch.Tensor, word_bits: tuple[tuple[int, int], ...]) -> None:
    """Allow the tokens of ``token_word_bits`` in one mask row, in place (the row's other bits are kept)."""
    for word, bits in word_bits:
        row[word] |= bits


def clear_token_bits(row: torch.Tensor, word_bits: tuple[tuple[int, int], ...]) -> None:
    """Disallow the tokens of ``token_word_bits`` in one mask row, in place (the row's other bits are kept)."""
    for word, bits in word_bits:
        row[word] &= ~bits


@dataclass(frozen=True)
class VocabMaskLayout:
    """The masks a backend's grammars fill: int32 bitmasks ``[batch, num_words]`` over ``vocab_size`` tokens.

    ``fill_device`` is where the grammars write rows: "cpu" for engines that fill host memory (every built-in
    one; the filled mask then moves to the logits' device), None for a backend that fills on the logits' device.
    Set once, when the backend is built; the scheduler allocates its one mask buffer from it.
    """

    vocab_size: int
    fill_device: str | None = "cpu"

    @property
    def num_words(self) -> int:
        return words_per_row(self.vocab_size)

    @property
    def dtype(self) -> torch.dtype:
        return BITMASK_DTYPE

    def allocate(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """An all-allowed mask for ``batch_size`` rows, on ``fill_device`` (or ``device`` when that is None)."""
        return allocate_bitmask(batch_size, self.vocab_size, self.fill_device or device)
