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
works on it (``compile_processes`` kills a child process on cancellation).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Generic, TypeVar

from sglang_constrained.cache.memory import GrammarCache
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
T = TypeVar("T")


class CompileControl:
    """The terms of one compile, shared with whatever works on it (its thread, a compile process, ``auto``'s
    attempts): its deadline, whether its result is still wanted, and whether it has left its slot as slow.

    Callbacks run once, on the thread that cancels or marks slow, outside any lock of this object; a callback
    registered after the fact runs at once.
    """

    def __init__(self, timeout_s: float, deadline: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s if deadline is None else deadline
        self._lock = threading.Lock()
        self._cancel_reason: str | None = None
        self._is_slow = False
        self._on_cancel: list[Callable[[str], None]] = []
        self._on_slow: list[Callable[[], None]] = []
        self._children: list[CompileControl] = []

    @property
    def cancel_reason(self) -> str | None:
        """Why the result is no longer wanted (None while it is)."""
        return self._cancel_reason

    @property
    def is_slow(self) -> bool:
        return self._is_slow

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def cancel(self, reason: str) -> None:
        """Nobody wants the result any more (deadline, reset, another backend won): stop what can be stopped."""
        with self._lock:
            if self._cancel_reason is not None:
                return
            self._cancel_reason = reason
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            callback(reason)

    def extend_deadline(self, deadline: float) -> None:
        """Someone else now waits for the result, until ``deadline``: this compile and the work done for it
        (``child``) may run until then."""
        with self._lock:
            self.deadline = max(self.deadline, deadline)
            children = list(self._children)
        for child in children:
            child.extend_deadline(deadline)

    def mark_slow(self) -> None:
        """The compile left its slot: whatever works on it lowers its CPU priority."""
        with self._lock:
            if self._is_slow:
                return
            self._is_slow = True
            callbacks, self._on_slow = self._on_slow, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if self._cancel_reason is None:
                self._on_cancel.append(callback)
                return
        callback(self._cancel_reason)

    def on_slow(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._is_slow:
                self._on_slow.append(callback)
                return
        callback()

    def child(self) -> CompileControl:
        """A control for work done for this compile: the same deadline (extended with it), cancelled when this one
        is (slowness is each one's own: work started after this one turned slow is not slow yet)."""
        child = CompileControl(self.timeout_s, self.deadline)
        with self._lock:
            self._children.append(child)
        self.on_cancel(child.cancel)
        return child


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
        self._timers = _Timers(f"{name}-compile-timers")
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
                    self._fetch(key).add_done_callback(lambda done: _relay(done, shared))
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
        parent.on_cancel(lambda _: _cancel(shared))
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
                _settle(job.shared, value=value)
        except Exception as e:
            _settle(job.shared, error=e)
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
        _settle(
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
        _settle(job.shared, error=CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {self.timeout_s:g} s"))

    def _expire_fetch(self, key: K, shared: Future[V]) -> None:
        with self._lock:
            if shared.done():
                return
            if self._in_flight.get(key) is shared:
                del self._in_flight[key]
        _settle(shared, error=CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {self.timeout_s:g} s"))


def _settle(future: Future[T], value: T | None = None, error: BaseException | None = None) -> None:
    """Settle ``future`` unless it already is: the compile and its deadline race, and the first one wins.

    Called outside any lock of ours: settling runs every waiter's callback (copies of the value among them).
    """
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]


def _cancel(future: Future[T]) -> None:
    future.cancel()


def _relay(source: Future[T], target: Future[T]) -> None:
    """Settle ``target`` as ``source`` settled (cancelled, failed or with its value)."""
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        _settle(target, error=error)
    else:
        _settle(target, value=source.result())


def map_future(source: Future[T], transform: Callable[[T], T]) -> Future[T]:
    """A future resolving to ``transform(source.result())``; cancelled or failed when ``source`` is."""
    derived: Future[T] = Future()

    def on_done(done: Future[T]) -> None:
        if done.cancelled():
            derived.cancel()
            return
        try:
            derived.set_result(transform(done.result()))
        except Exception as e:
            derived.set_exception(e)

    source.add_done_callback(on_done)
    return derived


class _Timers:
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
