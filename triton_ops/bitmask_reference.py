"""The plain torch reference for applying a token bitmask: the test oracle and the fallback of last resort."""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool tensor ``[..., vocab_size]``: True where the int32 ``bitmask`` ``[..., ceil(V / 32)]`` allows a token.

    Token ids past ``32 * bitmask.shape[-1]`` (a bitmask narrower than the logits) are disallowed.
    """
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * 32).bool()
    if allowed.shape[-1] >= vocab_size:
        return allowed[..., :vocab_size]
    padding = torch.zeros(*allowed.shape[:-1], vocab_size - allowed.shape[-1], dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, padding], dim=-1)


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set ``logits[i, t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear.

    ``logits`` is ``[batch, vocab]`` or ``[vocab]``; ``bitmask`` is int32 ``[batch, ceil(vocab / 32)]`` or
    ``[ceil(vocab / 32)]``. With ``indices``, only those rows of ``logits`` (and the same rows of ``bitmask``)
    are masked.
    """
    if logits.dim() == 1:
        logits = logits.unsqueeze(0)
        bitmask = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    rows = (
        torch.arange(logits.shape[0], device=logits.device)
        if indices is None
        else torch.as_tensor(indices, dtype=torch.long, device=logits.device)
    )
    allowed = unpack_bitmask(bitmask[rows.to(bitmask.device)].to(logits.device), logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
