"""Token sampling from masked logits, one row per sampling position: greedy, or temperature with min-p, top-k and
top-p (vLLM's order); and the log-probabilities a request asked for.

A greedy row takes its first largest logit. A row at output position ``n`` of a request with sampling seed ``s``
samples by the exponential race ``argmax p / E`` with ``E ~ Exp(1)`` drawn by a counter-based generator keyed by
``(s, n)`` (``triton_ops.sampling_noise``): a request's tokens depend on its seed and its text only, whatever else is
in its batch and whether its tokens came one forward at a time or as verified drafts. A row without top-k, top-p or
min-p runs the race in logarithms over its logits (``gumbel_race``: ``argmax (l - max l) / T - log E``, one pass and
the same bits on every CPU; greedy rows go through it too, with no draws); a filtered row over its filtered
probabilities. Each row may carry a draft token; the draft stands when the row's token is that draft
(``triton_ops.sample_and_verify``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triton_ops import sample_and_verify
from triton_ops.sampling_noise import exponentials, gumbel_race

_MASK64 = 2**64 - 1


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling parameters of one forward's logits (a request has one row per position it samples)."""

    temperatures: torch.Tensor  # [R] float32; 0 is greedy
    top_ps: torch.Tensor  # [R] float32
    min_ps: torch.Tensor  # [R] float32; 0 keeps every token
    top_ks: list[int | None]
    seeds: list[int]
    positions: list[int]  # the output index each row samples
    draft_token_ids: list[int]  # NO_DRAFT where the row has none
    top_logprobs_nums: list[int | None]  # None: the row's request asked for no logprobs

    def select(self, indices: list[int]) -> SamplingRows:
        """These rows' parameters, in this order."""
        index = torch.tensor(indices, dtype=torch.int64)
        return SamplingRows(
            self.temperatures[index],
            self.top_ps[index],
            self.min_ps[index],
            [self.top_ks[i] for i in indices],
            [self.seeds[i] for i in indices],
            [self.positions[i] for i in indices],
            [self.draft_token_ids[i] for i in indices],
            [self.top_logprobs_nums[i] for i in indices],
        )


def row_logprobs(logits: torch.Tensor, rows: SamplingRows) -> dict[int, torch.Tensor]:
    """``{row: [vocab] log-probabilities}`` for the rows whose request asked for logprobs: the log-softmax of the
    row's (masked) logits divided by its temperature (not for greedy rows), before min-p, top-k and top-p. Rows the
    grammar allows nothing in are left out."""
    wanted = [i for i, k in enumerate(rows.top_logprobs_nums) if k is not None]
    if not wanted:
        return {}
    index = torch.tensor(wanted)
    temperatures = rows.temperatures[index]
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    logprobs = torch.log_softmax(logits[index] / scale.unsqueeze(-1), dim=-1)
    alive = ~torch.isneginf(logits[index]).all(dim=-1)
    return {row: logprobs[j] for j, row in enumerate(wanted) if bool(alive[j])}


def sample(logits: torch.Tensor, rows: SamplingRows) -> list[int | None]:
    """Each row's token (``logits`` ``[R, vocab]`` float32, already masked); a row's draft stands when its token is
    that draft. A row where every logit is -inf (its grammar allows nothing) gets None."""
    raced_rows = [
        temperature <= 0 or (top_p >= 1.0 and min_p <= 0.0 and top_k is None)  # greedy rows: no draws
        for temperature, top_p, min_p, top_k in zip(
            rows.temperatures.tolist(), rows.top_ps.tolist(), rows.min_ps.tolist(), rows.top_ks, strict=True
        )
    ]
    if all(raced_rows):  # the race over every row's logits in one call, a decode step's usual case: one greedy row
        # 48 µs, where the masks and indexing below took 180-245 µs (AMD EPYC Zen 3)
        chosen = gumbel_race(logits, rows.temperatures, _keys(rows, list(range(len(raced_rows)))))
        return [None if token < 0 else token for token in chosen.tolist()]
    race = torch.tensor(raced_rows)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    dead = torch.zeros(logits.shape[0], dtype=torch.bool)
    if bool(race.any()):  # over the logits themselves: no softmax, no second pass
        raced = race.nonzero().flatten()
        chosen = gumbel_race(_rows(logits, raced), rows.temperatures[raced], _keys(rows, raced.tolist()))
        tokens[raced], dead[raced] = chosen, chosen < 0
    if not bool(race.all()):  # sampled rows with min-p, top-k or top-p
        filtered = (~race).nonzero().flatten()
        alive = ~torch.isneginf(logits[filtered].max(dim=-1).values)
        dead[filtered] = ~alive
        filtered = filtered[alive]
        if filtered.numel():
            indices = filtered.tolist()
            probs = _filtered_probs(
                logits[filtered] / rows.temperatures[filtered].unsqueeze(-1),
                [rows.top_ks[i] for i in indices],
                rows.top_ps[filtered],
                rows.min_ps[filtered],
            )
            drafts = torch.tensor([rows.draft_token_ids[i] for i in indices])
            draws = exponentials(_keys(rows, indices), probs.shape[1]).to(probs.device)
            _, tokens[filtered] = sample_and_verify(probs, draws, drafts)
    return [None if is_dead else token for token, is_dead in zip(tokens.tolist(), dead.tolist(), strict=True)]


def _rows(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``logits[index]``, without the copy where ``index`` is every row in order."""
    return logits if index.numel() == logits.shape[0] else logits[index]


def _keys(rows: SamplingRows, indices: list[int]) -> torch.Tensor:
    return torch.tensor([position_key(rows.seeds[i], rows.positions[i]) for i in indices], dtype=torch.int64)


def position_key(seed: int, position: int) -> int:
    """The key of output ``position``'s draws for a request seeded ``seed``: splitmix64 of the pair, so that nearby
    seeds and positions get unrelated draws (a non-negative int64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def _filtered_probs(
    scaled: torch.Tensor, top_ks: list[int | None], top_ps: torch.Tensor, min_ps: torch.Tensor
) -> torch.Tensor:
    """Probabilities per row in vocabulary order, keeping the tokens at least ``min_p`` times as likely as the most
    likely one, then each row's top-k, then its top-p nucleus."""
    probs = torch.softmax(scaled, dim=-1)
    if bool((min_ps > 0).any()):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(-1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if all(k is None for k in top_ks) and bool((top_ps >= 1.0).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = sorted_probs.shape[-1]
    ks = torch.tensor([vocab if k is None else min(k, vocab) for k in top_ks])
    kept = torch.arange(vocab) < ks.unsqueeze(-1)
    sorted_probs = sorted_probs.masked_fill(~kept, 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    total = sorted_probs.sum(dim=-1, keepdim=True)
    sorted_probs = sorted_probs.masked_fill(mass_before > top_ps.unsqueeze(-1) * total, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
