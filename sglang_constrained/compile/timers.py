"""Callbacks run at their times on one thread: every compile's deadline, without a thread each."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Timers:
    """One thread that runs callbacks at their times (one thread for every compile, not one each). Started on the
    first call; where no thread can start (the interpreter is exiting), nothing is timed."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the timer thread once ``time.monotonic()`` reaches ``when``."""
        with self._condition:
            if self._stopped:
                return
            heapq.heappush(self._heap, (when, next(self._order), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                with contextlib.suppress(RuntimeError):
                    self._thread.start()
            self._condition.notify()

    def stop(self) -> None:
        with self._condition:
            self._stopped = True
            self._heap.clear()
            self._condition.notify()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._condition.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopped:
                    return
                _, _, callback = heapq.heappop(self._heap)
            try:
                callback()
            except Exception:  # a bug in a callback must not stop every later deadline
                logger.exception("%s: a timed callback failed", self._name)
