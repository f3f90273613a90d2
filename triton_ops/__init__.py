"""Token-bitmask kernels (a Triton kernel for CUDA, a C++ loop on CPU, the NPU path) and their dispatcher; sampling
with draft verification, dispatched the same way.

The mask format itself (packing, unpacking, row resets) is ``triton_ops.bitmask_format``.
"""

from triton_ops.bitmask_cpu import (
    apply_token_bitmask_inplace_cpu,
    apply_token_bitmask_inplace_cpu_eager,
    load_cpu_bitmask_kernel,
)
from triton_ops.bitmask_format import unpack_bitmask
from triton_ops.bitmask_npu import apply_token_bitmask_inplace_npu, is_torch_npu_available
from triton_ops.bitmask_ops import apply_token_bitmask_inplace, apply_token_bitmask_inplace_triton
from triton_ops.bitmask_reference import apply_token_bitmask_inplace_reference
from triton_ops.speculative_sampling import sample_and_verify, sample_and_verify_npu
from triton_ops.speculative_sampling_reference import NO_DRAFT, sample_and_verify_reference

__all__ = [
    "NO_DRAFT",
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_inplace_cpu",
    "apply_token_bitmask_inplace_cpu_eager",
    "apply_token_bitmask_inplace_npu",
    "apply_token_bitmask_inplace_reference",
    "apply_token_bitmask_inplace_triton",
    "is_torch_npu_available",
    "load_cpu_bitmask_kernel",
    "sample_and_verify",
    "sample_and_verify_npu",
    "sample_and_verify_reference",
    "unpack_bitmask",
]
