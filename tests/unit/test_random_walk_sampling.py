"""The random walks' sampler: its two-level inverse CDF draws the index one cumsum over the whole vector draws.

The soundness walks are seeded; a sampler that drew otherwise would walk other paths than the ones the tests were
written against. Whole-number weights make every partial sum exact, so the order of the additions cannot matter.
"""

from __future__ import annotations

from unittest.mock import patch

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_constrained.testing import random_walk
from sglang_constrained.testing.random_walk import SAMPLE_BLOCK, TokenTraits, _sample


def one_cumsum_draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    cdf = weights.cumsum(0)
    total = cdf[-1:]
    target = torch.minimum(torch.rand(1, generator=generator, dtype=torch.float64) * total, total.nextafter(total * 0))
    return int(torch.searchsorted(cdf, target, right=True))


def draws(weights: torch.Tensor, seed: int, sampler: object) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [sampler(weights, generator) for _ in range(20)]  # type: ignore[operator]


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(st.integers(0, 4_000_000), min_size=1, max_size=3 * SAMPLE_BLOCK + 7).filter(any),
    seed=st.integers(0, 2**32 - 1),
)
def test_two_levels_draw_what_one_cumsum_draws(weights: list[int], seed: int) -> None:
    tensor = torch.tensor(weights, dtype=torch.float64)
    assert draws(tensor, seed, _sample) == draws(tensor, seed, one_cumsum_draw)


def test_a_sparse_vocabulary_sized_vector_draws_alike_and_only_allowed_ids() -> None:
    """248,320 weights as the exploring walks' (up to 4,000,000 each), nine in ten masked to zero."""
    generator = torch.Generator().manual_seed(3)
    weights = torch.randint(1, 4_000_000, (248_320,), generator=generator).double()
    weights *= torch.rand(248_320, generator=generator) < 0.1
    drawn = draws(weights, 11, _sample)
    assert drawn == draws(weights, 11, one_cumsum_draw)
    assert all(weights[index] > 0 for index in drawn)


def synthetic_traits(vocab_size: int, generator: torch.Generator) -> TokenTraits:
    """Exploring weights as the walks' (whole numbers up to 4,000,000), one token in 50 closing, lengths 1 to 8."""
    empty = torch.zeros(1, dtype=torch.int32)
    return TokenTraits(
        decoded=(),
        explore_weights=torch.randint(1, 4_000_000, (vocab_size,), generator=generator).double(),
        closing=torch.rand(vocab_size, generator=generator) < 0.02,
        lengths=torch.randint(1, 9, (vocab_size,), generator=generator),
        forbidden_words=empty,
        vocab_words=empty,
    )


@settings(max_examples=60, deadline=None)
@given(
    density=st.sampled_from([1e-4, 1e-3, 0.01, 0.05]),
    closing=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_sparse_step_chooses_the_token_the_vocabulary_wide_vectors_choose(
    density: float, closing: bool, seed: int
) -> None:
    """A step whose mask allows few tokens draws among them alone; the token is the one the dense path (forced here
    by a sparseness no mask reaches) draws from the same generator, exploring or closing, with or without closers."""
    generator = torch.Generator().manual_seed(seed)
    traits = synthetic_traits(20_000, generator)
    allowed = torch.rand(20_000, generator=generator) < density
    allowed[int(torch.randint(0, 20_000, (1,), generator=generator))] = True
    stops = torch.tensor([0])
    allowed[0] = False

    def chosen(sparse_fraction: int) -> list[int]:
        draws = torch.Generator().manual_seed(seed)
        with patch.object(random_walk, "SPARSE_FRACTION", sparse_fraction):
            return [random_walk._choose(allowed, traits, stops, closing, draws) for _ in range(10)]

    sparse = chosen(random_walk.SPARSE_FRACTION)
    assert sparse == chosen(10**9)
    assert all(allowed[token] for token in sparse)
