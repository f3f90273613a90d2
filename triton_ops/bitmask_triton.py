"""The Triton kernel: one program per (row, block of the vocab), storing -inf over disallowed tokens.

The kernel never reads the logits: each token looks up its own word (``token // 32``; the threads of a
word share one load) and only disallowed positions are written. Importing this module needs triton but no
GPU; launching needs a CUDA device, or CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.bitmask_reference import normalize_bitmask_args

BLOCK_SIZE = 4096


@triton.jit
def _mask_logits_kernel(
    logits_ptr,
    bitmask_ptr,
    rows_ptr,
    vocab_size,
    num_words,
    logits_row_stride,
    bitmask_row_stride,
    HAS_ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # A statement, not a conditional expression: Triton prunes the untaken branch of a constexpr `if`.
    if HAS_ROWS:  # noqa: SIM108
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    token = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    word_index = token // 32
    in_vocab = token < vocab_size
    # Words past a narrow bitmask read as 0: those tokens are disallowed.
    word = tl.load(
        bitmask_ptr + row * bitmask_row_stride + word_index, mask=in_vocab & (word_index < num_words), other=0
    )
    is_allowed = ((word >> (token % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_row_stride + token, float("-inf"), mask=in_vocab & ~is_allowed)


def is_triton_interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    return bool(knobs is not None and knobs.runtime.interpret)


def apply_token_bitmask_inplace_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed logits to -inf in place with the Triton kernel; asynchronous on CUDA.

    Shapes and dtypes as ``apply_token_bitmask_inplace_reference``, with unit stride along the vocab; the
    bitmask is moved to the logits' device if elsewhere. CUDA index tensors are not range-checked (that
    would synchronise): out-of-range rows there are undefined behaviour.
    """
    args = normalize_bitmask_args(logits, bitmask, indices)
    logits_2d = args.logits
    device = logits_2d.device
    bitmask_2d = args.bitmask.to(device, non_blocking=True)
    if device.type == "cpu" and not is_triton_interpreting():
        raise ValueError("CPU tensors run through Triton only with TRITON_INTERPRET=1 set before import")
    if logits_2d.stride(1) != 1 or bitmask_2d.stride(1) != 1:
        raise ValueError("logits and bitmask need unit stride along the vocab; pass .contiguous() tensors")
    vocab_size = logits_2d.shape[1]
    rows = None if args.rows is None else args.rows.to(device)
    num_programs = logits_2d.shape[0] if rows is None else rows.numel()
    if num_programs == 0 or vocab_size == 0:
        return
    grid = (num_programs, triton.cdiv(vocab_size, BLOCK_SIZE))
    _mask_logits_kernel[grid](
        logits_2d,
        bitmask_2d,
        rows,
        vocab_size,
        bitmask_2d.shape[1],
        logits_2d.stride(0),
        bitmask_2d.stride(0),
        HAS_ROWS=rows is not None,
        BLOCK_SIZE=BLOCK_SIZE,
    )
