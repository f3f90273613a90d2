"""What every backend needs to know about a tokenizer's vocabulary, computed once per tokenizer.

The model's vocabulary (the logits width) may be larger than the tokenizer's; ids past the tokenizer's end
are padding and no backend ever allows them. Special tokens (``<|im_start|>`` and the like) are never
allowed by a grammar, except the stop tokens at a point where the grammar may end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xgrammar

from sglang_constrained.compile_identity import tokens_fingerprint
from sglang_constrained.per_tokenizer import per_tokenizer


@dataclass(frozen=True)
class TokenizerVocabulary:
    """A tokenizer's vocabulary as bytes, with its special and stop tokens.

    ``decoded_vocab[i]`` holds the bytes token ``i`` stands for; special tokens and padding ids are ``b""``.
    ``xgrammar_metadata`` is xgrammar's description of the tokenizer (prefix space, stop tokens) with the vocab
    type set to raw, for rebuilding a ``TokenizerInfo`` over ``decoded_vocab``: the entries are already decoded,
    and a byte-level type would decode them a second time (turning ``"ör"`` into ``"\xf6r"``).
    """

    decoded_vocab: tuple[bytes, ...]
    tokenizer_vocab_size: int
    model_vocab_size: int
    stop_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    xgrammar_metadata: str


def tokenizer_special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokenizer's special tokens: those flagged special among added tokens, and its named ones."""
    flagged = {token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    return frozenset(flagged | set(tokenizer.all_special_ids))


def tokenizer_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> TokenizerVocabulary:
    """The vocabulary of ``tokenizer`` for a model with ``vocab_size`` logits and stop tokens ``eos_token_ids``.

    Decoding a 248k vocabulary takes ~2.5 s of CPU: built once per tokenizer (``per_tokenizer``).
    """
    if not eos_token_ids:
        raise ValueError("a grammar needs at least one stop token id")
    return per_tokenizer(
        tokenizer,
        ("vocabulary", vocab_size, tuple(eos_token_ids)),
        lambda: _decode_vocabulary(tokenizer, vocab_size, eos_token_ids),
    )


def _decode_vocabulary(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> TokenizerVocabulary:
    tokenizer_vocab_size = len(tokenizer)
    if vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"the model's vocab size {vocab_size} is smaller than the tokenizer's ({tokenizer_vocab_size} tokens)"
        )
    special_ids = tokenizer_special_token_ids(tokenizer)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
    decoded = tuple(
        b"" if token_id in special_ids or token_id >= tokenizer_vocab_size else token_bytes
        for token_id, token_bytes in enumerate(info.decoded_vocab)
    )
    return TokenizerVocabulary(
        decoded_vocab=decoded,
        tokenizer_vocab_size=tokenizer_vocab_size,
        model_vocab_size=vocab_size,
        stop_token_ids=tuple(eos_token_ids),
        special_token_ids=special_ids,
        xgrammar_metadata=json.dumps({**json.loads(info.dump_metadata()), "vocab_type": xgrammar.VocabType.RAW.value}),
    )


def vocabulary_fingerprint(vocab: TokenizerVocabulary) -> str:
    """A hex digest of everything in ``vocab`` that masks are built from: every token's bytes, the stop and special
    ids, both vocab sizes and xgrammar's tokenizer metadata (about 10 ms at 49k tokens, 40 ms at 248k)."""
    return tokens_fingerprint(
        vocab.decoded_vocab,
        vocab.stop_token_ids,
        sorted(vocab.special_token_ids),
        vocab.tokenizer_vocab_size,
        vocab.model_vocab_size,
        vocab.xgrammar_metadata,
    )
