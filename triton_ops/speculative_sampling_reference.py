"""The torch reference (and CPU path) of sampling with draft verification.

Every row is a sampling position: target weights ``p`` (the masked, temperature-scaled, top-k/top-p-filtered
distribution, unnormalised), ``Exp(1)`` draws ``E`` and, where a draft token ``d`` stands at that position, whether to
accept it. Sampling is the exponential race ``argmax p / E`` (a sample of ``p`` whatever its normalisation). For
deterministic drafts (``q`` one-hot on ``d``) the draft is accepted when the race picks it: that is rejection sampling
with acceptance ``min(1, p(d) / q(d)) = p(d)``, whose rejections are the race's other winners, distributed as the
residual ``(p - q)+``; and it is the very token plain sampling draws from the same ``E``, so a request seeded by
position gets the same tokens with speculation on or off. For a draft distribution ``q``: accept ``d`` when
``u < p(d) / q(d)`` (``p`` normalised), else race over the residual ``(p - q)+``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NO_DRAFT = -1
"""``draft_token_ids`` value of a position with no draft (the bonus position after the last draft)."""


@dataclass(frozen=True)
class VerifyArgs:
    """Checked arguments: ``probs`` and ``exponentials`` float32 ``[N, V]``, ``draft_token_ids`` int64 ``[N]``,
    ``draft_probs`` float32 ``[N, V]`` and ``uniforms`` float32 ``[N]`` (both or neither)."""

    probs: torch.Tensor
    exponentials: torch.Tensor
    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    uniforms: torch.Tensor | None


def check_verify_args(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor | None,
) -> VerifyArgs:
    """Raise ValueError on malformed inputs; return them as float32/int64 on ``probs``' device."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [rows, vocab], got shape {tuple(probs.shape)}")
    if exponentials.shape != probs.shape:
        raise ValueError(f"exponentials {tuple(exponentials.shape)} must have probs' shape {tuple(probs.shape)}")
    if draft_token_ids.shape != probs.shape[:1]:
        raise ValueError(f"draft_token_ids must be [{probs.shape[0]}], got {tuple(draft_token_ids.shape)}")
    if (draft_probs is None) != (uniforms is None):
        raise ValueError("draft_probs and uniforms go together: a draft distribution needs acceptance draws")
    if draft_probs is not None and draft_probs.shape != probs.shape:
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must have probs' shape {tuple(probs.shape)}")
    if uniforms is not None and uniforms.shape != probs.shape[:1]:
        raise ValueError(f"uniforms must be [{probs.shape[0]}], got {tuple(uniforms.shape)}")
    drafts = draft_token_ids.to(probs.device, torch.long)
    if drafts.numel() and (int(drafts.min()) < NO_DRAFT or int(drafts.max()) >= probs.shape[1]):
        raise ValueError(f"draft token ids must be in [0, {probs.shape[1]}) or {NO_DRAFT}")
    as_float = lambda t: None if t is None else t.to(probs.device, torch.float32)  # noqa: E731
    return VerifyArgs(probs.float(), exponentials.float(), drafts, as_float(draft_probs), as_float(uniforms))


def sample_and_verify_reference(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [N] bool, tokens [N] int64)``: per row, whether its draft stands and the row's token (the draft
    itself when accepted, else the row's sample). Rows without a draft are never accepted."""
    args = check_verify_args(probs, exponentials, draft_token_ids, draft_probs, uniforms)
    has_draft = args.draft_token_ids >= 0
    safe_drafts = args.draft_token_ids.clamp(min=0).unsqueeze(-1)
    race = (args.probs / args.exponentials).argmax(dim=-1)
    if args.draft_probs is None or args.uniforms is None:
        accepted = has_draft & (race == args.draft_token_ids)
        return accepted, race
    total = args.probs.sum(dim=-1, keepdim=True)
    target = args.probs / total
    p_draft = target.gather(-1, safe_drafts).squeeze(-1)
    q_draft = args.draft_probs.gather(-1, safe_drafts).squeeze(-1)
    accepted = has_draft & (args.uniforms * q_draft < p_draft)
    residual = (target - args.draft_probs).clamp(min=0)
    residual_race = (residual / args.exponentials).argmax(dim=-1)
    tokens = torch.where(accepted, args.draft_token_ids, torch.where(has_draft, residual_race, race))
    return accepted, tokens
