"""Compile processes: a compile runs in a child at lower CPU priority, a compile past its deadline, over the memory
bound or cancelled is killed (the CPU it took comes back) and says why, a crashing compile is reported with its
signal, a slow one drops to the lowest priority, and the next compile gets a fresh child."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.processes import CompileProcesses
from sglang_constrained.cpu_priority import COMPILE_NICENESS, SLOW_COMPILE_NICENESS
from sglang_constrained.errors import CompileProcessError, CompileTimeoutError
from tests.fresh_interpreter import run_python_in


def start_compiler() -> Callable[[str], tuple[int, int]]:
    """The children's compile function: ``"spin:S"`` burns S seconds of CPU, ``"grow:M"`` takes M MiB and spins,
    ``"crash"`` exits, ``"segv"`` crashes; answers ``(pid, nice value)``."""

    def compile_key(key: str) -> tuple[int, int]:
        if key == "crash":
            os._exit(3)
        if key == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if key.startswith("grow:"):
            _held = b"x" * (int(key.split(":")[1]) * 2**20)  # resident: every page written
            key = "spin:30"
        if key.startswith("spin:"):
            deadline = time.monotonic() + float(key.split(":")[1])
            while time.monotonic() < deadline:
                pass
        return os.getpid(), os.nice(0)

    return compile_key


def started_processes(timeout_s: float) -> CompileProcesses[str, tuple[int, int]]:
    """Compile processes whose spare children have started, so that a deadline counts the compile, not a child's
    start on a busy machine."""
    compile_processes: CompileProcesses[str, tuple[int, int]] = CompileProcesses(
        start_compiler, name="test", timeout_s=timeout_s
    )
    compile_processes.wait_until_ready()
    return compile_processes


@pytest.fixture
def processes() -> Iterator[CompileProcesses[str, tuple[int, int]]]:
    compile_processes = started_processes(timeout_s=30.0)
    yield compile_processes
    compile_processes.shutdown()


def test_a_compile_runs_in_a_child_at_lower_priority(processes: CompileProcesses[str, tuple[int, int]]) -> None:
    pid, nice = processes.run("quick")
    assert pid != os.getpid() and nice == os.nice(0) + COMPILE_NICENESS
    assert processes.run("again")[0] == pid, "the thread's child serves its next compile too"


def test_a_compile_past_its_deadline_is_killed() -> None:
    processes = started_processes(timeout_s=2.0)
    try:
        pid, _ = processes.run("quick")
        started = time.monotonic()
        with pytest.raises(CompileTimeoutError, match="timed out after 2 s"):
            processes.run("spin:60")
        assert time.monotonic() - started < 10
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        processes.wait_until_ready()
        assert processes.run("quick")[0] != pid, "a new child compiles the next key"
    finally:
        processes.shutdown()


def test_a_crashing_compile_is_reported_and_the_next_one_runs(
    processes: CompileProcesses[str, tuple[int, int]],
) -> None:
    with pytest.raises(CompileProcessError, match=r"died while compiling \(exit code 3\)"):
        processes.run("crash")
    assert processes.run("quick")[0] != os.getpid()


class CountedStart:
    """``start_compiler``, counting the times this process pickles it (a backend's start holds its vocabulary)."""

    pickled = 0

    def __call__(self) -> Callable[[str], tuple[int, int]]:
        return start_compiler()

    def __getstate__(self) -> dict[str, int]:
        CountedStart.pickled += 1
        return {}


def test_a_start_is_pickled_once_however_many_children_start() -> None:
    """Spares, and a child that replaces a crashed one, all start from the bytes pickled when the processes were made:
    at 248k tokens xgrammar's start pickled anew took ~260 ms of the server's CPU at each child's start."""
    CountedStart.pickled = 0
    processes: CompileProcesses[str, tuple[int, int]] = CompileProcesses(
        CountedStart(), name="counted", timeout_s=30.0, num_spares=2
    )
    try:
        processes.wait_until_ready()
        for _ in range(2):
            with pytest.raises(CompileProcessError):
                processes.run("crash")
            assert processes.run("quick")[0] != os.getpid()
    finally:
        processes.shutdown()
    assert CountedStart.pickled == 1


def test_each_thread_has_its_own_child_and_shutdown_kills_them(
    processes: CompileProcesses[str, tuple[int, int]],
) -> None:
    with ThreadPoolExecutor(2) as pool:
        pids = {pid for pid, _ in pool.map(processes.run, ["spin:0.5", "spin:0.5"])}
    assert len(pids) == 2
    processes.shutdown()
    time.sleep(0.2)
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in pids)
    with pytest.raises(CompileProcessError, match="shut down"):
        processes.run("quick")


