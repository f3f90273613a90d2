"""The key/value pool: one row of K and V per cached token, handed out lowest first, so memory follows the tokens.

``k`` and ``v`` are ``[num_layers, capacity + 1, num_kv_heads, head_dim]``, allocated with ``torch.empty``: the
operating system backs pages only once they are written, and the lowest-free-first hand-out keeps the written
region as small as the tokens held at the peak. Row 0 is zero and never handed out: padded reads point there, so
a masked-out read never meets a stale NaN (0 x NaN would poison attention).
"""

from __future__ import annotations

import heapq

import torch

PADDING_ROW = 0


class OutOfTokensError(RuntimeError):
    """The pool holds fewer free rows than asked for (the cache manager evicts or waits first)."""


class TokenKVPool:
    """K/V rows for ``capacity`` tokens; ``allocate`` and ``free`` move rows between requests and the free heap."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"a KV pool needs room for at least one token, not {capacity}")
        shape = (num_layers, capacity + 1, num_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, PADDING_ROW] = 0
        self.v[:, PADDING_ROW] = 0
        self.capacity = capacity
        self._free = list(range(1, capacity + 1))  # already a heap: sorted ascending

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer."""
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def allocate(self, num_tokens: int) -> list[int]:
        """``num_tokens`` free rows, lowest first; raises ``OutOfTokensError`` without taking any if short."""
        if num_tokens > len(self._free):
            raise OutOfTokensError(f"{num_tokens} KV rows asked for, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(num_tokens)]

    def free(self, rows: list[int]) -> None:
        for row in rows:
            heapq.heappush(self._free, row)
