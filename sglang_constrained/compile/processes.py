"""Compiles in child processes, where a native compile can be stopped: killed at its deadline, past a memory bound,
or when nobody wants it any more, and reported with the reason (a crash with its signal).

Only the xgrammar backend uses them (an xgrammar compile can take minutes and cannot be interrupted in a thread).
Children come from a fork server that imports the engine once, so a child starts in a fraction of a second; they
run at lower CPU priority, and a compile that leaves its slot as slow drops its child to the lowest. Where no child
process can be started safely (``why_processes_cannot_start``: a daemonic process, a main script without a
``__main__`` guard, an exiting interpreter) the backend compiles in threads instead.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Generic, TypeVar

from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.forked_fork_server import fork_fork_server
from sglang_constrained.cpu_priority import COMPILE_NICENESS, SLOW_COMPILE_NICENESS, set_nice
from sglang_constrained.errors import COMPILE_TIMEOUT_PREFIX, CompileProcessError, CompileTimeoutError

K = TypeVar("K")
P = TypeVar("P")

ORPHAN_CHECK_INTERVAL_S = 1.0
START_TIMEOUT_S = 120.0
"""Longest a compile process may take to start (import its engine, build its compiler)."""
WAIT_SLICE_S = 0.1
"""How often a waiting compile looks at its deadline, its cancellation and its child's memory."""
MIB = 2**20


def start_fork_server(preload: Sequence[str], *, fork_this_process: bool = True) -> None:
    """Start the fork server that compile processes fork from (importing ``preload``) now, so that its start does not
    delay the first compile processes; the ``CompileProcesses`` made later with the same ``preload`` use it. So does
    every later user of multiprocessing's fork server in this process (torch's ``start_processes``, say): the first
    to start it chooses what its children find imported.

    Where it can (``forked_fork_server``) and ``fork_this_process`` allows, this process imports ``preload`` and forks
    itself into the server, which costs no imports of its own; else multiprocessing starts a new interpreter for it,
    in the background, whose imports overlap what this process does meanwhile (and which holds none of this
    process's memory or open files). Nothing where processes cannot start."""
    if why_processes_cannot_start() is None:
        _fork_server_context(preload)
        if not (fork_this_process and fork_fork_server(preload)):
            multiprocessing.forkserver.ensure_running()


def _fork_server_context(preload: Sequence[str]) -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["sglang_constrained.compile.fork_server_setup", _main_module_preload(), *preload])
    return context


def _main_module_preload() -> str:
    """How the fork server imports the main module first, so that each child finds it imported.

    multiprocessing's own ``"__main__"`` entry imports nothing here (Python 3.11 never passes the fork server the
    main script's path): each child would run the main module afresh (all of its imports, in each child), and the
    fork server would import the engine without the main module's own settings first (``scheduler.launch`` imports
    ``scheduler.lean_imports``). A module run with ``-m`` is therefore
    preloaded by its name, which its ``__main__`` guard keeps from running (each child still runs its body, on
    imports already done: see ``fork_server_setup``); a package's ``__main__`` module (``python -m pytest``) is
    neither preloaded nor run in the children, and a main script keeps the ``"__main__"`` entry.
    """
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str) and name != "__main__" and not name.endswith(".__main__"):
        return name
    return "__main__"


def why_processes_cannot_start() -> str | None:
    """Why no compile process can be started from here, or None if they can."""
    if multiprocessing.current_process().daemon:
        return "this is a daemonic process (a multiprocessing pool worker, say), which may not start children"
    if not threading.main_thread().is_alive():
        return "the interpreter is exiting"
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None:  # an interactive session or ``python -c``: children have no main script to run
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return f"the main script ({path}) cannot be read again, as each compile process would"
    if not _has_main_guard(tree):
        return (
            f"the main script {Path(path).name} has no 'if __name__ == \"__main__\":' guard, so each compile "
            "process would run it again"
        )
    return None


