"""A decoded vocabulary kept on disk: the next process on the same tokenizer reads it instead of decoding it again
(~2.9 s of CPU at 248k tokens, at every server start), and reads exactly what decoding gives. Another tokenizer,
other stop ids or another vocab size has an entry of its own; a damaged entry is decoded again and written whole.

A copy of a tokenizer (``copy.deepcopy``) stands for the next process's: the vocabulary is built once per tokenizer
object in a process (``per_tokenizer``), so only a new object goes to the disk.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import xgrammar

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.cache.vocabulary import TokenizerVocabulary, tokenizer_vocabulary
from sglang_constrained.cache.vocabulary_disk import read_token_table, write_token_table
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup


def kept(setup: TokenizerSetup, folder: Path, **changes: Any) -> TokenizerVocabulary:
    """The vocabulary of a new copy of ``setup``'s tokenizer, with ``folder`` as the disk cache."""
    facts = {"vocab_size": setup.vocab_size, "eos_token_ids": setup.eos_token_ids, **changes}
    return tokenizer_vocabulary(copy.deepcopy(setup.tokenizer), cache_dir=folder, **facts)


def decoded(setup: TokenizerSetup) -> TokenizerVocabulary:
    return tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids)


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.vocab"))


def refuse_to_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on a decode fails the test: what is returned comes from the disk."""

    def decode(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the vocabulary was decoded again")

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", decode)


def test_the_next_tokenizer_reads_the_decoded_vocabulary_instead_of_decoding(
    smollm2_tokenizer: TokenizerSetup, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = kept(smollm2_tokenizer, tmp_path)
    assert first == decoded(smollm2_tokenizer) and len(entries(tmp_path)) == 1
    refuse_to_decode(monkeypatch)
    assert kept(smollm2_tokenizer, tmp_path) == first


def test_another_tokenizer_stop_ids_or_vocab_size_has_an_entry_of_its_own(
    smollm2_tokenizer: TokenizerSetup, tmp_path: Path
) -> None:
    setup = smollm2_tokenizer
    kept(setup, tmp_path)
    assert kept(setup, tmp_path, eos_token_ids=[0]).stop_token_ids == (0,)
    assert len(kept(setup, tmp_path, vocab_size=setup.vocab_size + 128).decoded_vocab) == setup.vocab_size + 128
    grown = copy.deepcopy(setup.tokenizer)
    grown.add_tokens(["<grown>"])
    vocabulary = tokenizer_vocabulary(grown, setup.vocab_size, setup.eos_token_ids, tmp_path)
    assert vocabulary.decoded_vocab[len(grown) - 1] == b"<grown>"
    assert len(entries(tmp_path)) == 4


def test_a_damaged_entry_is_decoded_again_and_written_whole(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    kept(smollm2_tokenizer, tmp_path)
    [entry] = entries(tmp_path)
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])
    assert kept(smollm2_tokenizer, tmp_path) == decoded(smollm2_tokenizer)
    assert entry.read_bytes() == whole


def test_every_token_of_a_real_vocabulary_reads_back_byte_for_byte(
    tokenizer_case: TokenizerSetup, tmp_path: Path
) -> None:
    """Both real vocabularies: byte-level pieces of characters (not UTF-8 alone), empty special tokens, padding."""
    vocabulary = decoded(tokenizer_case)
    write_token_table(tmp_path / "entry.vocab", {}, vocabulary.decoded_vocab)
    table = read_token_table(tmp_path / "entry.vocab")
    assert table is not None and table[1] == vocabulary.decoded_vocab


@pytest.mark.parametrize("backend_class", [XGrammarGrammarBackend, OutlinesGrammarBackend])
def test_a_backend_keeps_its_vocabulary_in_the_servers_cache_folder(
    backend_class: type, smollm2_tokenizer: TokenizerSetup, tmp_path: Path
) -> None:
    args = GrammarArgs(cache_dir=str(tmp_path))
    setup = smollm2_tokenizer
    options = {"compile_in_processes": False} if backend_class is XGrammarGrammarBackend else {}
    backend = backend_class(args, copy.deepcopy(setup.tokenizer), setup.vocab_size, setup.eos_token_ids, **options)
    backend.shutdown()
    assert len(entries(args.vocabulary_cache_path)) == 1
