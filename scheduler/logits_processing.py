"""Per-row logit adjustments made before the grammar mask: logit bias, repetition, frequency and presence penalties,
and ``min_new_tokens``'s ban on stop tokens (vLLM's order).

A row is adjusted from its own history only: the request's prompt and output so far, and at a draft row the drafts
before it (verified drafts are output). A row therefore gets the same logits whether its request's tokens came one
forward at a time or as verified drafts, which keeps speculative decoding exact. None of these can re-enable a token
the grammar disallows: the mask is applied after them, and -inf stays -inf under every adjustment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowAdjustment:
    """What changes one logits row. ``history``: the output before the row's position (drafts included);
    ``prompt_ids``: read by the repetition penalty only; ``banned_ids``: stop tokens disallowed at this position."""

    prompt_ids: list[int]
    history: list[int]
    logit_bias: dict[int, float]
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    banned_ids: list[int]


def adjust_logits(logits: torch.Tensor, adjustments: dict[int, RowAdjustment]) -> dict[int, torch.Tensor]:
    """Adjust rows of ``logits`` (``[R, vocab]`` float32) in place; returns, for each row with banned stop tokens,
    the row as it was just before the ban (so that a row the ban and the mask together empty can be restored)."""
    before_ban: dict[int, torch.Tensor] = {}
    for row, adjustment in adjustments.items():
        values = logits[row]
        if adjustment.logit_bias:
            ids = torch.tensor(list(adjustment.logit_bias), dtype=torch.long)
            values[ids] += torch.tensor(list(adjustment.logit_bias.values()), dtype=values.dtype)
        if adjustment.repetition_penalty != 1.0:
            _apply_repetition_penalty(values, adjustment)
        if (adjustment.frequency_penalty or adjustment.presence_penalty) and adjustment.history:
            ids, counts = torch.tensor(adjustment.history, dtype=torch.long).unique(return_counts=True)
            penalty = counts.to(values.dtype) * adjustment.frequency_penalty + adjustment.presence_penalty
            values[ids] -= penalty
        if adjustment.banned_ids:
            before_ban[row] = values.clone()
            values[torch.tensor(adjustment.banned_ids, dtype=torch.long)] = float("-inf")
    return before_ban


def _apply_repetition_penalty(values: torch.Tensor, adjustment: RowAdjustment) -> None:
    seen = torch.tensor(adjustment.prompt_ids + adjustment.history, dtype=torch.long).unique()
    logits = values[seen]
    penalty = adjustment.repetition_penalty
    values[seen] = torch.where(logits > 0, logits / penalty, logits * penalty)