def _has_main_guard(tree: ast.Module) -> bool:
    """Whether a module tests ``__name__ == "__main__"`` at its top level."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1:
            names = {node.test.left, *node.test.comparators}
            is_name = any(isinstance(part, ast.Name) and part.id == "__name__" for part in names)
            is_main = any(isinstance(part, ast.Constant) and part.value == "__main__" for part in names)
            if is_name and is_main and isinstance(node.test.ops[0], ast.Eq):
                return True
    return False


class CompileProcesses(Generic[K, P]):
    """Runs compiles in child processes at lower CPU priority: each compile takes an idle child (``num_spares`` are
    kept started), which goes back idle after a compile that ends normally (up to ``num_spares`` idle ones).

    ``start()`` runs once in each child and returns the child's compile function; ``start``, the keys and the
    results must pickle. A compile past its deadline (its control's, else ``timeout_s`` from its start) has its
    child killed and raises ``CompileTimeoutError``; one cancelled meanwhile (its control) raises
    ``CompileProcessError`` saying why; so does one whose child grows past ``max_memory_mib`` (None: no bound) or
    dies (a crash in a native engine: its signal). Either way a spare replaces the child at once.
    ``preload``: modules the fork server imports once, so that children start in a fraction of a second.
    """

    def __init__(
        self,
        start: Callable[[], Callable[[K], P]],
        *,
        name: str,
        timeout_s: float,
        num_spares: int = 0,
        max_memory_mib: int | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self._start = _PickledOnce(start)
        self._name = name
        self.timeout_s = timeout_s
        self.num_spares = num_spares
        self.max_memory_mib = max_memory_mib
        self._context = _fork_server_context(preload)
        self._children: set[_CompileChild] = set()
        self._idle: collections.deque[_CompileChild] = collections.deque()  # the most recently used first
        self._lock = threading.Lock()
        self._closed = False
        self._num_starting = 0
        self._starting = self._start_spares(num_spares)

    def wait_until_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the spare children have started (raises ``CompileProcessError`` if one fails to)."""
        self._starting.join(timeout_s)
        with self._lock:
            children = list(self._children)
        for child in children:
            child.wait_until_ready(timeout_s)

    def run(self, key: K, control: CompileControl | None = None) -> P:
        """Compile ``key`` in an idle child and return its result; blocks until then, or until the compile is
        stopped (see the class). Without ``control`` the deadline is ``timeout_s`` from the child's start-up."""
        child = self._take_idle() or self._new_child()
        self._top_up_spares(1)  # the last spare taken: the next one starts now, not within the next compile
        try:
            if control is None:
                child.wait_until_ready(START_TIMEOUT_S)
                control = CompileControl(self.timeout_s)
            control.on_slow(child.drop_priority)
            result: P = child.compile(key, control, self.max_memory_mib)
        except BaseException:
            self._retire(child)
            self._top_up_spares(self.num_spares)  # the replacement starts now, not within the next compile
            raise
        with self._lock:
            keep = not child.is_dropped and len(self._idle) < max(1, self.num_spares)
            if keep:
                self._idle.appendleft(child)
        if not keep:
            self._retire(child)  # its priority cannot be raised back, or enough children are idle
            self._top_up_spares(self.num_spares)
        return result

    def shutdown(self) -> None:
        """Kill every child, compiling or not; compiles in flight raise ``CompileProcessError``."""
        with self._lock:
            self._closed = True
            children, self._children = self._children, set()
        for child in children:
            child.kill("the compile processes were shut down")

    def _top_up_spares(self, target: int) -> None:
        """Start as many children as bring the idle and starting ones up to ``target`` (at most ``num_spares``).

        Only when the pool runs low: a child's start takes CPU from the compiles running beside it."""
        with self._lock:
            missing = min(target, self.num_spares) - len(self._idle) - self._num_starting
        if missing > 0:
            self._starting = self._start_spares(missing)

    def _start_spares(self, num_spares: int) -> threading.Thread:
        with self._lock:
            self._num_starting += num_spares
        thread = threading.Thread(target=self._add_spares, args=(num_spares,), name=f"{self._name}-spares", daemon=True)
        with contextlib.suppress(RuntimeError):  # no thread can start (the interpreter is exiting): none are kept
            thread.start()
        return thread

    def _add_spares(self, num_spares: int) -> None:
        try:
            for _ in range(num_spares):
                child = self._new_child()
                with self._lock:
                    self._num_starting -= 1
                    self._idle.append(child)
        except (CompileProcessError, OSError):  # shut down meanwhile, or the fork server is gone
            return

    def _take_idle(self) -> _CompileChild | None:
        """An idle child, a started one first (a spare may still be starting); dead ones are retired."""
        with self._lock:
            alive = [child for child in self._idle if child.process.is_alive()]
            dead = [child for child in self._idle if child not in alive]
            ready = [child for child in alive if child.has_started()]
            chosen = next(iter(ready or alive), None)
            self._idle = collections.deque(child for child in alive if child is not chosen)
        for child in dead:
            self._retire(child)
        return chosen

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
        child.kill("retired")


class _PickledOnce:
    """A value pickled once, at construction: every child's start sends these bytes, and the child loads the value
    back. A start holds what its compiles need (xgrammar's: the vocabulary, 3.4 MB pickled at 248k tokens): pickled
    again at each child's start, it took ~260 ms of the parent's CPU there (~40 ms at 49k), holding the GIL."""

    def __init__(self, value: Any) -> None:
        self._pickled = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def __reduce__(self) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
        return pickle.loads, (self._pickled,)


class _CompileChild:
    """One child process and the pipe to it; compiles one key at a time. Its first message says it has started."""

    def __init__(self, context: Any, start: _PickledOnce, name: str) -> None:
        self.connection, child_end = context.Pipe()
        self.process: BaseProcess = context.Process(
            target=_compile_process_main, args=(child_end, start, os.getpid()), name=name, daemon=True
        )
        self.process.start()
        child_end.close()
        self.is_ready = False
        self.is_dropped = False
        self.kill_reason: str | None = None
        self._using_pipe = threading.Lock()  # held while a thread talks to the child; ``kill`` waits for it

    def wait_until_ready(self, timeout_s: float) -> None:
        with self._using_pipe:
            self._wait_until_ready(timeout_s)

    def has_started(self) -> bool:
        """Whether the child has said it started (never blocks; the message is read if it is there)."""
        if not self.is_ready and self._using_pipe.acquire(blocking=False):
            try:
                if not self.connection.closed and self.connection.poll(0):
                    self._receive("starting")
                    self.is_ready = True
            except CompileProcessError:
                return False
            finally:
                self._using_pipe.release()
        return self.is_ready

    def drop_priority(self) -> None:
        """Run at the lowest CPU priority from now on (its compile left its slot as slow)."""
        self.is_dropped = True
        if self.process.pid is not None:
            set_nice(self.process.pid, SLOW_COMPILE_NICENESS)

    def compile(self, key: Any, control: CompileControl, max_memory_mib: int | None) -> Any:
        with self._using_pipe:
            if self.connection.closed:
                raise CompileProcessError(f"the compile process was killed: {self.kill_reason}")
            self._wait_until_ready(START_TIMEOUT_S)
            try:
                self.connection.send(key)
            except OSError:
                raise CompileProcessError("the compile process died before its compile") from None
            while not self.connection.poll(max(0.0, min(WAIT_SLICE_S, control.remaining_s()))):
                self._stop_if_due(control, max_memory_mib)
            return self._receive("compiling")

    def _stop_if_due(self, control: CompileControl, max_memory_mib: int | None) -> None:
        """Kill the child and raise if the compile is past its deadline, cancelled, or over the memory bound."""
        if control.remaining_s() <= 0:
            self._kill_now("deadline")
            raise CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {control.timeout_s:g} s")
        if control.cancel_reason is not None:
            self._kill_now(control.cancel_reason)
            raise CompileProcessError(f"the compile was stopped: {control.cancel_reason}")
        memory_mib = self.memory_mib()
        if max_memory_mib is not None and memory_mib is not None and memory_mib > max_memory_mib:
            self._kill_now("memory bound")
            raise CompileProcessError(
                f"the compile process was killed at {memory_mib:,.0f} MiB, over the memory bound of "
                f"{max_memory_mib:,} MiB (--grammar-compile-max-memory)"
            )

    def memory_mib(self) -> float | None:
        """The child's resident memory (Linux; None elsewhere or once it is gone)."""
        try:
            resident_pages = int(Path(f"/proc/{self.process.pid}/statm").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return resident_pages * os.sysconf("SC_PAGE_SIZE") / MIB

    def _wait_until_ready(self, timeout_s: float) -> None:
        if self.is_ready:
            return
        if not self.connection.poll(timeout_s):
            raise CompileProcessError(f"the compile process did not start within {timeout_s:g} s")
        self._receive("starting")
        self.is_ready = True

    def _receive(self, doing: str) -> Any:
        try:
            is_ok, result = self.connection.recv()
        except (EOFError, OSError):
            self.process.join(1.0)
            raise CompileProcessError(f"the compile process died while {doing} ({self._how_it_ended()})") from None
        if not is_ok:
            raise CompileProcessError(f"the compile process failed: {result}")
        return result

    def _how_it_ended(self) -> str:
        """The child's end, as a user can act on it: a killer of ours, a signal (a crash, or the system's
        out-of-memory killer), or an exit code."""
        if self.kill_reason is not None:
            return f"killed: {self.kill_reason}"
        code = self.process.exitcode
        if code is None or code >= 0:
            return f"exit code {code}"
        number = -code
        name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
        if number == signal.SIGKILL:
            return f"killed by {name} from outside the server, such as the system's out-of-memory killer"
        return f"crashed with {name}"

    def _kill_now(self, reason: str) -> None:
        """Kill the child from the thread that holds the pipe."""
        self.kill_reason = self.kill_reason or reason
        self.process.kill()
        self.process.join()
        self.connection.close()

    def kill(self, reason: str) -> None:
        """Kill the child, then close the pipe once free: a compile in flight sees the child die (end of file) and
        lets go of it. Safe from several threads at once (shutdown and a failed compile both kill)."""
        self.kill_reason = self.kill_reason or reason
        self.process.kill()
        with self._using_pipe:
            self.process.join()
            if not self.connection.closed:
                self.connection.close()


def _compile_process_main(connection: Connection, start: Callable[[], Callable[[Any], Any]], parent: int) -> None:
    """A compile process: lower its priority, build its compiler, then compile what the parent sends until the pipe
    closes. Exits quietly when the parent goes (its end of the pipe closed or reset, or its pid gone)."""
    os.nice(COMPILE_NICENESS)
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    compile_key = start()
    with contextlib.suppress(EOFError, OSError):
        connection.send((True, None))
        while True:
            key = connection.recv()
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
