"""The compile processes' fork server forked from a process whose imports are done, not a new interpreter importing
them again; and multiprocessing's own where forking is not safe. Each case runs in a fresh interpreter, as a
launcher does, since a fork server is one per process."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from sglang_constrained.compile.forked_fork_server import can_fork_fork_server
from tests.fresh_interpreter import run_python_in

LAUNCHER = """
import json
import os
import sys
import threading

import psutil

from sglang_constrained.compile.processes import CompileProcesses, start_fork_server


def start():
    return lambda key: (os.getpid(), os.getppid(), "imported_by_preload" in sys.modules)


if __name__ == "__main__":
    if sys.argv[1] == "with a thread":
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    start_fork_server(["imported_by_preload"])
    imported_here = "imported_by_preload" in sys.modules
    processes = CompileProcesses(start, name="forked", timeout_s=60, preload=["imported_by_preload"])
    child, server, found_imported = processes.run("key")  # server: the compile process's parent
    me = psutil.Process()
    report = {
        "server_is_my_child": psutil.Process(server).ppid() == me.pid,
        "server_cmdline_is_mine": psutil.Process(server).cmdline() == me.cmdline(),
        "child_is_not_me": child != me.pid,
        "found_imported": found_imported,
        "imported_here": imported_here,
        "server": server,
    }
    processes.shutdown()
    print(json.dumps(report), flush=True)
"""


def run_launcher(tmp_path: Path, mode: str) -> dict[str, object]:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "imported_by_preload.py").write_text("")
    done = run_python_in(tmp_path, "launcher.py", mode)
    assert done.stderr == "", "the fork server or a child printed something"
    report: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.skipif(not can_fork_fork_server(), reason="this Python's fork server is not one this code forks")
def test_a_single_threaded_launcher_forks_its_fork_server_with_its_imports_done(tmp_path: Path) -> None:
    report = run_launcher(tmp_path, "alone")
    assert report["imported_here"], "the preloaded modules are imported in the launcher, before it forks"
    assert report["server_is_my_child"] and report["server_cmdline_is_mine"], "the fork server is the launcher forked"
    assert report["child_is_not_me"] and report["found_imported"], "a compile process forks from it, imports done"
    assert wait_gone(int(str(report["server"]))), "the fork server exits with its launcher"


def test_a_launcher_running_another_thread_starts_multiprocessings_own_fork_server(tmp_path: Path) -> None:
    report = run_launcher(tmp_path, "with a thread")
    assert report["server_is_my_child"] and not report["server_cmdline_is_mine"], "a new interpreter, not a fork"
    assert report["child_is_not_me"] and report["found_imported"]
    assert wait_gone(int(str(report["server"])))
