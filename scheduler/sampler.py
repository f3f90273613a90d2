"""Token sampling from masked logits: greedy, temperature, top-k, top-p, with per-request seeds.

Each sampled row draws one uniform number from its own generator (or the server's) and samples by inverse
CDF, so a seeded request gets the same tokens whatever else is in its batch.
"""

from __future__ import annotations

import torch

from scheduler.sampling_batch_info import SamplingBatchInfo


def sample(logits: torch.Tensor, info: SamplingBatchInfo, default_generator: torch.Generator) -> list[int | None]:
    """One token id per row of ``logits`` (``[batch, vocab]`` fp32, already masked; rows may be changed).

    A row where every logit is -inf (its grammar allows nothing) gets None.
    """
    dead = torch.isneginf(logits).all(dim=-1)
    logits[dead] = 0.0
    tokens = logits.argmax(dim=-1)
    rows = ((info.temperatures > 0) & ~dead).nonzero().flatten()
    if len(rows) == 0:
        return _with_dead_rows(tokens, dead)
    scaled = logits[rows] / info.temperatures[rows].unsqueeze(-1)
    uniform = torch.cat([torch.rand(1, generator=info.generators[row] or default_generator) for row in rows.tolist()])
    top_ks = [info.top_ks[row] for row in rows.tolist()]
    top_ps = info.top_ps[rows]
    if all(k is None for k in top_ks) and bool((top_ps >= 1.0).all()):
        tokens[rows] = _inverse_cdf(torch.softmax(scaled, dim=-1), uniform)
    else:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        picked = _inverse_cdf(_top_k_top_p(sorted_logits, top_ks, top_ps), uniform)
        tokens[rows] = order.gather(-1, picked.unsqueeze(-1)).squeeze(-1)
    return _with_dead_rows(tokens, dead)


def _with_dead_rows(tokens: torch.Tensor, dead: torch.Tensor) -> list[int | None]:
    return [None if is_dead else token for token, is_dead in zip(tokens.tolist(), dead.tolist(), strict=True)]


def _top_k_top_p(sorted_logits: torch.Tensor, top_ks: list[int | None], top_ps: torch.Tensor) -> torch.Tensor:
    """Probabilities over logits sorted descending, keeping each row's top-k, then its top-p nucleus."""
    vocab = sorted_logits.shape[-1]
    ks = torch.tensor([vocab if k is None else min(k, vocab) for k in top_ks])
    positions = torch.arange(vocab)
    probs = torch.softmax(sorted_logits.masked_fill(positions >= ks.unsqueeze(-1), float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill(mass_before > top_ps.unsqueeze(-1), 0.0)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index per row where the row's CDF first exceeds ``uniform`` times the row's total mass.

    Searching on the right and keeping the target strictly below the total never lands on a zero-probability
    token, whatever the rounding.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1]
    targets = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets.unsqueeze(-1), right=True).squeeze(-1)
