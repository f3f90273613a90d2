"""What backends derive from a tokenizer (the decoded vocabulary, llguidance's tokenizer, outlines-core's vocabulary):
built once per tokenizer in a process, and again only when the tokenizer has grown."""

from __future__ import annotations

import copy

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup


def test_backends_on_one_tokenizer_share_its_decoded_vocabulary(smollm2_tokenizer: TokenizerSetup) -> None:
    setup = smollm2_tokenizer
    first = tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, list(setup.eos_token_ids)) is first
    other_stops = tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, [0])
    assert other_stops.stop_token_ids == (0,) and first.stop_token_ids == tuple(setup.eos_token_ids)
    padded = tokenizer_vocabulary(setup.tokenizer, setup.vocab_size + 64, setup.eos_token_ids)
    assert len(padded.decoded_vocab) == len(first.decoded_vocab) + 64 and padded.decoded_vocab[-1] == b""


def test_a_tokenizer_grown_by_an_added_token_is_decoded_again(smollm2_tokenizer: TokenizerSetup) -> None:
    tokenizer = copy.deepcopy(smollm2_tokenizer.tokenizer)
    vocab_size, stops = smollm2_tokenizer.vocab_size + 64, smollm2_tokenizer.eos_token_ids
    before = tokenizer_vocabulary(tokenizer, vocab_size, stops)
    tokenizer.add_tokens(["<grown>"])
    after = tokenizer_vocabulary(tokenizer, vocab_size, stops)
    new_id = len(tokenizer) - 1
    assert before.decoded_vocab[new_id] == b"" and after.decoded_vocab[new_id] == b"<grown>"
    assert after.tokenizer_vocab_size == before.tokenizer_vocab_size + 1


def test_llguidance_backends_on_one_tokenizer_share_its_engine_tokenizer(smollm2_tokenizer: TokenizerSetup) -> None:
    setup = smollm2_tokenizer
    args = GrammarArgs(grammar_backend="llguidance")
    first, second = (GuidanceBackend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids) for _ in range(2))
    other_stops = GuidanceBackend(args, setup.tokenizer, setup.vocab_size, [0])
    try:
        assert second.ll_tokenizer is first.ll_tokenizer
        assert other_stops.ll_tokenizer is not first.ll_tokenizer and other_stops.ll_tokenizer.eos_token == 0
    finally:
        for backend in (first, second, other_stops):
            backend.shutdown()


def test_outlines_backends_on_one_tokenizer_share_its_engine_vocabulary(smollm2_tokenizer: TokenizerSetup) -> None:
    setup = smollm2_tokenizer
    args = GrammarArgs(grammar_backend="outlines")
    first, second = (
        OutlinesGrammarBackend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids) for _ in range(2)
    )
    other_stops = OutlinesGrammarBackend(args, setup.tokenizer, setup.vocab_size, [0])
    try:
        assert second.vocabulary is first.vocabulary
        assert other_stops.vocabulary is not first.vocabulary
        assert other_stops.vocabulary.get_eos_token_id() == 0
        assert first.vocabulary.get_eos_token_id() == setup.eos_token_ids[0]
    finally:
        for backend in (first, second, other_stops):
            backend.shutdown()
