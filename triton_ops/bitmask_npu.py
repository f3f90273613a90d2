"""The Ascend NPU path: a round trip through the CPU path.

torch-npu documents no operator that applies a packed token bitmask (the Ascend ports either run a
Triton-Ascend kernel or, as vLLM-Ascend's v1 model runner does, mask on the host). Without a native op we do
the latter: the rows to mask are copied to the host, masked by the CPU path and copied back. Nothing here
imports torch_npu: tensors on an ``npu`` device exist only once torch_npu is loaded, and every operation used
is plain torch, so this module imports (and its logic runs on CPU tensors) without it.
"""

from __future__ import annotations

import importlib.util

import torch

from triton_ops.bitmask_cpu import apply_token_bitmask_inplace_cpu
from triton_ops.bitmask_reference import normalize_bitmask_args


def is_torch_npu_available() -> bool:
    """True if torch_npu can be imported (it is not imported here)."""
    return importlib.util.find_spec("torch_npu") is not None


def apply_token_bitmask_inplace_npu(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed logits to -inf in place, masking on the host; synchronises with the device.

    Shapes and dtypes as ``apply_token_bitmask_inplace_reference``. Only the rows in ``indices`` cross to the
    host and back, in the logits' own dtype.
    """
    args = normalize_bitmask_args(logits, bitmask, indices)
    logits_2d, bitmask_2d = args.logits, args.bitmask.cpu()
    if args.rows is None:
        host_logits = logits_2d.cpu()
        apply_token_bitmask_inplace_cpu(host_logits, bitmask_2d)
        if host_logits.data_ptr() != logits_2d.data_ptr():
            logits_2d.copy_(host_logits)
        return
    host_rows = args.rows.cpu()
    if host_rows.numel() == 0:
        return
    device_rows = host_rows.to(logits_2d.device)
    host_logits = logits_2d.index_select(0, device_rows).cpu()
    apply_token_bitmask_inplace_cpu(host_logits, bitmask_2d.index_select(0, host_rows))
    logits_2d.index_copy_(0, device_rows, host_logits.to(logits_2d.device))
