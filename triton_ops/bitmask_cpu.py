"""The CPU path: a ``torch.compile``d fused kernel, with a vectorised eager fallback.

Both view the logits covering whole bitmask words as ``[rows, words, 32]``, so each int32 word lines up with
its 32 logits and no per-token gather is needed. The columns left over (a vocab that is not a multiple of 32,
or a bitmask narrower than the logits) are masked apart; they are fewer than 32 in the usual case.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from triton_ops.bitmask_format import BITS_PER_WORD, allocate_bitmask
from triton_ops.bitmask_reference import normalize_bitmask_args

logger = logging.getLogger(__name__)

# One thread: the kernel is memory-bound, and an OpenMP region waits for its slowest thread, which on a busy
# machine (grammars compile on background threads) means a scheduler tick of ~4 ms for a 0.2 ms job.
COMPILED_KERNEL_THREADS = 1

# Bound on the temporaries of the eager path: freshly mapped pages cost more than the arithmetic on them.
EAGER_CHUNK_ELEMENTS = 1 << 20

_NEG_INF = float("-inf")
_NEG_INF_BITS = {
    torch.float32: int(torch.tensor(_NEG_INF, dtype=torch.float32).view(torch.int32)),
    torch.float16: int(torch.tensor(_NEG_INF, dtype=torch.float16).view(torch.int16)),
    torch.bfloat16: int(torch.tensor(_NEG_INF, dtype=torch.bfloat16).view(torch.int16)),
}


def _mask_words_fused(bits: torch.Tensor, bitmask_words: torch.Tensor, neg_inf_bits: int) -> None:
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask_words.device)
    is_allowed = ((bitmask_words.unsqueeze(-1) >> shifts) & 1) != 0
    bits.masked_fill_(~is_allowed, neg_inf_bits)


def _as_bits(words: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The logits' bit patterns as same-width ints (a view), and the pattern of -inf in that dtype."""
    int_dtype = torch.int32 if words.element_size() == 4 else torch.int16
    return words.view(int_dtype), _NEG_INF_BITS[words.dtype]


class _FusedKernel:
    """The compiled kernel, built on first use; replaced for good by the eager path if compiling fails."""

    def __init__(self) -> None:
        self._compiled: Callable[[torch.Tensor, torch.Tensor, int], None] | None = None
        self.is_unavailable = False

    def run(self, words: torch.Tensor, bitmask_words: torch.Tensor) -> bool:
        """Mask ``words`` in place; False (and nothing written) if torch.compile cannot be used here."""
        if self.is_unavailable:
            return False
        # Few graphs, shared by every call: detached views carry no view base into the guards, float16 and
        # bfloat16 share int16, and contiguous rows are flattened with their words into one dim whose size is
        # never 0 or 1, so dynamo's 0/1 specialisation never splits off a graph for batch size 1.
        bits, neg_inf_bits = _as_bits(words)
        if bits.is_contiguous():
            bits, bitmask_words = bits.view(-1, BITS_PER_WORD), bitmask_words.reshape(-1)
        elif bitmask_words.stride() != (bitmask_words.shape[1], 1):
            bitmask_words = bitmask_words.clone(memory_format=torch.contiguous_format)
        bits, bitmask_words = bits.detach(), bitmask_words.detach()
        try:
            # Grad mode is part of a graph's guards: pin it so warm-up and serving share one graph.
            with torch.no_grad():
                if self._compiled is None:
                    self._compiled = torch.compile(
                        _mask_words_fused, dynamic=True, options={"cpp.threads": COMPILED_KERNEL_THREADS}
                    )
                self._compiled(bits, bitmask_words, neg_inf_bits)
        except RuntimeError as e:  # no C++ compiler, unsupported Python, ...: every dynamo/inductor error
            logger.warning("torch.compile of the CPU bitmask kernel failed, using the eager path: %s", e)
            self.is_unavailable = True
            return False
        return True


_FUSED = _FusedKernel()


