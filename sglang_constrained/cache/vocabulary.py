"""What every backend needs to know about a tokenizer's vocabulary, computed once per tokenizer.

The model's vocabulary (the logits width) may be larger than the tokenizer's; ids past the tokenizer's end
are padding and no backend ever allows them. Special tokens (``<|im_start|>`` and the like) are never
allowed by a grammar, except the stop tokens at a point where the grammar may end.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xgrammar

from sglang_constrained.cache.identity import engine_version, tokens_fingerprint
from sglang_constrained.cache.per_tokenizer import per_tokenizer
from sglang_constrained.cache.vocabulary_disk import read_token_table, write_token_table

ENTRY_SUFFIX = ".vocab"


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


def tokenizer_vocabulary(
    tokenizer: Any, vocab_size: int, eos_token_ids: list[int], cache_dir: Path | None = None
) -> TokenizerVocabulary:
    """The vocabulary of ``tokenizer`` for a model with ``vocab_size`` logits and stop tokens ``eos_token_ids``.

    Decoding a 248k vocabulary takes seconds of CPU: built once per tokenizer in a process (``per_tokenizer``) and,
    with ``cache_dir``, kept there for the next process on the same tokenizer (``vocabulary_disk_cache``).
    """
    if not eos_token_ids:
        raise ValueError("a grammar needs at least one stop token id")
    return per_tokenizer(
        tokenizer,
        ("vocabulary", vocab_size, tuple(eos_token_ids)),
        lambda: _kept_or_decoded(tokenizer, vocab_size, eos_token_ids, cache_dir),
    )


def _kept_or_decoded(
    tokenizer: Any, vocab_size: int, eos_token_ids: list[int], cache_dir: Path | None
) -> TokenizerVocabulary:
    """The vocabulary from its entry in ``cache_dir``, or decoded (and written there)."""
    special_ids = tokenizer_special_token_ids(tokenizer)
    name = None if cache_dir is None else _entry_name(tokenizer, vocab_size, eos_token_ids, special_ids)
    if cache_dir is None or name is None:
        return _decode_vocabulary(tokenizer, vocab_size, eos_token_ids, special_ids)
    path = cache_dir / f"{name}{ENTRY_SUFFIX}"
    entry = read_token_table(path)
    if entry is not None and len(entry[1]) == vocab_size and isinstance(entry[0].get("xgrammar_metadata"), str):
        return TokenizerVocabulary(
            decoded_vocab=entry[1],
            tokenizer_vocab_size=len(tokenizer),
            model_vocab_size=vocab_size,
            stop_token_ids=tuple(eos_token_ids),
            special_token_ids=special_ids,
            xgrammar_metadata=entry[0]["xgrammar_metadata"],
        )
    vocabulary = _decode_vocabulary(tokenizer, vocab_size, eos_token_ids, special_ids)
    write_token_table(path, {"xgrammar_metadata": vocabulary.xgrammar_metadata}, vocabulary.decoded_vocab)
    return vocabulary


def _entry_name(tokenizer: Any, vocab_size: int, eos_token_ids: list[int], special_ids: frozenset[int]) -> str | None:
    """A hex digest of everything a decoded vocabulary follows from: the tokenizer's whole serialised form (tokens,
    merges, added tokens, normalizer, pre-tokenizer, decoder: what xgrammar reads), its added tokens, special ids
    and length, the model's vocab size and stop ids, and the code that decodes. None for a
    tokenizer with no Rust tokenizer behind it, which is decoded every time."""
    rust_tokenizer = getattr(tokenizer, "backend_tokenizer", None)
    if rust_tokenizer is None:
        return None
    added = {token_id: [str(token), bool(token.special)] for token_id, token in tokenizer.added_tokens_decoder.items()}
    facts = [len(tokenizer), added, sorted(special_ids), vocab_size, list(eos_token_ids), *_decoding_code()]
    digest = hashlib.sha256(rust_tokenizer.to_str().encode())
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()


@functools.cache
def _decoding_code() -> tuple[str, ...]:
    """The versions of what decodes a vocabulary: xgrammar, tokenizers, transformers and this module's source."""
    source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    return (*(engine_version(name) for name in ("xgrammar", "tokenizers", "transformers")), source)


def _decode_vocabulary(
    tokenizer: Any, vocab_size: int, eos_token_ids: list[int], special_ids: frozenset[int]
) -> TokenizerVocabulary:
    tokenizer_vocab_size = len(tokenizer)
    if vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"the model's vocab size {vocab_size} is smaller than the tokenizer's ({tokenizer_vocab_size} tokens)"
        )
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
    ids, both vocab sizes and xgrammar's tokenizer metadata."""
    return tokens_fingerprint(
        vocab.decoded_vocab,
        vocab.stop_token_ids,
        sorted(vocab.special_token_ids),
        vocab.tokenizer_vocab_size,
        vocab.model_vocab_size,
        vocab.xgrammar_metadata,
    )