def test_shutdown_during_compiles_fails_them_and_closes_each_pipe_once() -> None:
    """Shutdown and the compile it fails both retire the child: its pipe must be closed once, or the second close
    hits a descriptor number the process has handed out again."""
    for _ in range(4):
        processes: CompileProcesses[str, tuple[int, int]] = CompileProcesses(
            start_compiler, name="test", timeout_s=30.0, num_spares=2
        )
        processes.wait_until_ready()
        with ThreadPoolExecutor(2) as pool:
            compiles = [pool.submit(processes.run, "spin:20") for _ in range(2)]
            time.sleep(0.2)
            processes.shutdown()
            for compiling in compiles:
                with pytest.raises(CompileProcessError):
                    compiling.result(timeout=10)


def test_a_crash_is_reported_with_its_signal(processes: CompileProcesses[str, tuple[int, int]]) -> None:
    with pytest.raises(CompileProcessError, match=r"died while compiling \(crashed with SIGSEGV\)"):
        processes.run("segv")


def test_a_compile_over_the_memory_bound_is_killed_and_says_so() -> None:
    processes: CompileProcesses[str, tuple[int, int]] = CompileProcesses(
        start_compiler, name="test", timeout_s=30.0, max_memory_mib=400
    )
    started = time.monotonic()
    with pytest.raises(CompileProcessError, match=r"killed at [\d,]+ MiB, over the memory bound of 400 MiB"):
        processes.run("grow:800")
    assert time.monotonic() - started < 20
    processes.shutdown()


def test_a_cancelled_compile_is_killed_and_says_why(processes: CompileProcesses[str, tuple[int, int]]) -> None:
    control = CompileControl(30.0)
    threading.Timer(0.5, control.cancel, args=("another backend was done first",)).start()
    started = time.monotonic()
    with pytest.raises(CompileProcessError, match="the compile was stopped: another backend was done first"):
        processes.run("spin:30", control)
    assert time.monotonic() - started < 10


def test_a_slow_compile_drops_to_the_lowest_priority_and_its_child_retires(
    processes: CompileProcesses[str, tuple[int, int]],
) -> None:
    control = CompileControl(30.0)
    threading.Timer(0.3, control.mark_slow).start()
    pid, nice = processes.run("spin:1.5", control)
    assert nice == SLOW_COMPILE_NICENESS
    assert processes.run("quick")[0] != pid, "a child at the lowest priority is not used again"


MAIN_MODULE = """
import os

import imported_by_main  # what a server's main module imports (its engine, its settings)
from sglang_constrained.compile.processes import CompileProcesses


def start():
    return lambda key: (imported_by_main.importer, os.getppid(), os.getpid())


if __name__ == "__main__":
    processes = CompileProcesses(start, name="main-module", timeout_s=60)
    importer, fork_server, child = processes.run("key")
    processes.shutdown()
    print(importer == fork_server, importer != child)
"""


def test_a_main_module_run_with_dash_m_is_imported_once_by_the_fork_server_not_by_each_child(tmp_path: Path) -> None:
    """``python -m scheduler.launch``: each compile process finds the server's imports done (and its
    ``scheduler.lean_imports`` settings made before the engine's import) in the fork server it forks from, instead
    of importing them all again (~0.4 s of CPU a child, ~1.5 s more in the fork server), and prints nothing."""
    package = tmp_path / "server_package"  # as scheduler.launch is: a package's module
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main_module.py").write_text(MAIN_MODULE)
    (tmp_path / "imported_by_main.py").write_text("import os\n\nimporter = os.getpid()\n")
    done = run_python_in(tmp_path, "-m", "server_package.main_module")
    assert done.stdout.split() == ["True", "True"], "the child imported the main module's imports itself"
    assert done.stderr == "", "the fork server or a child printed something (runpy's warning of a module run twice?)"
