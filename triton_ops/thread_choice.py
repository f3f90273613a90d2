"""How many threads a CPU mask apply gets: one, or all of torch's, whichever is currently faster here.

Neither wins everywhere, and the shape alone does not decide it: with the other cores free, all threads mask a
batch faster than one; when another process keeps a core busy, an OpenMP region waits for its descheduled thread,
and nearly every parallel apply then takes many times what one thread takes (figures in docs/benchmarks.md). So both
counts are timed as they run,
per size class (a power of two of logits), and the one with the lower median cost per logit over its last few
applies serves; the other is re-timed now and then to notice when the load changes.

The median, not the mean: a parallel kernel that stalls now and then (one apply in ten, say) keeps serving,
as it is still faster in the usual case, but one that stalls in two of its last three applies gives way to one
thread.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PARALLEL_MIN_ELEMENTS = 1 << 17
"""Below this many logits (a few rows of 49k tokens, tens of µs on one thread) one thread always serves: a stalled
OpenMP region would cost far more than a second thread could save."""

RETIME_EVERY = 8
"""In each size class, every this many applies the count that is currently slower runs once, to re-time it. Stalls
came in spells (in one interleaved run 78 of 80 parallel applies stalled at one shape, 7 of 80 at the next), and a
spell's end is noticed after two re-timings; each costs a stall while the spell lasts, or one apply at one thread's
speed while the machine is quiet."""

RECENT_APPLIES = 3
"""Applies per thread count whose median cost decides."""


@dataclass
class _SizeClass:
    seconds_per_element: dict[int, deque[float]] = field(default_factory=dict)
    num_applies: int = 0

    def num_timings(self, threads: int) -> int:
        return len(self.seconds_per_element.get(threads, ()))

    def median_cost(self, threads: int) -> float:
        return statistics.median(self.seconds_per_element[threads])


class ThreadChoice:
    """Picks the thread count of each apply, 1 or ``max_threads``, from the recent costs per logit of both.

    Not thread-safe, and needs not be: a lost update only drops one timing.
    """

    def __init__(self) -> None:
        self._size_classes: dict[int, _SizeClass] = {}

    def threads_for(self, num_elements: int, max_threads: int) -> int:
        """The thread count for masking ``num_elements`` logits; time the apply into ``record``."""
        if num_elements < PARALLEL_MIN_ELEMENTS or max_threads <= 1:
            return 1
        size_class = self._size_classes.setdefault(num_elements.bit_length(), _SizeClass())
        size_class.num_applies += 1
        counts = (1, max_threads)
        # Each count is timed RECENT_APPLIES times before the first choice, so that one stall cannot decide it.
        untimed = [threads for threads in counts if size_class.num_timings(threads) < RECENT_APPLIES]
        if untimed:
            return untimed[0]
        faster, slower = sorted(counts, key=size_class.median_cost)
        return slower if size_class.num_applies % RETIME_EVERY == 0 else faster

    def record(self, threads: int, num_elements: int, seconds: float) -> None:
        """Add the time of one apply on ``threads`` threads to that count's recent costs for its size class."""
        size_class = self._size_classes.get(num_elements.bit_length())
        if size_class is not None:
            recent = size_class.seconds_per_element.setdefault(threads, deque(maxlen=RECENT_APPLIES))
            recent.append(seconds / num_elements)
