"""Compiling off the caller's thread: a bounded pool, a deadline per compile, a bounded cache, one compile per key.

Compiles never take the loop's CPU first: the pool's threads run at a lower CPU priority, and ``CompileProcesses``
moves an engine's compiles into low-priority child processes, where a compile past its deadline is killed (a native
compile cannot be interrupted in a thread).

``CompileService.get`` answers a cached key with a copy at once and any other key with a ``Future`` of a copy of
its own; identical keys asked for while one compiles share that compile. A compile past its deadline fails its
futures with ``CompileTimeoutError`` and is forgotten (the next request compiles anew; a late result is dropped).
The caller decides when a value enters the cache (``store``), so that every rank of a multi-rank server makes
the same hit-or-miss decision for the same request. ``compile_elsewhere`` makes misses ask another source (another
process that compiles once for many) instead of the pool; cache, dedup and deadline stay. Generic over keys and
values: it knows nothing of grammars.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Generic, TypeVar

from sglang_constrained.errors import CompileProcessError, CompileTimeoutError
from sglang_constrained.grammar_cache import GrammarCache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
T = TypeVar("T")
P = TypeVar("P")

COMPILE_NICENESS = 10
"""How far below the server's CPU priority compiles run: a busy compile gets the cycles the loop leaves, and the
loop loses about a tenth of a core to it at worst (Linux CFS weights 1024 against 110)."""
ORPHAN_CHECK_INTERVAL_S = 1.0
START_TIMEOUT_S = 120.0
"""Longest a compile process may take to start (import its engine, build its compiler)."""


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
        self.executor = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix=f"{name}-compile", initializer=lower_cpu_priority
        )
        self._deadlines = _DeadlineWatch(f"{name}-deadlines")
        self._in_flight: dict[K, Future[V]] = {}
        self._lock = threading.Lock()
        self._fetch: Callable[[K], Future[V]] | None = None
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
                self._start(key, shared)
                self._in_flight[key] = shared
                self._deadlines.call_at(time.monotonic() + self.timeout_s, lambda: self._expire(key, shared))
        return map_future(shared, lambda value: self._copy(value, False)), False

    def compile_elsewhere(self, fetch: Callable[[K], Future[V]]) -> None:
        """From now on a miss takes its value from ``fetch(key)`` (a future settled by whoever compiles it) instead
        of compiling on the pool; ``fetch`` is called under this service's lock and must not call back into it."""
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

    def _start(self, key: K, shared: Future[V]) -> None:
        if self._fetch is not None:
            self._fetch(key).add_done_callback(lambda done: _relay(done, shared))
            return
        # Raises RuntimeError after shutdown, before anything waits on a compile that would never run.
        self.executor.submit(self._run, key, shared)
        self.num_compilations += 1

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


def lower_cpu_priority() -> None:
    """Lower the calling thread's CPU priority by ``COMPILE_NICENESS`` (Linux: a thread has its own nice value; the
    threads it starts, such as an engine's compile threads, inherit it). Elsewhere it does nothing."""
    if hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + COMPILE_NICENESS)


class CompileProcesses(Generic[K, P]):
    """Runs compiles in child processes at lower CPU priority: one child per calling thread (so the compile
    service's thread count bounds them), kept for its next compile.

    ``start()`` runs once in each child and returns the child's compile function; ``start``, the keys and the
    results must pickle. A compile running past ``timeout_s`` has its child killed and raises
    ``CompileTimeoutError``; a child that dies (a crash in a native engine) raises ``CompileProcessError``. Either
    way a spare replaces it at once. ``num_spares`` children start at once, in the background, for the first
    compiles (a child's start-up is not a compile's: it does not count towards ``timeout_s``);
    ``preload``: modules the fork server imports once, so that children start in a fraction of a second.
    """

    def __init__(
        self,
        start: Callable[[], Callable[[K], P]],
        *,
        name: str,
        timeout_s: float,
        num_spares: int = 0,
        preload: Sequence[str] = (),
    ) -> None:
        self._start = start
        self._name = name
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(["__main__", *preload])
        self._local = threading.local()
        self._children: set[_CompileChild] = set()
        self._spares: queue.SimpleQueue[_CompileChild] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._prestart = threading.Thread(target=self._start_spares, args=(num_spares,), daemon=True)
        self._prestart.start()

    def wait_until_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the spare children have started (raises ``CompileProcessError`` if one fails to)."""
        self._prestart.join(timeout_s)
        with self._lock:
            children = list(self._children)
        for child in children:
            child.wait_until_ready(timeout_s)

    def run(self, key: K) -> P:
        """Compile ``key`` in this thread's child and return its result; blocks until then, at most ``timeout_s``
        once the child has started."""
        child: _CompileChild | None = getattr(self._local, "child", None)
        if child is None or not child.process.is_alive():
            if child is not None:
                self._retire(child)
            child = self._local.child = self._spare() or self._new_child()
        try:
            result: P = child.compile(key, self.timeout_s)
        except BaseException:
            self._local.child = None
            self._retire(child)
            self._prestart = threading.Thread(target=self._start_spares, args=(1,), daemon=True)
            self._prestart.start()  # the replacement starts now, not within the next compile's deadline
            raise
        return result

    def shutdown(self) -> None:
        """Kill every child, compiling or not; compiles in flight raise ``CompileProcessError``."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, set()
        for child in children:
            child.kill()

    def _start_spares(self, num_spares: int) -> None:
        with contextlib.suppress(CompileProcessError):  # shut down meanwhile
            for _ in range(num_spares):
                self._spares.put(self._new_child())

    def _spare(self) -> _CompileChild | None:
        try:
            return self._spares.get_nowait()
        except queue.Empty:
            return None

    def _new_child(self) -> _CompileChild:
        with self._lock:
            if self._closed:
                raise CompileProcessError("the compile processes are shut down")
            child = _CompileChild(self._context, self._start, f"{self._name}-compile-process")
            self._children.add(child)
        return child

    def _retire(self, child: _CompileChild) -> None:
        with self._lock:
            self._children.discard(child)
        child.kill()