def _mask_words_eager(words: torch.Tensor, bitmask_words: torch.Tensor) -> None:
    """Branch-free bit arithmetic on the logits' bit patterns, in row chunks that keep temporaries small.

    ``keep`` is all ones where the token is allowed and zero where not, so ``(x & keep) | (-inf & ~keep)`` is
    ``x`` or exactly ``-inf`` whatever ``x`` holds (NaN and +inf included).
    """
    bits, neg_inf_bits = _as_bits(words)
    # Shifting bit j up to the sign bit, then arithmetically back down, smears it over the whole word.
    to_sign_bit = (BITS_PER_WORD - 1) - torch.arange(BITS_PER_WORD, dtype=torch.int32)
    rows_per_chunk = max(1, EAGER_CHUNK_ELEMENTS // (words.shape[1] * BITS_PER_WORD))
    for start in range(0, words.shape[0], rows_per_chunk):
        keep = (bitmask_words[start : start + rows_per_chunk].unsqueeze(-1) << to_sign_bit) >> (BITS_PER_WORD - 1)
        keep = keep.to(bits.dtype)
        chunk = bits[start : start + rows_per_chunk]
        chunk &= keep
        chunk |= keep.bitwise_not_().bitwise_and_(neg_inf_bits)


def _mask_words(words: torch.Tensor, bitmask_words: torch.Tensor, use_compiled: bool) -> None:
    if not (use_compiled and _FUSED.run(words, bitmask_words)):
        _mask_words_eager(words, bitmask_words)


def _mask_leftover_columns(logits: torch.Tensor, bitmask: torch.Tensor, start: int, rows: torch.Tensor | None) -> None:
    """Columns ``[start, vocab)``: the part of a last, partly used word, or all columns past the bitmask."""
    leftover = logits[:, start:]
    word = start // BITS_PER_WORD
    if word >= bitmask.shape[1]:
        if rows is None:
            leftover.fill_(_NEG_INF)
        else:
            leftover.index_fill_(0, rows, _NEG_INF)
        return
    shifts = torch.arange(leftover.shape[1], dtype=torch.int32)
    disallowed = ((bitmask[:, word : word + 1] >> shifts) & 1) == 0
    if rows is None:
        leftover.masked_fill_(disallowed, _NEG_INF)
    else:
        leftover[rows] = leftover[rows].masked_fill(disallowed[rows], _NEG_INF)


def _apply(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None, use_compiled: bool
) -> None:
    args = normalize_bitmask_args(logits, bitmask, indices)
    if args.logits.device.type != "cpu":
        raise ValueError(
            f"the CPU path needs CPU logits, got {args.logits.device}; "
            "use triton_ops.apply_token_bitmask_inplace to dispatch by device"
        )
    logits_2d, bitmask_2d = args.logits, args.bitmask.cpu()
    rows = None if args.rows is None else args.rows.cpu()
    if logits_2d.shape[0] == 0 or (rows is not None and rows.numel() == 0):
        return
    num_words = min(logits_2d.shape[1] // BITS_PER_WORD, bitmask_2d.shape[1])
    if num_words > 0:
        words = logits_2d[:, : num_words * BITS_PER_WORD].unflatten(1, (num_words, BITS_PER_WORD))
        bitmask_words = bitmask_2d[:, :num_words]
        if rows is None:
            _mask_words(words, bitmask_words, use_compiled)
        else:
            selected = words.index_select(0, rows)
            _mask_words(selected, bitmask_words.index_select(0, rows), use_compiled)
            words.index_copy_(0, rows, selected)
    if num_words * BITS_PER_WORD < logits_2d.shape[1]:
        _mask_leftover_columns(logits_2d, bitmask_2d, num_words * BITS_PER_WORD, rows)


def apply_token_bitmask_inplace_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed CPU logits to -inf in place with the compiled kernel (eager path if it cannot compile).

    Shapes and dtypes as ``apply_token_bitmask_inplace_reference``. The first call per dtype and vocab layout
    compiles for seconds unless ``warm_up_cpu_bitmask_kernel`` ran; later calls of any batch size reuse it.
    Only the rows in ``indices`` are read or written.
    """
    _apply(logits, bitmask, indices, use_compiled=True)


def apply_token_bitmask_inplace_cpu_eager(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """The same as ``apply_token_bitmask_inplace_cpu`` without torch.compile: vectorised torch ops only."""
    _apply(logits, bitmask, indices, use_compiled=False)


def warm_up_cpu_bitmask_kernel(vocab_size: int, dtype: torch.dtype = torch.float32) -> bool:
    """Compile the CPU kernel for ``vocab_size`` and ``dtype`` now (seconds), not on the first request.

    One graph then serves every batch size, with or without ``indices``. Returns True if the compiled kernel
    is in use, False if torch.compile is unavailable and the eager path will serve instead.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    bitmask = allocate_bitmask(2, vocab_size)
    logits = torch.zeros(2, vocab_size, dtype=dtype)
    # Two rows and one: a vocab that is not a multiple of 32 lays the two out differently.
    apply_token_bitmask_inplace_cpu(logits, bitmask)
    apply_token_bitmask_inplace_cpu(logits[:1], bitmask[:1])
    return not _FUSED.is_unavailable
