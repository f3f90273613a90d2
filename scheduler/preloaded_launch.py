"""``python -m scheduler.preloaded_launch FD``: a process that imports what ``python -m scheduler.launch`` imports,
once, then forks one launcher for each launch asked of it on the listening socket ``FD``.

For a test session, which starts dozens of one-rank schedulers: each start spends most of its CPU importing torch,
transformers and the engines before it reads its flags (``import scheduler.launch, scheduler.serve``: 4.5-5.5 s of
CPU, 2026-12-01, Intel Xeon). A fork finds them imported. The child then does what the command would: it takes the
launch's environment, working directory and CPU priority, writes to the launch's log, and runs ``scheduler.launch``'s
``main`` with the launch's flags; the same code serves. What cannot be redone after the imports (a variable read at
import time: ``OMP_NUM_THREADS`` by OpenMP's runtime, say) is the client's to check: it asks only for launches whose
environment is this process's own (``scheduler.testing.preloaded.PreloadedLauncher``).

The protocol, one connection per launch: the client sends one JSON line (``argv``, ``env``, ``cwd``, ``log``,
``idle``); this process answers the child's pid on a line, and, once the child has exited, its exit code as
``subprocess.Popen.returncode`` gives it (``-N`` for signal N), then closes. It exits when its standard input closes
(the client stopped it, or died); the schedulers it forked run on until they are stopped, as commands would.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import socket
import sys
import traceback
from typing import Any

import scheduler.launch as launcher
from scheduler.startup_heap import imports_kept_out_of_collections

PRELOADED = ("scheduler.serve", "scheduler.http.server")
"""Imported after the launcher's own module, as the command does: what its ``main`` imports once it has read its
flags, and the HTTP frontend a server with ``--port`` starts."""
REAP_INTERVAL_S = 0.05
"""How often the loop looks for children that exited, while no launch is asked for."""


def serve_launches(listener: socket.socket) -> None:
    """Fork a launcher for each connection, report each one's exit; until standard input closes."""
    children: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(sys.stdin.fileno(), selectors.EVENT_READ)
        while True:
            for key, _ in selector.select(REAP_INTERVAL_S):
                if key.fileobj is listener:
                    connection, _ = listener.accept()
                    pid = _fork_launcher(connection, [selector, listener, *children.values()])
                    connection.sendall(f"{pid}\n".encode())
                    children[pid] = connection
                elif not os.read(sys.stdin.fileno(), 4096):
                    return
            _report_exits(children)


def _report_exits(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError), connection:  # a client that has gone no longer asks
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


def _fork_launcher(connection: socket.socket, inherited: list[selectors.BaseSelector | socket.socket]) -> int:
    """Fork the launch ``connection`` asks for; returns the child's pid. The child closes what it ``inherited`` from
    this loop, and never returns."""
    with connection.makefile("rb") as lines:
        request = json.loads(lines.readline())
    sys.stdout.flush()
    sys.stderr.flush()
    policy_set, policy_set_here = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(policy_set)
        try:
            if request["idle"]:
                os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        finally:
            os.close(policy_set_here)
        return pid
    code = 1
    try:
        os.close(policy_set_here)
        os.read(policy_set, 1)  # until this process's parent has set its policy (end of file)
        os.close(policy_set)
        for loop_part in (*inherited, connection):
            loop_part.close()
        _become_launch(request)
        code = launcher.main(request["argv"])
    except SystemExit as stop:  # argparse's refusal of a flag, say: its message is already in the log
        code = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    except BaseException:
        traceback.print_exc()
    finally:
        launcher.exit_now(code)
    raise AssertionError("unreachable: exit_now does not return")


def _become_launch(request: dict[str, Any]) -> None:
    """This forked child takes what the launch's command would have had. An idle launch's policy was set by its
    parent before the child's pid was answered: set here, it could come after a client that had the pid had given
    the launch the normal policy back (``SchedulerProcess.leave_idle_priority``), and stay idle for good."""
    if not request["idle"] and os.sched_getscheduler(0) != os.SCHED_OTHER:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [launcher.__file__, *request["argv"]]


if __name__ == "__main__":
    with imports_kept_out_of_collections():  # frozen before the forks, which then never walk them
        for name in PRELOADED:
            importlib.import_module(name)
    with socket.socket(fileno=int(sys.argv[1])) as listening:
        serve_launches(listening)
