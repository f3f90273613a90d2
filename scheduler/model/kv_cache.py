"""A preallocated key/value cache: a fixed number of slots, each holding one sequence up to ``max_seq_len``."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of every layer for ``num_slots`` sequences of up to ``max_seq_len`` tokens.

    ``k`` and ``v`` have shape ``[num_layers, num_slots, num_kv_heads, max_seq_len, head_dim]`` and are
    allocated once. They start zeroed and positions at or past a slot's length hold zeros or stale finite
    values, never NaN, so a masked-out padded read can never poison attention (0 x NaN would).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        if num_slots <= 0 or max_seq_len <= 0:
            raise ValueError(f"a KV cache needs positive slots and length, not {num_slots} x {max_seq_len}")
        shape = (num_layers, num_slots, num_kv_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self._lengths = [0] * num_slots
        self._in_use = [False] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest slot first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        """Reserve an empty slot for a new sequence; raise RuntimeError when all are in use."""
        if not self._free:
            raise RuntimeError(
                f"no free KV-cache slot: all {self.num_slots} hold running sequences; check can_allocate() "
                "before admitting a request, or raise --max-running-requests"
            )
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Release ``slot``; its cached positions are forgotten (not cleared)."""
        self._check_in_use(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)

    def length(self, slot: int) -> int:
        """Tokens cached for the sequence in ``slot``."""
        self._check_in_use(slot)
        return self._lengths[slot]

    def check_append(self, slot: int, num_new: int) -> int:
        """Validate appending ``num_new`` tokens to ``slot`` and return the first new position; changes nothing."""
        start = self.length(slot)
        if num_new <= 0:
            raise ValueError(f"appending to slot {slot} needs at least one token, got {num_new}")
        if start + num_new > self.max_seq_len:
            raise ValueError(
                f"slot {slot} holds {start} tokens; {num_new} more would exceed --max-seq-len "
                f"{self.max_seq_len}: finish the request (finish_reason 'length') or raise --max-seq-len"
            )
        return start

    def append(self, slot: int, num_new: int) -> int:
        """Record ``num_new`` more cached tokens in ``slot`` (after check_append) and return the first new position."""
        start = self.check_append(slot, num_new)
        self._lengths[slot] = start + num_new
        return start

    def truncate(self, slot: int, length: int) -> None:
        """Drop cached positions ``length`` and beyond (rollback); the next token is written at ``length``."""
        current = self.length(slot)
        if not 0 <= length <= current:
            raise ValueError(f"cannot truncate slot {slot} to {length} tokens: it holds {current}")
        self._lengths[slot] = length

    def _check_in_use(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or not self._in_use[slot]:
            raise ValueError(f"KV-cache slot {slot} is not allocated (slots: 0..{self.num_slots - 1})")
