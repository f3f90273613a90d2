"""Row addresses in a CPU int32 bitmask, for engines that write masks through raw pointers (llguidance, outlines).

A wrong buffer handed to such an engine is memory corruption, not an error, so the buffer is checked; but the
checks (dtype, device, shape, strides) cost about as much as a whole mask fill of a DFA engine, and the scheduler
hands every grammar the same buffer at every step. A buffer is therefore checked the first time it is seen at a
given data pointer. That is sound: every in-place change that could make a later write land outside the
buffer's storage (``set_``, a growing ``resize_``) moves the data pointer, and a shrinking ``resize_`` keeps the
storage, so the rows checked before still lie inside it.
"""

from __future__ import annotations

import torch


class BitmaskRowAddresser:
    """Checks a ``[batch, words]`` bitmask once per buffer and turns row indices into byte addresses."""

    def __init__(self, min_words: int, owner: str) -> None:
        self.min_words = min_words
        self.owner = owner
        self._mask: torch.Tensor | None = None
        self._data_ptr = 0
        self._num_rows = 0
        self._row_stride = 0
        self.row_words = 0

    def row_address(self, vocab_mask: torch.Tensor, idx: int) -> int:
        """Byte address of row ``idx`` (negative counts from the end); raises ``ValueError`` for a buffer the
        engine cannot write into and ``IndexError`` for a row outside it. ``row_words`` is the row's width."""
        data_ptr = vocab_mask.data_ptr()
        if vocab_mask is not self._mask or data_ptr != self._data_ptr:
            self._check(vocab_mask)
            self._mask, self._data_ptr = vocab_mask, data_ptr
        if not -self._num_rows <= idx < self._num_rows:
            raise IndexError(f"row {idx} is out of range for a vocab mask of {self._num_rows} rows")
        return data_ptr + (idx % self._num_rows) * self._row_stride * 4

    def _check(self, vocab_mask: torch.Tensor) -> None:
        shape = tuple(vocab_mask.shape)
        strides = vocab_mask.stride()
        if (
            vocab_mask.dtype is not torch.int32
            or not vocab_mask.is_cpu
            or len(shape) != 2
            or strides[1] != 1
            or strides[0] < shape[1]
            or shape[1] < self.min_words
        ):
            raise ValueError(
                f"the {self.owner} backend fills int32 CPU bitmasks of shape [batch, words] with contiguous rows of at "
                f"least {self.min_words} words per row (see allocate_vocab_mask); got a {vocab_mask.dtype} "
                f"tensor of shape {list(shape)} on {vocab_mask.device}"
            )
        self._num_rows, self.row_words = shape
        self._row_stride = strides[0]
