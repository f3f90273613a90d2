"""Compiling off the caller's thread: slots for compiles, a deadline per compile, a bounded cache, one compile per key.

``CompileService.get`` answers a cached key with a copy at once and any other key with a ``Future`` of a copy of
its own; identical keys asked for while one compiles share that compile, and each one asked for gives it its full
deadline again: a compile whose first requester left (a client that disconnected) keeps running for the one who
asked again, instead of failing it at the first one's deadline. A compile waits for one of ``threads`` slots and
runs on a thread of its own at a lower CPU priority; its deadline counts from its start, so that a compile queued
behind others is not failed for their slowness. A compile still running after ``slow_after_s``
leaves its slot for the slow lane (at most ``max_slow`` at once; a compile process drops to the lowest CPU
priority), so that one slow constraint never holds up the new ones behind it. A compile past its deadline fails
its futures with ``CompileTimeoutError``; one that could not start within the deadline fails with
``CompileNotStartedError`` (it waited; it was not slow). Either is forgotten: the next request compiles anew, a
late result is dropped.

The caller decides when a value enters the cache (``store``), so that every rank of a multi-rank server makes
the same hit-or-miss decision for the same request. ``compile_elsewhere`` makes misses ask another source (another
process that compiles once for many) instead of the slots; cache, dedup and deadline stay. ``submit`` compiles
once outside the cache for another compile (``auto`` asks its backends so). Generic over keys and values: it
knows nothing of grammars. ``CompileControl`` carries a compile's deadline, cancellation and slowness to whatever
works on it (``compile.processes`` kills a child process on cancellation; ``compile.control``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from sglang_constrained.cache.memory import GrammarCache
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.futures import cancel, map_future, relay, settle
from sglang_constrained.compile.timers import Timers
from sglang_constrained.cpu_priority import COMPILE_NICENESS, set_nice, thread_nice
from sglang_constrained.errors import (
    COMPILE_NOT_STARTED_PREFIX,
    COMPILE_TIMEOUT_PREFIX,
    CompileNotStartedError,
    CompileTimeoutError,
)

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False)
class _Job(Generic[K, V]):
    """One compile: queued, then running on its own thread with its own control."""

    key: K
    shared: Future[V]
    queued_at: float
    start_by: float
    parent: CompileControl | None = None
    compile_value: Callable[[K, CompileControl], V] | None = None
    control: CompileControl | None = None
    is_slow: bool = False


class CompileService(Generic[K, V]):
    """``compile_value(key, control)`` in ``threads`` slots, each compile on a thread of its own; results cached
    under ``cache_max_entries``/``_bytes``.

    ``size_of(value)`` is what a value counts towards the byte bound; ``copy(value, is_cache_hit)`` makes the
    private copy each caller receives. ``slow_after_s``: how long a compile may hold its slot before it moves to
    the slow lane (None: never); ``max_slow``: compiles the slow lane holds at once.
    """

    def __init__(
        self,
        compile_value: Callable[[K, CompileControl], V],
        *,
        name: str,
        threads: int,
        timeout_s: float,
        cache_max_entries: int,
        cache_max_bytes: int,
        size_of: Callable[[V], int],
        copy: Callable[[V, bool], V],
        slow_after_s: float | None = None,
        max_slow: int = 0,
    ) -> None:
        self._compile = compile_value
        self._size_of = size_of
        self._copy = copy
        self.name = name
        self.threads = threads
        self.timeout_s = timeout_s
        self.slow_after_s = slow_after_s
        self.max_slow = max_slow
        self.cache: GrammarCache[K, V] = GrammarCache(cache_max_entries, cache_max_bytes)
        self._in_flight: dict[K, Future[V]] = {}
        self._queue: collections.deque[_Job[K, V]] = collections.deque()
        self._running: list[_Job[K, V]] = []
        self._lock = threading.Lock()
        self._fetch: Callable[[K], Future[V]] | None = None
        self._is_shut_down = False
        self._nice = thread_nice()
        self._timers = Timers(f"{name}-compile-timers")
        self.num_compilations = 0

    @property
    def num_running(self) -> int:
        """Compiles running now, in their slots and in the slow lane."""
        with self._lock:
            return len(self._running)

    def get(self, key: K) -> tuple[V | Future[V], bool]:
        """``(copy, True)`` for a cached key, else ``(future of a copy, False)``, starting a compile if none runs."""
        with self._lock:
            self._refuse_after_shutdown()
            cached = self.cache.get(key)
            if cached is not None:
                return self._copy(cached, True), True
            shared = self._in_flight.get(key)
            now = time.monotonic()
            if shared is None:
                shared = Future()
                self._in_flight[key] = shared
                if self._fetch is not None:
                    self._fetch(key).add_done_callback(lambda done: relay(done, shared))
                    self._timers.call_at(now + self.timeout_s, lambda: self._expire_fetch(key, shared))
                else:
                    self._enqueue(_Job(key, shared, now, now + self.timeout_s))
            else:
                self._extend(shared, now + self.timeout_s)
        self._dispatch()
        return map_future(shared, lambda value: self._copy(value, False)), False

    def submit(
        self, key: K, parent: CompileControl, compile_value: Callable[[K, CompileControl], V] | None = None
    ) -> Future[V]:
        """Compile ``key`` once for the compile ``parent`` controls, outside the cache and the in-flight sharing:
        queued for a slot like any compile, under ``parent``'s deadline, cancelled when ``parent`` is. The future
        holds the value itself (no copy); cancelling it stops the compile where that can be done.
        ``compile_value``: what runs in the slot instead of the service's own compile (one that also keeps what
        its caller needs beside the value)."""
        shared: Future[V] = Future()
        with self._lock:
            self._refuse_after_shutdown()
            now = time.monotonic()
            self._enqueue(_Job(key, shared, now, parent.deadline, parent=parent, compile_value=compile_value))
        parent.on_cancel(lambda _: cancel(shared))
        self._dispatch()
        return shared

    def compile_elsewhere(self, fetch: Callable[[K], Future[V]]) -> None:
        """From now on a miss takes its value from ``fetch(key)`` (a future settled by whoever compiles it) instead
        of compiling in a slot; ``fetch`` is called under this service's lock and must not call back into it."""
        self._fetch = fetch

    def store(self, key: K, value: V) -> None:
        """Cache ``value`` for ``key``; its compile in flight, if any, is done with."""
        with self._lock:
            self._in_flight.pop(key, None)
            self.cache.put(key, value, self._size_of(value))

    def forget(self, key: K) -> None:
        """Forget ``key``'s compile in flight, so that the next request compiles anew (its waiters still get it)."""
        with self._lock:
            self._in_flight.pop(key, None)

    def reset(self) -> None:
        """Cancel every compile in flight (their futures are cancelled, compile processes killed) and empty the
        cache."""
        with self._lock:
            cancelled = list(self._in_flight.values())
            self._in_flight.clear()
            self.cache.clear()
        for shared in cancelled:
            shared.cancel()

    def shutdown(self) -> None:
        """Cancel everything and refuse new compiles."""
        with self._lock:
            self._is_shut_down = True
            waiting = [job.shared for job in self._queue]
            self._queue.clear()
        self.reset()
        for shared in waiting:
            shared.cancel()
        self._timers.stop()

    def _refuse_after_shutdown(self) -> None:
        if self._is_shut_down:
            raise RuntimeError(f"the {self.name} compile service cannot compile after shutdown")

    def _enqueue(self, job: _Job[K, V]) -> None:
        """Queue ``job`` (under the lock); it fails if it cannot start before the deadline."""
        self._queue.append(job)
        self.num_compilations += 1
        job.shared.add_done_callback(lambda done: self._on_settled(job, done))
        self._timers.call_at(job.start_by, lambda: self._expire_waiting(job))

    def _extend(self, shared: Future[V], deadline: float) -> None:
        """Under the lock: the compile that settles ``shared`` (queued or running) may now take until ``deadline``
        (to start, or to finish)."""
        job = next((job for job in [*self._queue, *self._running] if job.shared is shared), None)
        if job is None or job.parent is not None:
            return
        if job.control is None and deadline > job.start_by:
            job.start_by = deadline
            self._timers.call_at(deadline, functools.partial(self._expire_waiting, job))
        elif job.control is not None and deadline > job.control.deadline:
            job.control.extend_deadline(deadline)
            self._timers.call_at(deadline, functools.partial(self._expire_running, job))

    def _dispatch(self) -> None:
        """Start queued compiles while a slot is free (a compile in the slow lane holds none)."""
        starting = []
        with self._lock:
            while self._queue and sum(not job.is_slow for job in self._running) < self.threads:
                job = self._queue.popleft()
                if job.shared.done():
                    continue
                job.control = job.parent.child() if job.parent is not None else CompileControl(self.timeout_s)
                self._running.append(job)
                starting.append(job)
        for job in starting:
            self._start(job)

    def _start(self, job: _Job[K, V]) -> None:
        assert job.control is not None
        if job.parent is None:
            self._timers.call_at(job.control.deadline, lambda: self._expire_running(job))
        if self.slow_after_s is not None:
            self._timers.call_at(job.control.started_at + self.slow_after_s, lambda: self._move_to_slow_lane(job))
        thread = threading.Thread(target=self._run, args=(job,), name=f"{self.name}-compile", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread can start any more (the interpreter is exiting): compile right here
            logger.warning("%s: compiling on the caller's thread, as no thread can start now", self.name)
            self._run(job)

    def _run(self, job: _Job[K, V]) -> None:
        control = job.control
        assert control is not None
        if sys.platform == "linux":  # elsewhere a native thread id is no process id
            set_nice(threading.get_native_id(), self._nice + COMPILE_NICENESS)
        try:
            if not job.shared.done():
                value = (job.compile_value or self._compile)(job.key, control)
                settle(job.shared, value=value)
        except Exception as e:
            settle(job.shared, error=e)
        finally:
            with self._lock:
                self._running.remove(job)
                self._fill_slow_lane()
            self._dispatch()

    def _move_to_slow_lane(self, job: _Job[K, V]) -> None:
        with self._lock:
            if job not in self._running or job.is_slow:
                return
            if sum(other.is_slow for other in self._running) >= self.max_slow:
                return  # the lane is full: the job holds its slot until a place frees (``_fill_slow_lane``)
            job.is_slow = True
        assert job.control is not None
        logger.info("%s: a compile running %.1f s moves to the slow lane", self.name, self.slow_after_s)
        job.control.mark_slow()
        self._dispatch()

    def _fill_slow_lane(self) -> None:
        """Under the lock: move the oldest compile holding a slot past ``slow_after_s`` into a freed lane place."""
        if self.slow_after_s is None or sum(job.is_slow for job in self._running) >= self.max_slow:
            return
        now = time.monotonic()
        for job in self._running:
            if not job.is_slow and job.control is not None and now - job.control.started_at >= self.slow_after_s:
                job.is_slow = True
                self._timers.call_at(now, job.control.mark_slow)
                return

    def _on_settled(self, job: _Job[K, V], done: Future[V]) -> None:
        """A compile's future settled (value, error, deadline, cancellation): stop its work if still running."""
        if job.control is not None and (done.cancelled() or isinstance(done.exception(), CompileTimeoutError)):
            job.control.cancel("cancelled" if done.cancelled() else "deadline")

    def _expire_waiting(self, job: _Job[K, V]) -> None:
        with self._lock:
            if job.control is not None or job.shared.done() or time.monotonic() < job.start_by:
                return  # started, settled, or given a later deadline by a request that joined it
            with contextlib.suppress(ValueError):
                self._queue.remove(job)
            if self._in_flight.get(job.key) is job.shared:
                del self._in_flight[job.key]
            busy = len(self._running)
        waited = time.monotonic() - job.queued_at
        slots = "the compile slot" if self.threads == 1 else f"one of the {self.threads} compile slots"
        settle(
            job.shared,
            error=CompileNotStartedError(
                f"{COMPILE_NOT_STARTED_PREFIX}: it waited {waited:.1f} s for {slots}, busy with {busy} other "
                f"compile{'s' * (busy != 1)} (--grammar-compile-threads); retry later"
            ),
        )

    def _expire_running(self, job: _Job[K, V]) -> None:
        assert job.control is not None
        with self._lock:
            if job.shared.done() or job.control.remaining_s() > 0:
                return  # settled, or given a later deadline by a request that joined it
            if self._in_flight.get(job.key) is job.shared:
                del self._in_flight[job.key]
        settle(job.shared, error=CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {self.timeout_s:g} s"))

    def _expire_fetch(self, key: K, shared: Future[V]) -> None:
        with self._lock:
            if shared.done():
                return
            if self._in_flight.get(key) is shared:
                del self._in_flight[key]
        settle(shared, error=CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {self.timeout_s:g} s"))
