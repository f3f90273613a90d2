"""Compiling off the caller's thread: a bounded pool, a deadline per compile, a bounded cache, one compile per key.

``CompileService.get`` answers a cached key with a copy at once and any other key with a ``Future`` of a copy of
its own; identical keys asked for while one compiles share that compile. A compile past its deadline fails its
futures with ``CompileTimeoutError`` and is forgotten (the next request compiles anew; a late result is dropped).
The caller decides when a value enters the cache (``store``), so that every rank of a multi-rank server makes
the same hit-or-miss decision for the same request. Generic over keys and values: it knows nothing of grammars.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Generic, TypeVar

from sglang_constrained.errors import CompileTimeoutError
from sglang_constrained.grammar_cache import GrammarCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")


class CompileService(Generic[K, V]):
    """``compile(key)`` on ``threads`` worker threads; results cached under ``cache_max_entries``/``_bytes``.

    ``size_of(value)`` is what a value counts towards the byte bound; ``copy(value, is_cache_hit)`` makes the
    private copy each caller receives.
    """

    def __init__(
        self,
        compile_value: Callable[[K], V],
        *,
        name: str,
        threads: int,
        timeout_s: float,
        cache_max_entries: int,
        cache_max_bytes: int,
        size_of: Callable[[V], int],
        copy: Callable[[V, bool], V],
    ) -> None:
        self._compile = compile_value
        self._size_of = size_of
        self._copy = copy
        self.timeout_s = timeout_s
        self.cache: GrammarCache[K, V] = GrammarCache(cache_max_entries, cache_max_bytes)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{name}-compile")
        self._deadlines = _DeadlineWatch(f"{name}-deadlines")
        self._in_flight: dict[K, Future[V]] = {}
        self._lock = threading.Lock()
        self.num_compilations = 0

    def get(self, key: K) -> tuple[V | Future[V], bool]:
        """``(copy, True)`` for a cached key, else ``(future of a copy, False)``, starting a compile if none runs."""
        with self._lock:
            cached = self.cache.get(key)
            if cached is not None:
                return self._copy(cached, True), True
            shared = self._in_flight.get(key)
            if shared is None:
                shared = Future()
                # Raises RuntimeError after shutdown, before anything waits on a compile that would never run.
                self.executor.submit(self._run, key, shared)
                self._in_flight[key] = shared
                self.num_compilations += 1
                self._deadlines.call_at(time.monotonic() + self.timeout_s, lambda: self._expire(key, shared))
        return map_future(shared, lambda value: self._copy(value, False)), False

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
        """Cancel every compile in flight (their futures are cancelled) and empty the cache."""
        with self._lock:
            for shared in self._in_flight.values():
                shared.cancel()
            self._in_flight.clear()
            self.cache.clear()

    def shutdown(self) -> None:
        self.reset()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self._deadlines.stop()

    def _run(self, key: K, shared: Future[V]) -> None:
        if shared.done():  # cancelled or past its deadline while it waited for a worker
            return
        try:
            value = self._compile(key)
        except Exception as e:
            _settle(shared, error=e)
        else:
            _settle(shared, value=value)

    def _expire(self, key: K, shared: Future[V]) -> None:
        with self._lock:
            if shared.done():
                return
            if self._in_flight.get(key) is shared:
                del self._in_flight[key]
        _settle(shared, error=CompileTimeoutError(f"Grammar compilation timed out after {self.timeout_s:g} s"))


def _settle(future: Future[T], value: T | None = None, error: BaseException | None = None) -> None:
    """Settle ``future`` unless it already is: the compile and its deadline race, and the first one wins.

    Called outside any lock of ours: settling runs every waiter's callback (copies of the value among them).
    """
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]


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


class _DeadlineWatch:
    """One thread that runs callbacks at their deadlines (one thread for every compile, not one each)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def call_at(self, when: float, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the watch's thread once ``time.monotonic()`` reaches ``when``."""
        with self._condition:
            heapq.heappush(self._heap, (when, next(self._order), callback))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
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
            callback()
