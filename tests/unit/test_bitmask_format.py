"""The bitmask format against its definition: token t is allowed iff bit t % 32 of int32 word t // 32 is set."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triton_ops.bitmask_format import (
    ALL_ALLOWED,
    allocate_bitmask,
    allowed_token_ids,
    bitmask_from_token_ids,
    clear_token_bits,
    is_token_allowed,
    lowest_allowed_token,
    only_allowed_token,
    pack_bool_mask,
    reset_rows,
    set_token_bits,
    token_word_bits,
    unpack_bitmask,
    words_per_row,
)

token_sets = st.integers(1, 300).flatmap(lambda vocab: st.tuples(st.just(vocab), st.sets(st.integers(0, vocab - 1))))


def definition_allows(words: list[int], token: int) -> bool:
    """The format's definition, on plain Python ints (an int32 word's bits as two's complement)."""
    return (words[token // 32] & 0xFFFFFFFF) >> (token % 32) & 1 == 1


@settings(max_examples=80, deadline=None)
@given(token_sets)
def test_a_row_of_token_ids_follows_the_definition(case: tuple[int, set[int]]) -> None:
    vocab, tokens = case
    row = bitmask_from_token_ids(tokens, vocab)
    assert row.dtype == torch.int32 and row.shape == (words_per_row(vocab),)
    words = row.tolist()
    assert {t for t in range(vocab) if definition_allows(words, t)} == tokens
    assert set(allowed_token_ids(row, vocab).tolist()) == tokens
    assert all(is_token_allowed(row, t) == (t in tokens) for t in range(vocab + 40))
    assert only_allowed_token(row, vocab) == (next(iter(tokens)) if len(tokens) == 1 else None)
    assert lowest_allowed_token(row, vocab) == min(tokens, default=None)
    cleared = set(sorted(tokens)[::2])
    clear_token_bits(row, token_word_bits(cleared))
    assert set(allowed_token_ids(row, vocab).tolist()) == tokens - cleared
    assert lowest_allowed_token(row, vocab) == min(tokens - cleared, default=None)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300).flatmap(lambda vocab: st.tuples(st.just(vocab), st.integers(0, vocab - 1))))
def test_a_token_past_the_vocabulary_is_never_the_only_or_lowest_allowed_one(case: tuple[int, int]) -> None:
    """A row allowing one token at or past ``vocab_size`` (padding words) forces nothing and offers nothing."""
    vocab, token = case
    assert only_allowed_token(bitmask_from_token_ids([token], vocab), vocab) == token
    assert only_allowed_token(bitmask_from_token_ids([token], vocab + 64), token) is None
    assert lowest_allowed_token(bitmask_from_token_ids([token], vocab + 64), token) is None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200), st.integers(1, 3))
def test_packing_and_unpacking_are_inverse(allowed: list[bool], rows: int) -> None:
    bools = torch.tensor([allowed] * rows)
    packed = pack_bool_mask(bools)
    assert packed.shape == (rows, words_per_row(len(allowed)))
    assert torch.equal(unpack_bitmask(packed, len(allowed)), bools)
    assert all(definition_allows(packed[0].tolist(), t) == a for t, a in enumerate(allowed))
    # the shifts that unpack on other devices (and wider words) read the same bits as numpy's bytes on the CPU
    assert torch.equal(unpack_bitmask(packed.to(torch.int64), len(allowed)), bools)
    beside_other_words = torch.cat([packed, torch.full_like(packed, ALL_ALLOWED)], dim=-1)[:, : packed.shape[-1]]
    assert torch.equal(unpack_bitmask(beside_other_words, len(allowed)), bools)


def test_all_allowed_and_none_allowed_rows() -> None:
    assert ALL_ALLOWED == -1
    full = allocate_bitmask(2, 70)
    assert full.shape == (2, 3) and unpack_bitmask(full, 70).all()
    empty = allocate_bitmask(2, 70, allow_all=False)
    assert not unpack_bitmask(empty, 70).any()


def test_tokens_past_a_narrow_mask_are_disallowed() -> None:
    row = allocate_bitmask(1, 32)[0]
    assert unpack_bitmask(row, 40).tolist() == [True] * 32 + [False] * 8
    assert not is_token_allowed(row, 33)


def test_setting_bits_keeps_the_others_and_resetting_rows_allows_all() -> None:
    mask = allocate_bitmask(3, 100, allow_all=False)
    set_token_bits(mask[1], token_word_bits([0, 31, 63, 99]))
    set_token_bits(mask[1], token_word_bits([5]))
    assert allowed_token_ids(mask[1], 100).tolist() == [0, 5, 31, 63, 99]
    assert token_word_bits([31]) == ((0, -(2**31)),)  # the sign bit is token 31
    reset_rows(mask, [0, 1])
    assert unpack_bitmask(mask[:2], 100).all() and not unpack_bitmask(mask[2], 100).any()
