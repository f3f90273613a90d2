"""The sampler's Exp(1) draws (``triton_ops.sampling_noise``): the C++ kernel and the torch reference give the same
bits, a row depends on its key alone, the draws are Exp(1), and sampling with them follows the distribution.

Keys are fixed, so each statistical check has one fixed outcome (no flakiness); the thresholds are those of tests
at the 0.1 % level."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpu_kernels import library
from scheduler.sampler import SamplingRows, position_key, sample
from scheduler.server_args import ModelArgs
from tests.helpers import THREAD_COUNTS
from triton_ops import NO_DRAFT
from triton_ops.sampling_noise import (
    exponentials,
    exponentials_cpu,
    exponentials_reference,
    gumbel_race_cpu,
    gumbel_race_reference,
)

EDGE_KEYS = [0, 1, -1, 2**63 - 1, -(2**63), 0x5DEECE66D]


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load(ModelArgs().kernel_build_path)


@pytest.mark.parametrize("vocab", [1, 2, 1023, 1024, 1025, 49_153])
def test_the_kernel_draws_the_reference_bits_whatever_the_rows_and_threads(vocab: int) -> None:
    """Odd vocabularies and chunk edges included; a row alone, in a batch, on any thread count: the same bits."""
    keys = torch.tensor(EDGE_KEYS + [position_key(7, n) for n in range(4)])
    expected = exponentials_reference(keys, vocab).view(torch.int32)
    for threads in THREAD_COUNTS:
        assert torch.equal(exponentials_cpu(keys, vocab, threads).view(torch.int32), expected)
    alone = torch.cat([exponentials_cpu(keys[i : i + 1], vocab, 1) for i in range(len(keys))])
    assert torch.equal(alone.view(torch.int32), expected)
    assert torch.equal(exponentials(keys, vocab).view(torch.int32), expected)


def test_a_shorter_vocabulary_draws_a_prefix_of_the_same_row() -> None:
    keys = torch.tensor(EDGE_KEYS)
    assert torch.equal(exponentials_cpu(keys, 777), exponentials_cpu(keys, 2000)[:, :777])


def test_draws_are_exponential_along_rows_and_down_positions() -> None:
    """Along a row (one position's draws over the vocabulary) and down a column (one token over a request's output
    positions): Exp(1) by Kolmogorov-Smirnov, mean and variance 1, strictly positive and finite; neighbouring
    positions' draws are uncorrelated."""
    rows = exponentials_cpu(torch.tensor([position_key(11, n) for n in range(2048)]), 256).double()
    for sample_ in (rows.flatten(), rows[:, 0], rows[:, 255], rows[0]):
        assert kolmogorov_smirnov_exp1(sample_) < 1.95 / len(sample_) ** 0.5  # the 0.1 % critical value
    draws = rows.flatten()
    assert abs(draws.mean().item() - 1) < 0.01 and abs(draws.var().item() - 1) < 0.02
    assert bool((draws > 0).all()) and bool(torch.isfinite(draws).all())
    correlation = torch.corrcoef(torch.stack((rows[:-1].flatten(), rows[1:].flatten())))[0, 1].item()
    assert abs(correlation) < 0.01


@pytest.mark.parametrize("vocab", [3, 1025, 49_153])
def test_the_race_kernel_picks_the_reference_tokens_whatever_the_rows_and_threads(vocab: int) -> None:
    """Temperatures from 0.05 to 2 and 0 (greedy: the first largest logit), rows with half their tokens masked, a row
    of only -inf (-1), one token allowed, ties between masked-off logits: the kernel's token is the torch
    reference's, alone or in the batch."""
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(EDGE_KEYS) + 4, vocab, generator=generator) * 6
    logits[1, ::2] = -torch.inf
    logits[2] = -torch.inf
    logits[3] = -torch.inf
    logits[3, vocab // 2] = 0.0
    logits[4] = 1.0  # every token tied: the draws decide
    temperatures = torch.linspace(0.05, 2.0, len(logits))
    temperatures[5] = temperatures[-1] = 0.0
    logits[5, : vocab // 2] = 1.0  # greedy over ties: the first
    keys = torch.tensor(EDGE_KEYS + [position_key(9, n) for n in range(4)])
    expected = gumbel_race_reference(logits, temperatures, keys)
    assert expected[2] == -1 and expected[3] == vocab // 2
    assert expected[5] == int(logits[5].argmax()) and expected[-1] == int(logits[-1].argmax())
    for threads in THREAD_COUNTS:
        library.set_kernel_threads(threads)
        try:
            assert torch.equal(gumbel_race_cpu(logits, temperatures, keys), expected)
        finally:
            library.set_kernel_threads(None)
    alone = [gumbel_race_cpu(logits[i : i + 1], temperatures[i : i + 1], keys[i : i + 1]) for i in range(8)]
    assert torch.equal(torch.cat(alone), expected[:8])


def test_sampling_follows_the_distribution_and_a_seed_repeats_its_tokens() -> None:
    """4,000 positions of one request sampling from fixed probabilities: token frequencies pass a chi-square test
    against them; the same seeds and positions give the same tokens again, one row at a time or in one batch."""
    probabilities = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
    positions = list(range(4000))
    rows = _rows(len(positions), seeds=[5] * len(positions), positions=positions)
    tokens = sample(probabilities.log().expand(len(positions), -1).clone(), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probabilities)).double()
    expected = probabilities.double() * len(positions)
    assert ((counts - expected) ** 2 / expected).sum().item() < 22.46  # chi-square, 6 degrees of freedom, 0.1 %
    one_at_a_time = [sample(probabilities.log()[None].clone(), _rows(1, [5], [n]))[0] for n in positions[:50]]
    assert one_at_a_time == tokens[:50]


def kolmogorov_smirnov_exp1(draws: torch.Tensor) -> float:
    """The largest distance between the draws' empirical distribution function and Exp(1)'s."""
    ordered = draws.double().sort().values
    cdf = 1 - torch.exp(-ordered)
    n = len(ordered)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - cdf
    below = cdf - torch.arange(n, dtype=torch.float64) / n
    return max(above.max().item(), below.max().item())


def _rows(count: int, seeds: list[int], positions: list[int]) -> SamplingRows:
    return SamplingRows(
        temperatures=torch.ones(count),
        top_ps=torch.ones(count),
        min_ps=torch.zeros(count),
        top_ks=[None] * count,
        seeds=seeds,
        positions=positions,
        draft_token_ids=[NO_DRAFT] * count,
        top_logprobs_nums=[None] * count,
    )


def test_a_row_the_grammar_allows_nothing_in_gets_none_and_the_others_their_tokens() -> None:
    """Greedy and sampled rows beside a row of only -inf logits (its grammar allows nothing)."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [-torch.inf] * 3, [2.0, -torch.inf, 9.0], [-torch.inf] * 3])
    rows = _rows(4, seeds=[1, 2, 3, 4], positions=[0, 0, 0, 0])
    greedy = dataclasses.replace(rows, temperatures=torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert sample(logits.clone(), greedy) == [1, None, 2, None]
    sampled = sample(logits.clone(), rows)
    assert sampled[1] is None and sampled[3] is None and sampled[2] in (0, 2) and sampled[0] in (0, 1, 2)
