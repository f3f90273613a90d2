"""A least-recently-used cache of compiled grammars, bounded in entries and in bytes."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class GrammarCache(Generic[K, V]):
    """LRU map with two bounds; both are enforced on every ``put``, evicting the least recently used first.

    Not thread-safe: ``CompileService`` guards it with its lock. An entry larger than ``max_bytes`` on
    its own is not stored at all.
    """

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("grammar cache bounds must be non-negative")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.num_bytes = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The cached value (now the most recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        return entry[0]

    def put(self, key: K, value: V, num_bytes: int) -> None:
        self._remove(key)
        if self.max_entries == 0 or num_bytes > self.max_bytes:
            return
        self._entries[key] = (value, num_bytes)
        self.num_bytes += num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
            self.num_evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def _remove(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry[1]
