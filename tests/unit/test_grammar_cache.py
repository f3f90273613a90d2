"""The bounded LRU cache of compiled grammars: entry and byte bounds, recency, oversized entries."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_constrained.cache.memory import GrammarCache


def test_least_recently_used_entry_is_evicted_first() -> None:
    cache: GrammarCache[str, str] = GrammarCache(max_entries=2, max_bytes=1000)
    cache.put("a", "A", 10)
    cache.put("b", "B", 10)
    assert cache.get("a") == "A"  # "b" is now the least recently used
    cache.put("c", "C", 10)
    assert "b" not in cache
    assert cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.num_evictions == 1


def test_byte_bound_evicts_until_under_the_limit() -> None:
    cache: GrammarCache[str, str] = GrammarCache(max_entries=100, max_bytes=100)
    for key in "abcd":
        cache.put(key, key.upper(), 30)
    assert len(cache) == 3 and "a" not in cache
    cache.put("big", "BIG", 90)
    assert list(k for k in "abcd" if k in cache) == []
    assert cache.num_bytes == 90


def test_entry_larger_than_the_byte_bound_is_not_stored() -> None:
    cache: GrammarCache[str, str] = GrammarCache(max_entries=10, max_bytes=50)
    cache.put("small", "s", 10)
    cache.put("huge", "h", 51)
    assert "huge" not in cache and "small" in cache


def test_replacing_a_key_updates_its_size() -> None:
    cache: GrammarCache[str, str] = GrammarCache(max_entries=10, max_bytes=100)
    cache.put("a", "old", 60)
    cache.put("a", "new", 20)
    assert cache.get("a") == "new" and cache.num_bytes == 20


def test_negative_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        GrammarCache(max_entries=-1, max_bytes=10)


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), max_size=200),
    st.integers(1, 8),
    st.integers(1, 120),
)
def test_bounds_always_hold(operations: list[tuple[int, int]], max_entries: int, max_bytes: int) -> None:
    cache: GrammarCache[int, int] = GrammarCache(max_entries=max_entries, max_bytes=max_bytes)
    for key, size in operations:
        cache.put(key, key, size)
        assert len(cache) <= max_entries
        assert cache.num_bytes <= max_bytes
        if size <= max_bytes:
            assert cache.get(key) == key  # the newest entry always survives its own insertion
