"""Sampling with draft verification on whatever device the probabilities live, behind one dispatch.

"cuda" → the Triton kernel (the torch reference if triton is missing), "npu" → a round trip through the CPU path
(torch-npu documents no operator for it, as for the bitmask), anything else → the torch reference, which is also the
CPU path. The contract is ``triton_ops.speculative_sampling_reference``'s.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from triton_ops.speculative_sampling_reference import sample_and_verify_reference

logger = logging.getLogger(__name__)

VerifyKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def _load_triton_kernel() -> VerifyKernel | None:
    try:
        from triton_ops.speculative_sampling_triton import sample_and_verify_triton as kernel
    except ImportError as e:
        logger.warning("triton is unavailable (%s); CUDA rows are sampled with the torch reference", e)
        return None
    return kernel


def sample_and_verify_npu(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NPU path: the rows cross to the host, the CPU path decides, the results go back to the device."""
    host = lambda t: None if t is None else t.cpu()  # noqa: E731
    accepted, tokens = sample_and_verify_reference(
        probs.cpu(), exponentials.cpu(), draft_token_ids.cpu(), host(draft_probs), host(uniforms)
    )
    return accepted.to(probs.device), tokens.to(probs.device)


def sample_and_verify(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [N] bool, tokens [N] int64)``: each row's sample and whether its draft stands.

    ``probs``: non-negative weights ``[N, V]`` (need not sum to 1); ``exponentials``: ``Exp(1)`` draws of the same
    shape; ``draft_token_ids`` ``[N]`` (``NO_DRAFT`` where none); ``draft_probs`` ``[N, V]`` and ``uniforms`` ``[N]``
    for a draft distribution, None for deterministic drafts. Raises ValueError on malformed inputs.
    """
    device_type = probs.device.type
    if device_type == "npu":
        return sample_and_verify_npu(probs, exponentials, draft_token_ids, draft_probs, uniforms)
    if device_type == "cuda" and (kernel := _load_triton_kernel()) is not None:
        return kernel(probs, exponentials, draft_token_ids, draft_probs, uniforms)
    return sample_and_verify_reference(probs, exponentials, draft_token_ids, draft_probs, uniforms)
