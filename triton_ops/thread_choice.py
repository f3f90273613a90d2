"""How many threads a CPU mask apply gets: one, or all of torch's, whichever has lately been faster here.

Neither wins everywhere, and the shape alone does not decide it. On this 2-core machine, with the other core free,
two threads masked 8-32 rows of a 49k-248k vocab ~1.5x faster than one. When another process keeps a core busy,
an OpenMP region waits for its descheduled thread: the same parallel applies then took 4-20 ms where one thread
took 0.1-13 ms. So both counts are timed as they run, per size class (a power of two of logits), the cheaper one
per logit serves, and the other is re-timed now and then to notice when the load changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PARALLEL_MIN_ELEMENTS = 1 << 17
"""Below this many logits (a few rows of 49k tokens, tens of µs on one thread) one thread always serves: a stalled
OpenMP region would cost far more than a second thread could save."""

RETIME_EVERY = 16
"""In each size class, every this many applies the count that is currently slower runs once, to re-time it."""

SMOOTHING = 0.25
"""Weight of the newest timing in a count's running cost per logit."""


@dataclass
class _SizeClass:
    seconds_per_element: dict[int, float] = field(default_factory=dict)
    num_applies: int = 0


class ThreadChoice:
    """Picks the thread count of each apply from the running cost per logit of one thread and of ``max_threads``.

    Not thread-safe, and needs not be: a stale or lost update only moves a running average.
    """

    def __init__(self) -> None:
        self._size_classes: dict[int, _SizeClass] = {}

    def threads_for(self, num_elements: int, max_threads: int) -> int:
        """The thread count, 1 or ``max_threads``, for masking ``num_elements`` logits; time it into ``record``."""
        if num_elements < PARALLEL_MIN_ELEMENTS or max_threads <= 1:
            return 1
        size_class = self._size_classes.setdefault(num_elements.bit_length(), _SizeClass())
        size_class.num_applies += 1
        costs = size_class.seconds_per_element
        counts = (1, max_threads)
        untimed = [threads for threads in counts if threads not in costs]
        if untimed:
            return untimed[0]
        faster, slower = sorted(counts, key=costs.__getitem__)
        return slower if size_class.num_applies % RETIME_EVERY == 0 else faster

    def record(self, threads: int, num_elements: int, seconds: float) -> None:
        """Fold the time of one apply on ``threads`` threads into that count's running cost for its size class."""
        size_class = self._size_classes.get(num_elements.bit_length())
        if size_class is None:
            return
        cost = seconds / num_elements
        previous = size_class.seconds_per_element.get(threads)
        size_class.seconds_per_element[threads] = cost if previous is None else previous + SMOOTHING * (cost - previous)
