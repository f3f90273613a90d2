"""KV memory for the running requests: per-request tables of pool rows, prefix reuse, and admission by budget.

A request is admitted when the pool can hold the rest of its prompt and every token it may still generate (its
``max_new_tokens``), counting rows that eviction could free: from then on it never runs out mid-decode, while rows
are only taken as tokens arrive. A request that could never fit (prompt plus output beyond ``--max-total-tokens``)
is refused with a clear message; one that does not fit now waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy
import torch

from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.radix_cache import RadixCache, TreeNode


@dataclass(eq=False)
class KVSequence:
    """One request's cached tokens and the pool rows that hold their K/V.

    The first ``num_cached`` rows were found in the prefix cache (shared, read-only); the rest are the request's.
    ``reserved`` is the budget of rows it may still take. ``rows`` changes only through ``KVCacheManager``, which
    keeps ``row_tensor`` in step with it.
    """

    token_ids: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_cached: int = 0
    reserved: int = 0
    node: TreeNode | None = None
    _row_array: numpy.ndarray = field(default_factory=lambda: numpy.empty(0, dtype=numpy.int64), repr=False)
    _num_copied: int = field(default=0, repr=False)

    def __len__(self) -> int:
        return len(self.rows)

    def row_tensor(self) -> torch.Tensor:
        """``rows`` as int64, kept between forwards: a decode step copies its new row, not the whole table (a
        1,600-row table took ~0.1 ms to build from the list every step, 32 of them ~2.6 ms). The rows are kept
        and copied by NumPy, the tensor sharing their memory: a torch copy of one row cost tens of µs after a step
        (``ForwardBatch``)."""
        num_rows = len(self.rows)
        if num_rows > self._row_array.shape[0]:
            grown = numpy.empty(max(num_rows, 2 * self._row_array.shape[0], 64), dtype=numpy.int64)
            grown[: self._num_copied] = self._row_array[: self._num_copied]
            self._row_array = grown
        if self._num_copied < num_rows:
            self._row_array[self._num_copied : num_rows] = self.rows[self._num_copied :]
            self._num_copied = num_rows
        return torch.from_numpy(self._row_array[:num_rows])

    def rows_changed_from(self, index: int) -> None:
        """Rows from ``index`` on were dropped or replaced: ``row_tensor`` copies them again."""
        self._num_copied = min(self._num_copied, index)


class KVCacheManager:
    """The pool, the prefix cache (None with ``--disable-radix-cache``) and the reserved budget."""

    def __init__(self, pool: TokenKVPool, use_radix_cache: bool = True) -> None:
        self.pool = pool
        self.radix = RadixCache(pool) if use_radix_cache else None
        self.num_reserved = 0
        self.num_prompt_tokens = 0
        self.num_cached_prompt_tokens = 0

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def num_available(self) -> int:
        """Rows neither held by a request, nor reserved, nor locked in the cache."""
        evictable = self.radix.num_evictable if self.radix is not None else 0
        return self.pool.num_free + evictable - self.num_reserved

    @property
    def cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens whose K/V came from the prefix cache."""
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    def check_fits(self, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise ``ValueError`` for a request that could never be admitted, naming the bound."""
        if num_prompt_tokens + max_new_tokens > self.capacity:
            raise ValueError(
                f"the prompt ({num_prompt_tokens} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the KV "
                f"cache's --max-total-tokens {self.capacity}: shorten the request or raise --max-total-tokens"
            )

    def admit(self, prompt_ids: list[int], max_new_tokens: int) -> KVSequence | None:
        """A sequence for a new request, starting from its longest cached prefix (never the whole prompt: its last
        token must run to give logits), with its budget reserved; None when it does not fit now."""
        rows: list[int] = []
        node = None
        if self.radix is not None:
            rows, node = self.radix.match_prefix(prompt_ids[:-1])
            self.radix.lock(node)
        need = len(prompt_ids) - len(rows) + max_new_tokens
        if need > self.num_available:
            if self.radix is not None and node is not None:
                self.radix.unlock(node)
            return None
        self.num_reserved += need
        self.num_prompt_tokens += len(prompt_ids)
        self.num_cached_prompt_tokens += len(rows)
        return KVSequence(list(prompt_ids[: len(rows)]), list(rows), len(rows), need, node)

    def append(self, seq: KVSequence, token_ids: list[int]) -> list[int]:
        """Rows for ``token_ids`` appended to ``seq`` (taken from its budget, evicting cache leaves if needed)."""
        if len(token_ids) > seq.reserved:
            raise ValueError(f"{len(token_ids)} new tokens exceed the {seq.reserved} the request reserved")
        shortfall = len(token_ids) - self.pool.num_free
        if shortfall > 0 and self.radix is not None:
            self.radix.evict(shortfall)
        rows = self.pool.allocate(len(token_ids))
        seq.rows += rows
        seq.token_ids += token_ids
        seq.reserved -= len(rows)
        self.num_reserved -= len(rows)
        return rows

    def truncate(self, seq: KVSequence, length: int) -> None:
        """Keep ``seq``'s first ``length`` tokens (a rollback); their rows return to its budget."""
        if not seq.num_cached <= length <= len(seq):
            raise ValueError(f"cannot truncate a sequence of {len(seq)} tokens ({seq.num_cached} shared) to {length}")
        dropped = seq.rows[length:]
        self.pool.free(dropped)
        del seq.rows[length:], seq.token_ids[length:]
        seq.rows_changed_from(length)
        seq.reserved += len(dropped)
        self.num_reserved += len(dropped)

    def share_prefix(self, seq: KVSequence, num_tokens: int) -> None:
        """Cache ``seq``'s first ``num_tokens`` now, while it runs, so that requests admitted after it (``n``
        samples of one prompt) reuse them: they become ``seq``'s shared rows, locked until it is released. Nothing
        happens if another request cached part of them meanwhile (its rows, not ``seq``'s, hold that part)."""
        if self.radix is None or not seq.num_cached < num_tokens <= len(seq):
            return
        token_ids = seq.token_ids[:num_tokens]
        cached_rows, _ = self.radix.match_prefix(token_ids)
        if len(cached_rows) != seq.num_cached:
            return
        self.radix.insert(token_ids, seq.rows[:num_tokens])
        _, shared = self.radix.match_prefix(token_ids)
        self.radix.lock(shared)
        if seq.node is not None:
            self.radix.unlock(seq.node)
        seq.node, seq.num_cached = shared, num_tokens

    def can_share_prompt(self, leader: KVSequence, prompt_ids: list[int]) -> bool:
        """Whether ``share_prompt`` will hand ``prompt_ids`` over from ``leader`` once it has run them: the prefix
        cache is on and holds no more of them than ``leader`` reused."""
        return self.radix is not None and len(self.radix.match_prefix(prompt_ids)[0]) == leader.num_cached

    def share_prompt(self, leader: KVSequence, follower: KVSequence, num_tokens: int) -> None:
        """``follower`` (admitted for the same prompt) takes ``leader``'s first ``num_tokens`` rows, just computed, as
        its cached prefix: the two read the same K/V, so their outputs start from the same bits (a cached prefix
        otherwise ends one token short of a prompt, whose last token runs again). The reservation it made for
        those tokens is returned."""
        if self.radix is None:
            raise RuntimeError("sharing a prompt needs the prefix cache")
        self.share_prefix(leader, num_tokens)
        if leader.num_cached != num_tokens or follower.token_ids != leader.token_ids[: follower.num_cached]:
            raise RuntimeError("the leader's prompt could not be shared (check can_share_prompt first)")
        rows, node = self.radix.match_prefix(leader.token_ids[:num_tokens])
        self.radix.lock(node)
        if follower.node is not None:
            self.radix.unlock(follower.node)
        gained = num_tokens - follower.num_cached
        follower.reserved -= gained
        self.num_reserved -= gained
        self.num_cached_prompt_tokens += gained
        follower.token_ids, follower.rows, follower.num_cached, follower.node = (
            leader.token_ids[:num_tokens],
            list(rows),
            num_tokens,
            node,
        )
        follower.rows_changed_from(0)

    def release(self, seq: KVSequence) -> None:
        """The request is done: its tokens enter the prefix cache (duplicates freed), its budget is returned."""
        self.num_reserved -= seq.reserved
        seq.reserved = 0
        if self.radix is None:
            self.pool.free(seq.rows)
        else:
            num_known = self.radix.insert(seq.token_ids, seq.rows)
            self.pool.free(seq.rows[seq.num_cached : num_known])
            if seq.node is not None:
                self.radix.unlock(seq.node)
        seq.rows, seq.token_ids, seq.node = [], [], None
        seq.rows_changed_from(0)

    def flush(self) -> int:
        """Drop every cached prefix no running request reads; returns the rows freed."""
        return self.radix.evict(self.radix.num_evictable) if self.radix is not None else 0