class _CompileChild:
    """One child process and the pipe to it; compiles one key at a time. Its first message says it has started."""

    def __init__(self, context: Any, start: Callable[[], Callable[[Any], Any]], name: str) -> None:
        self.connection, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_compile_process_main, args=(child_end, start, os.getpid()), name=name, daemon=True
        )
        self.process.start()
        child_end.close()
        self.is_ready = False
        self._using_pipe = threading.Lock()  # held while a thread talks to the child; ``kill`` waits for it

    def wait_until_ready(self, timeout_s: float) -> None:
        with self._using_pipe:
            self._wait_until_ready(timeout_s)

    def _wait_until_ready(self, timeout_s: float) -> None:
        if self.is_ready:
            return
        if not self.connection.poll(timeout_s):
            raise CompileProcessError(f"the compile process did not start within {timeout_s:g} s")
        self._receive("starting")
        self.is_ready = True

    def compile(self, key: Any, timeout_s: float) -> Any:
        with self._using_pipe:
            if self.connection.closed:
                raise CompileProcessError("the compile process was killed")
            self._wait_until_ready(START_TIMEOUT_S)
            try:
                self.connection.send(key)
            except BrokenPipeError:
                raise CompileProcessError("the compile process died before its compile") from None
            if not self.connection.poll(timeout_s):
                raise CompileTimeoutError(f"Grammar compilation timed out after {timeout_s:g} s")
            return self._receive("compiling")

    def _receive(self, doing: str) -> Any:
        try:
            is_ok, result = self.connection.recv()
        except EOFError:
            self.process.join(1.0)
            raise CompileProcessError(
                f"the compile process died while {doing} (exit code {self.process.exitcode})"
            ) from None
        if not is_ok:
            raise CompileProcessError(f"the compile process failed: {result}")
        return result

    def kill(self) -> None:
        """Kill the child, then close the pipe once free: a compile in flight sees the child die (end of file) and
        lets go of it. Safe from several threads at once (shutdown and a failed compile both kill)."""
        self.process.kill()
        with self._using_pipe:
            self.process.join()
            if not self.connection.closed:
                self.connection.close()


def _compile_process_main(connection: Connection, start: Callable[[], Callable[[Any], Any]], parent: int) -> None:
    """A compile process: lower its priority, build its compiler, then compile what the parent sends until the pipe
    closes; exits by itself if the parent dies mid-compile."""
    os.nice(COMPILE_NICENESS)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    compile_key = start()
    connection.send((True, None))
    while True:
        try:
            key = connection.recv()
        except EOFError:
            return
        try:
            reply = (True, compile_key(key))
        except Exception as e:  # a bug, not bad input (compile functions report bad input in their result)
            reply = (False, f"{type(e).__name__}: {e}")
        connection.send(reply)


def _exit_when_orphaned(parent: int) -> None:
    """The fork server, not the server, is a compile process's parent: watch the server's pid itself."""
    with contextlib.suppress(ProcessLookupError):
        while True:
            os.kill(parent, 0)  # raises ProcessLookupError once the server is gone
            time.sleep(ORPHAN_CHECK_INTERVAL_S)
    os._exit(0)
