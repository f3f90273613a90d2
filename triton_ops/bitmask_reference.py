"""The plain torch reference for applying a token bitmask: the test oracle and the fallback of last resort.

Also home of the argument checks every implementation shares, so they all accept and refuse the same inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from triton_ops.bitmask_format import BITMASK_DTYPE, unpack_bitmask

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BitmaskArgs(NamedTuple):
    """Checked arguments: ``logits`` ``[batch, vocab]`` and ``bitmask`` ``[batch, words]`` (views of the inputs).

    ``rows`` is None for every row, else a 1-D int64 tensor of row ids on the device ``indices`` came on
    (CPU for a list). Row ids of CPU tensors and lists are range-checked; device tensors are trusted, as
    checking them would synchronise with the device.
    """

    logits: torch.Tensor
    bitmask: torch.Tensor
    rows: torch.Tensor | None


def normalize_bitmask_args(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> BitmaskArgs:
    """Validate the inputs of ``apply_token_bitmask_inplace*`` and bring them to two dimensions.

    Raises ValueError naming the offending argument when a dtype, rank, row count or row id is wrong.
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(bitmask, torch.Tensor):
        raise ValueError("logits and bitmask must be torch tensors")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if bitmask.dtype != BITMASK_DTYPE:
        raise ValueError(f"bitmask must be int32 (32 tokens per word, bit t % 32 of word t // 32), got {bitmask.dtype}")
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [vocab] or [batch, vocab], got shape {tuple(logits.shape)}")
    if bitmask.dim() not in (1, 2):
        raise ValueError(f"bitmask must be [words] or [batch, words], got shape {tuple(bitmask.shape)}")
    logits_2d = logits.unsqueeze(0) if logits.dim() == 1 else logits
    bitmask_2d = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if bitmask_2d.shape[0] != logits_2d.shape[0]:
        raise ValueError(
            f"bitmask needs one row per logits row: logits has {logits_2d.shape[0]} rows, "
            f"bitmask {bitmask_2d.shape[0]} (slice a reused mask buffer to the batch)"
        )
    return BitmaskArgs(logits_2d, bitmask_2d, _normalize_rows(indices, logits_2d.shape[0]))


def _normalize_rows(indices: torch.Tensor | list[int] | None, num_rows: int) -> torch.Tensor | None:
    if indices is None:
        return None
    if isinstance(indices, torch.Tensor):
        given = indices
    elif len(indices) == 0:
        given = torch.empty(0, dtype=torch.int64)
    else:
        try:
            given = torch.tensor(list(indices))
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"indices must be a list of int row ids: {e}") from e
    if given.dim() != 1 or given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise ValueError(
            f"indices must be a 1-D list or tensor of integer row ids, got {given.dtype} of shape {tuple(given.shape)}"
        )
    rows = given.to(torch.int64)
    if rows.device.type == "cpu" and rows.numel() > 0:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= num_rows:
            raise ValueError(f"indices must be row ids in [0, {num_rows}), got values from {low} to {high}")
    return rows


def apply_token_bitmask_inplace_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set ``logits[i, t] = -inf`` wherever bit ``t`` of ``bitmask[i]`` is clear, on any device.

    ``logits`` is float32/float16/bfloat16 ``[batch, vocab]`` or ``[vocab]``; ``bitmask`` is int32
    ``[batch, ceil(vocab / 32)]`` or ``[ceil(vocab / 32)]``. With ``indices``, only those rows of ``logits``
    (and the same rows of ``bitmask``) are masked. Raises ValueError on malformed inputs.
    """
    args = normalize_bitmask_args(logits, bitmask, indices)
    logits_2d, bitmask_2d = args.logits, args.bitmask
    if args.rows is None:
        rows = torch.arange(logits_2d.shape[0], device=logits_2d.device)
    else:
        rows = args.rows.to(logits_2d.device)
    allowed = unpack_bitmask(bitmask_2d[rows.to(bitmask_2d.device)].to(logits_2d.device), logits_2d.shape[-1])
    logits_2d[rows] = logits_2d[rows].masked_fill(~allowed, float("-inf"))
