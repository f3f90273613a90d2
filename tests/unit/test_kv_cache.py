"""KV memory bookkeeping on its own (no model): rows are never lost or shared by mistake, the prefix cache reuses
what requests share and evicts least recently used leaves, and admission keeps every running request's budget."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.model.kv_cache import KVCacheManager, KVSequence
from scheduler.model.kv_pool import PADDING_ROW, OutOfTokensError, TokenKVPool


def manager(capacity: int, radix: bool = True) -> KVCacheManager:
    return KVCacheManager(TokenKVPool(1, capacity, 1, 2, torch.float32, "cpu"), use_radix_cache=radix)


def check_invariants(kv: KVCacheManager, running: list[KVSequence]) -> None:
    """Every row is free, cached, or owned by exactly one running request; the budget adds up; each request's row
    tensor, which its forwards read, holds its rows."""
    assert all(seq.row_tensor().tolist() == seq.rows for seq in running)
    owned = [row for seq in running for row in seq.rows[seq.num_cached :]]
    assert len(owned) == len(set(owned)) and PADDING_ROW not in owned
    cached = kv.radix.num_tokens if kv.radix is not None else 0
    assert kv.pool.num_free + cached + len(owned) == kv.capacity
    assert kv.num_reserved == sum(seq.reserved for seq in running) >= 0
    assert kv.num_available >= 0


def test_the_pool_hands_out_the_lowest_rows_and_never_the_padding_row() -> None:
    pool = TokenKVPool(2, 5, 1, 2, torch.float32, "cpu")
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2])
    assert pool.allocate(2) == [2, 4]
    with pytest.raises(OutOfTokensError):
        pool.allocate(2)
    assert torch.count_nonzero(pool.k[:, PADDING_ROW]) == 0


def test_a_shared_prefix_is_reused_and_only_the_rest_is_computed() -> None:
    kv = manager(64)
    first = kv.admit([1, 2, 3, 4, 5], max_new_tokens=2)
    assert first is not None and first.num_cached == 0
    kv.append(first, [1, 2, 3, 4, 5])
    kv.append(first, [9])
    kv.release(first)
    second = kv.admit([1, 2, 3, 7], max_new_tokens=2)
    assert second is not None and second.num_cached == 3 and second.rows == first_rows(kv, [1, 2, 3])
    same = kv.admit([1, 2, 3, 4, 5], max_new_tokens=2)
    assert same is not None and same.num_cached == 4  # never the whole prompt: its last token must run
    assert kv.cache_hit_rate == pytest.approx(7 / 14)


def first_rows(kv: KVCacheManager, tokens: list[int]) -> list[int]:
    assert kv.radix is not None
    rows, _ = kv.radix.match_prefix(tokens)
    return rows


def test_admission_waits_when_full_evicts_unlocked_prefixes_and_refuses_what_never_fits() -> None:
    kv = manager(10)
    with pytest.raises(ValueError, match="--max-total-tokens 10"):
        kv.check_fits(8, 3)
    a = kv.admit([1, 2, 3, 4], max_new_tokens=4)
    assert a is not None
    kv.append(a, [1, 2, 3, 4])
    assert kv.admit([5, 6, 7], max_new_tokens=1) is None  # 8 reserved, 2 left: it waits
    kv.release(a)  # its 4 rows stay cached, but unlocked: they count as available
    b = kv.admit([5, 6, 7, 8, 9, 10, 11], max_new_tokens=3)
    assert b is not None
    kv.append(b, [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # takes the cached rows back through eviction
    assert kv.radix is not None and kv.radix.num_tokens == 0
    check_invariants(kv, [b])


def test_without_the_radix_cache_rows_return_to_the_pool() -> None:
    kv = manager(8, radix=False)
    seq = kv.admit([1, 2, 3], max_new_tokens=2)
    assert seq is not None
    kv.append(seq, [1, 2, 3])
    kv.release(seq)
    assert kv.pool.num_free == 8 and kv.admit([1, 2, 3], max_new_tokens=1).num_cached == 0  # type: ignore[union-attr]


@settings(max_examples=120, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["admit", "append", "truncate", "release"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=6),
            st.integers(0, 10),
        ),
        max_size=60,
    )
)
def test_bookkeeping_holds_under_any_sequence_of_operations(operations: list[tuple[str, list[int], int]]) -> None:
    kv = manager(24)
    running: list[KVSequence] = []
    for operation, tokens, pick in operations:
        if operation == "admit":
            seq = kv.admit(tokens, max_new_tokens=pick % 4 + 1)
            if seq is not None:
                kv.append(seq, tokens[len(seq) :])
                running.append(seq)
        elif running:
            seq = running[pick % len(running)]
            if operation == "append" and seq.reserved:
                kv.append(seq, tokens[: seq.reserved])
            elif operation == "truncate":
                kv.truncate(seq, seq.num_cached + pick % (len(seq) - seq.num_cached + 1))
            elif operation == "release":
                kv.release(seq)
                running.remove(seq)
        check_invariants(kv, running)
    for seq in running:
        kv.release(seq)
    check_invariants(kv, [])
    assert kv.num_reserved == 0


def test_a_running_request_shares_its_prompt_with_requests_admitted_after_it() -> None:
    """``n`` samples of one prompt: the first one's prompt rows are cached right after its prefill, the others
    start from them; whatever order they finish in, no row is lost or freed twice."""
    kv = manager(64)
    prompt = [1, 2, 3, 4, 5]
    first = kv.admit(prompt, max_new_tokens=4)
    assert first is not None
    kv.append(first, prompt)
    kv.share_prefix(first, len(prompt))
    assert first.num_cached == len(prompt)
    check_invariants(kv, [first])
    siblings = [kv.admit(prompt, max_new_tokens=4) for _ in range(3)]
    assert all(s is not None and s.num_cached == len(prompt) - 1 for s in siblings)
    running = [first, *[s for s in siblings if s is not None]]
    for seq in running:
        kv.append(seq, [9] if seq is first else [5, 9])
    check_invariants(kv, running)
    kv.flush()  # the shared prompt is locked while its requests run
    assert first_rows(kv, prompt) == first.rows[: len(prompt)]
    for seq in [running[2], running[0], running[1], running[3]]:
        kv.release(seq)
        running.remove(seq)
        check_invariants(kv, running)
    assert kv.num_available == kv.capacity


def test_requests_admitted_with_a_prompt_take_its_whole_kv_from_the_one_that_runs_it() -> None:
    """``n`` samples admitted in one batch: only the first runs the prompt; the others then hold all of its rows (the
    last token's too) as their cached prefix, their reservation for the prompt is returned, and no row is lost or freed
    twice whatever order they finish in."""
    kv = manager(64)
    prompt = [1, 2, 3, 4, 5]
    leader = kv.admit(prompt, max_new_tokens=4)
    followers = [kv.admit(prompt, max_new_tokens=4) for _ in range(3)]
    assert leader is not None and all(f is not None for f in followers)
    running = [leader, *[f for f in followers if f is not None]]
    assert all(kv.can_share_prompt(leader, prompt) for _ in running)
    kv.append(leader, prompt)
    for follower in running[1:]:
        kv.share_prompt(leader, follower, len(prompt))
        assert follower.rows == leader.rows[: len(prompt)] and follower.num_cached == len(prompt)
        assert follower.reserved == 4
    check_invariants(kv, running)
    for i, seq in enumerate(running):
        kv.append(seq, [10 + i])
    check_invariants(kv, running)
    for seq in [running[2], running[0], running[3], running[1]]:
        kv.release(seq)
        running.remove(seq)
        check_invariants(kv, running)
    assert kv.num_available == kv.capacity
