"""Token-bitmask kernels: a Triton kernel for CUDA, a vectorised CPU path, the NPU path, and their dispatcher."""

from triton_ops.bitmask_ops import apply_token_bitmask_inplace

__all__ = ["apply_token_bitmask_inplace"]
