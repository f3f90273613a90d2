"""Apply a token bitmask to logits in place, on whatever device the logits live.

Dispatch by ``logits.device.type``: "cuda" → the Triton kernel (the torch reference if triton is not
installed), "cpu" → the CPU path (a C++ loop), "npu" → the NPU path (a CPU round trip), anything else → the
torch reference. Triton is imported only when CUDA logits first arrive, so the package imports without it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from triton_ops.bitmask_cpu import apply_token_bitmask_inplace_cpu
from triton_ops.bitmask_npu import apply_token_bitmask_inplace_npu
from triton_ops.bitmask_reference import apply_token_bitmask_inplace_reference

logger = logging.getLogger(__name__)

Indices = torch.Tensor | list[int] | None
BitmaskKernel = Callable[[torch.Tensor, torch.Tensor, Indices], None]


@functools.cache
def _load_triton_kernel() -> BitmaskKernel | None:
    # Deferred so that importing triton_ops never requires triton (or pays for importing it).
    try:
        from triton_ops.bitmask_triton import apply_token_bitmask_inplace_triton as kernel
    except ImportError as e:
        logger.warning("triton is unavailable (%s); CUDA logits are masked with the torch reference", e)
        return None
    return kernel


def apply_token_bitmask_inplace_triton(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None) -> None:
    """The Triton kernel (see ``triton_ops.bitmask_triton``); raises ImportError if triton is not installed."""
    kernel = _load_triton_kernel()
    if kernel is None:
        raise ImportError("apply_token_bitmask_inplace_triton needs triton: pip install triton")
    kernel(logits, bitmask, indices)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None) -> None:
    """Set ``logits[i, t] = -inf`` in place wherever bit ``t % 32`` of word ``t // 32`` of ``bitmask[i]`` is clear.

    ``logits``: float32/float16/bfloat16 ``[batch, vocab]`` or ``[vocab]``. ``bitmask``: int32
    ``[batch, ceil(vocab / 32)]`` or 1-D, moved to the logits' device if elsewhere; tokens past a narrower
    bitmask are disallowed. ``indices`` (tensor or list of row ids) restricts masking to those rows, each with
    its own bitmask row. Raises ValueError on malformed inputs.
    """
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"logits must be a torch tensor, got {type(logits).__name__}")
    device_type = logits.device.type
    if device_type == "cpu":
        apply_token_bitmask_inplace_cpu(logits, bitmask, indices)
    elif device_type == "npu":
        apply_token_bitmask_inplace_npu(logits, bitmask, indices)
    elif device_type == "cuda" and (kernel := _load_triton_kernel()) is not None:
        kernel(logits, bitmask, indices)
    else:
        apply_token_bitmask_inplace_reference(logits, bitmask, indices)
