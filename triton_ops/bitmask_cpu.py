"""The CPU path: the masking loop of the model's kernel library (``mask_logits``, over ``cpu_kernels``'
``csrc/mask_logits.h``), with a vectorised eager fallback in a process that has not loaded that library
(``load_cpu_bitmask_kernel``).

The loop stores -inf into the logits whose bit is clear, 32 at a time from each word (one masked store per 16
logits on AVX-512), and nothing else: it is loaded with the model's kernels, so a server compiles nothing for it
at start-up. The eager path views the logits covering whole words as ``[rows, words, 32]``, so each int32 word
lines up with its 32 logits without a per-token gather; the columns left over (a vocab that is not a multiple of
32, or a bitmask narrower than the logits) are masked apart. Both write the same bits.
``ThreadChoice`` picks one thread or all of torch's per call of the loop.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from cpu_kernels import library
from triton_ops.bitmask_format import BITS_PER_WORD
from triton_ops.bitmask_reference import normalize_bitmask_args
from triton_ops.thread_choice import ThreadChoice

logger = logging.getLogger(__name__)

# Bound on the temporaries of the eager path: freshly mapped pages cost more than the arithmetic on them.
EAGER_CHUNK_ELEMENTS = 1 << 20

_NEG_INF = float("-inf")

_TO_SIGN_BIT = (BITS_PER_WORD - 1) - torch.arange(BITS_PER_WORD, dtype=torch.int32)
"""Per lane j, the left shift that brings bit j of a word to the sign bit."""

_THREAD_CHOICE = ThreadChoice()

NEG_INF_BITS = {
    torch.float32: int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32)),
    torch.float16: int(torch.tensor(float("-inf"), dtype=torch.float16).view(torch.int16)),
    torch.bfloat16: int(torch.tensor(float("-inf"), dtype=torch.bfloat16).view(torch.int16)),
}
"""-inf's bit pattern per logits dtype, as the signed integer of the same width (what a view of the logits holds)."""


def mask_logits(
    logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None, threads: int | None = None
) -> None:
    """Set ``logits[r, c] = -inf`` in place where bit ``c % 32`` of ``words[r, c // 32]`` is clear or ``c`` lies past
    the last word, for every row ``r`` (or those in ``rows``: int64 ids, which the caller has range-checked).

    ``logits``: float32, float16 or bfloat16 ``[batch, vocab]``; ``words``: int32 ``[batch, num_words]``; both
    with unit column stride. The bits written are -inf's or the logit's own, whatever the build or thread count.
    """
    if logits.dtype not in NEG_INF_BITS or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"mask_logits takes float [rows, vocab] logits with unit column stride, got {logits.dtype}")
    if words.dtype != torch.int32 or words.dim() != 2 or words.stride(1) != 1 or words.shape[0] != logits.shape[0]:
        raise ValueError(f"mask_logits takes int32 [rows, words] with unit column stride, got {words.dtype}")
    if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
        raise ValueError("mask_logits takes contiguous int64 row ids")
    num_rows = logits.shape[0] if rows is None else rows.numel()
    if num_rows == 0 or logits.shape[1] == 0:
        return
    library.loaded().invariant_mask_logits(
        logits.data_ptr(),
        logits.element_size(),
        NEG_INF_BITS[logits.dtype] & 0xFFFFFFFF,  # the kernel stores its low 16 bits for 16-bit logits
        logits.shape[1],
        logits.stride(0),
        words.data_ptr(),
        words.shape[1],
        words.stride(0),
        None if rows is None else rows.data_ptr(),
        num_rows,
        threads or library.kernel_threads(),
    )


def load_cpu_bitmask_kernel(build_dir: Path) -> bool:
    """Load the masking loop (``cpu_kernels.library.load``: built once per machine into ``build_dir``, a few seconds;
    a process that runs the model has it loaded already). Returns False, and the eager path serves, where it
    cannot be built (no C++ compiler)."""
    if not library.is_loaded():
        try:
            library.load(build_dir)
        except (OSError, RuntimeError) as e:
            logger.warning("the CPU mask kernel is unavailable, masking with the eager path: %s", e)
            return False
    return True


