"""The thread count of a CPU mask apply: one below the size that could pay for threads, else the count with the
lower median recent cost in that size class, with the slower one re-timed every ``RETIME_EVERY`` applies."""

from __future__ import annotations

from triton_ops.thread_choice import PARALLEL_MIN_ELEMENTS, RECENT_APPLIES, RETIME_EVERY, ThreadChoice

LARGE = PARALLEL_MIN_ELEMENTS * 4


def run(choice: ThreadChoice, num_elements: int, seconds_by_threads: dict[int, float], calls: int) -> list[int]:
    """The counts chosen over ``calls`` applies that each take ``seconds_by_threads[threads]``."""
    chosen = []
    for _ in range(calls):
        threads = choice.threads_for(num_elements, max_threads=2)
        choice.record(threads, num_elements, seconds_by_threads[threads])
        chosen.append(threads)
    return chosen


def test_small_applies_and_a_single_thread_budget_take_one_thread() -> None:
    choice = ThreadChoice()
    assert run(choice, PARALLEL_MIN_ELEMENTS - 1, {1: 1.0, 2: 0.1}, 40) == [1] * 40
    assert all(choice.threads_for(LARGE, max_threads=1) == 1 for _ in range(40))


def test_both_counts_are_timed_then_the_faster_serves_and_the_slower_is_retimed() -> None:
    chosen = run(ThreadChoice(), LARGE, {1: 2e-3, 2: 1e-3}, 3 * RETIME_EVERY)
    timing = 2 * RECENT_APPLIES
    assert chosen[:timing] == [1] * RECENT_APPLIES + [2] * RECENT_APPLIES
    assert [i for i, threads in enumerate(chosen, start=1) if threads == 1 and i > timing] == [
        RETIME_EVERY,
        2 * RETIME_EVERY,
        3 * RETIME_EVERY,
    ]


def test_one_stall_while_timing_does_not_decide() -> None:
    choice = ThreadChoice()
    stalls = iter([False, False, False, True, False, False])
    for _ in range(2 * RECENT_APPLIES):
        threads = choice.threads_for(LARGE, max_threads=2)
        choice.record(threads, LARGE, 15e-3 if next(stalls) else {1: 2e-3, 2: 1e-3}[threads])
    assert choice.threads_for(LARGE, max_threads=2) == 2


def test_stalled_parallel_applies_hand_over_to_one_thread_and_back_when_the_stalls_end() -> None:
    choice = ThreadChoice()
    assert run(choice, LARGE, {1: 2e-3, 2: 1e-3}, RETIME_EVERY - 1)[-1] == 2
    # Another process takes the second core: every parallel apply waits for its descheduled thread.
    assert run(choice, LARGE, {1: 2e-3, 2: 15e-3}, RETIME_EVERY)[-RETIME_EVERY // 2 :] == [1] * (RETIME_EVERY // 2)
    # The core is free again: re-timing finds the parallel kernel fast, and it serves again.
    assert run(choice, LARGE, {1: 2e-3, 2: 1e-3}, 8 * RETIME_EVERY)[-RETIME_EVERY // 2 :] == [2] * (RETIME_EVERY // 2)


def test_size_classes_choose_apart() -> None:
    choice = ThreadChoice()
    run(choice, LARGE, {1: 2e-3, 2: 1e-3}, 2 * RECENT_APPLIES)
    run(choice, LARGE * 8, {1: 1e-3, 2: 2e-3}, 2 * RECENT_APPLIES)
    assert choice.threads_for(LARGE, max_threads=2) == 2
    assert choice.threads_for(LARGE * 8, max_threads=2) == 1


def test_an_occasional_stall_keeps_the_parallel_kernel() -> None:
    choice = ThreadChoice()
    chosen = []
    for apply_index in range(10 * RETIME_EVERY):
        threads = choice.threads_for(LARGE, max_threads=2)
        stalled = threads == 2 and apply_index % 10 == 0
        choice.record(threads, LARGE, 15e-3 if stalled else {1: 2e-3, 2: 1e-3}[threads])
        chosen.append(threads)
    assert chosen.count(1) <= RECENT_APPLIES + len(chosen) // RETIME_EVERY, "one thread only to time it"
