"""The Triton kernel of sampling with draft verification: one program per row, two passes over the vocabulary.

Same contract as ``triton_ops.speculative_sampling_reference``. The first pass sums the row's weights (only with a
draft distribution); the second keeps the running winner of the race ``p / E`` and of the residual race. Ties go to
the lowest token id, as ``torch.argmax``. Importing needs triton but no GPU; launching needs a CUDA device, or CPU
tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.bitmask_triton import is_triton_interpreting
from triton_ops.speculative_sampling_reference import check_verify_args

BLOCK_SIZE = 1024


@triton.jit
def _block_winner(values, tokens, best_value, best_token):
    block_best = tl.max(values, axis=0)
    block_token = tl.min(tl.where(values == block_best, tokens, 2**31 - 1), axis=0)
    wins = block_best > best_value
    return tl.where(wins, block_best, best_value), tl.where(wins, block_token, best_token)


@triton.jit
def _sample_and_verify_kernel(
    probs_ptr,
    exponentials_ptr,
    drafts_ptr,
    draft_probs_ptr,
    uniforms_ptr,
    accepted_ptr,
    tokens_ptr,
    vocab_size,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * vocab_size
    draft = tl.load(drafts_ptr + row)
    total = 1.0
    if HAS_DRAFT_PROBS:
        acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK_SIZE):
            offsets = start + tl.arange(0, BLOCK_SIZE)
            acc += tl.load(probs_ptr + base + offsets, mask=offsets < vocab_size, other=0.0)
        total = tl.sum(acc, axis=0)
    best, best_token = -1.0, 0
    best_residual, best_residual_token = -1.0, 0
    for start in range(0, vocab_size, BLOCK_SIZE):
        offsets = start + tl.arange(0, BLOCK_SIZE)
        in_vocab = offsets < vocab_size
        p = tl.load(probs_ptr + base + offsets, mask=in_vocab, other=0.0)
        e = tl.load(exponentials_ptr + base + offsets, mask=in_vocab, other=1.0)
        best, best_token = _block_winner(tl.where(in_vocab, p / e, -1.0), offsets, best, best_token)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + base + offsets, mask=in_vocab, other=0.0)
            residual = tl.maximum(p / total - q, 0.0) / e
            best_residual, best_residual_token = _block_winner(
                tl.where(in_vocab, residual, -1.0), offsets, best_residual, best_residual_token
            )
    has_draft = draft >= 0
    if HAS_DRAFT_PROBS:
        safe_draft = tl.maximum(draft, 0)
        p_draft = tl.load(probs_ptr + base + safe_draft) / total
        q_draft = tl.load(draft_probs_ptr + base + safe_draft)
        accepted = has_draft & (tl.load(uniforms_ptr + row) * q_draft < p_draft)
        token = tl.where(accepted, draft, tl.where(has_draft, best_residual_token, best_token))
    else:
        accepted = has_draft & (best_token == draft)
        token = best_token
    tl.store(accepted_ptr + row, accepted.to(tl.int8))
    tl.store(tokens_ptr + row, token.to(tl.int64))


def sample_and_verify_triton(
    probs: torch.Tensor,
    exponentials: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(accepted [N] bool, tokens [N] int64)`` as ``sample_and_verify_reference``."""
    args = check_verify_args(probs, exponentials, draft_token_ids, draft_probs, uniforms)
    if args.probs.device.type == "cpu" and not is_triton_interpreting():
        raise ValueError("CPU tensors run through Triton only with TRITON_INTERPRET=1 set before import")
    num_rows, vocab_size = args.probs.shape
    accepted = torch.empty(num_rows, dtype=torch.int8, device=args.probs.device)
    tokens = torch.empty(num_rows, dtype=torch.long, device=args.probs.device)
    if num_rows:
        has_draft_probs = args.draft_probs is not None
        _sample_and_verify_kernel[(num_rows,)](
            args.probs.contiguous(),
            args.exponentials.contiguous(),
            args.draft_token_ids.contiguous(),
            args.draft_probs.contiguous() if args.draft_probs is not None else args.probs,
            args.uniforms.contiguous() if args.uniforms is not None else args.probs,
            accepted,
            tokens,
            vocab_size,
            HAS_DRAFT_PROBS=has_draft_probs,
            BLOCK_SIZE=BLOCK_SIZE,
        )
    return accepted.bool(), tokens