def _mask_with_library(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    num_rows = logits.shape[0] if rows is None else rows.numel()
    num_elements = num_rows * logits.shape[1]
    threads = _THREAD_CHOICE.threads_for(num_elements, library.kernel_threads())
    start = time.perf_counter()
    mask_logits(logits, bitmask, rows, threads)
    _THREAD_CHOICE.record(threads, num_elements, time.perf_counter() - start)


def _mask_words_eager(words: torch.Tensor, bitmask_words: torch.Tensor) -> None:
    """Branch-free bit arithmetic on the logits' bit patterns, in row chunks that keep temporaries small.

    ``keep`` is all ones where the token is allowed and zero where not, so ``(x & keep) | (-inf & ~keep)`` is
    ``x`` or exactly ``-inf`` whatever ``x`` holds (NaN and +inf included).
    """
    bits = words.view(torch.int32 if words.element_size() == 4 else torch.int16)
    # Shifting bit j up to the sign bit, then arithmetically back down, smears it over the whole word.
    rows_per_chunk = max(1, EAGER_CHUNK_ELEMENTS // (words.shape[1] * BITS_PER_WORD))
    for start in range(0, words.shape[0], rows_per_chunk):
        keep = (bitmask_words[start : start + rows_per_chunk].unsqueeze(-1) << _TO_SIGN_BIT) >> (BITS_PER_WORD - 1)
        keep = keep.to(bits.dtype)
        chunk = bits[start : start + rows_per_chunk]
        chunk &= keep
        chunk |= keep.bitwise_not_().bitwise_and_(NEG_INF_BITS[words.dtype])


def _mask_leftover_columns(logits: torch.Tensor, bitmask: torch.Tensor, start: int) -> None:
    """Columns ``[start, vocab)``: the part of a last, partly used word, or all columns past the bitmask."""
    leftover = logits[:, start:]
    word = start // BITS_PER_WORD
    if word >= bitmask.shape[1]:
        leftover.fill_(_NEG_INF)
        return
    shifts = torch.arange(leftover.shape[1], dtype=torch.int32)
    leftover.masked_fill_(((bitmask[:, word : word + 1] >> shifts) & 1) == 0, _NEG_INF)


def _mask_all_rows_eagerly(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Every row of ``[rows, vocab]`` logits by its row of ``[rows, words]`` bitmask."""
    num_words = min(logits.shape[1] // BITS_PER_WORD, bitmask.shape[1])
    if num_words > 0:
        words = logits[:, : num_words * BITS_PER_WORD].unflatten(1, (num_words, BITS_PER_WORD))
        _mask_words_eager(words, bitmask[:, :num_words])
    if num_words * BITS_PER_WORD < logits.shape[1]:
        _mask_leftover_columns(logits, bitmask, num_words * BITS_PER_WORD)


def _apply(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None, use_library: bool
) -> None:
    args = normalize_bitmask_args(logits, bitmask, indices)
    if args.logits.device.type != "cpu":
        raise ValueError(
            f"the CPU path needs CPU logits, got {args.logits.device}; "
            "use triton_ops.apply_token_bitmask_inplace to dispatch by device"
        )
    logits_2d, bitmask_2d = args.logits, args.bitmask.cpu()
    if logits_2d.shape[0] == 0:
        return
    # The loop takes rows with unit column stride (any row stride); other layouts are rare enough for the eager path.
    # It trusts its row ids: only CPU ones have been range-checked (``normalize_bitmask_args``).
    is_checked = args.rows is None or args.rows.device.type == "cpu"
    if use_library and library.is_loaded() and logits_2d.stride(1) == 1 and is_checked:
        rows = None if args.rows is None else args.rows.contiguous()
        _mask_with_library(logits_2d, bitmask_2d if bitmask_2d.stride(1) == 1 else bitmask_2d.contiguous(), rows)
        return
    if args.rows is None:
        _mask_all_rows_eagerly(logits_2d, bitmask_2d)
        return
    # Row by row: copying the selected rows out and back (index_select, index_copy_) costs 5-25x more.
    for row in args.rows.tolist():
        _mask_all_rows_eagerly(logits_2d[row : row + 1], bitmask_2d[row : row + 1])


def apply_token_bitmask_inplace_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed CPU logits to -inf in place with the masking loop (the eager path until
    ``load_cpu_bitmask_kernel`` or the model's kernels have loaded it in this process).

    Shapes and dtypes as ``apply_token_bitmask_inplace_reference``. Only the rows in ``indices`` are read or written.
    """
    _apply(logits, bitmask, indices, use_library=True)


def apply_token_bitmask_inplace_cpu_eager(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """The same as ``apply_token_bitmask_inplace_cpu`` with vectorised torch ops only."""
    _apply(logits, bitmask, indices, use_library=False)
