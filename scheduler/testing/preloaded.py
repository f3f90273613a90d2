"""One-rank schedulers forked from a process that has already imported them (``scheduler.preloaded_launch``), for a
test session that starts dozens: each start skips the ~5 s of CPU its imports take.

``SchedulerProcess(..., launcher=...)`` asks the ``PreloadedLauncher`` for the launches it can make as the command
would (``accepts``) and starts the command for the others. Its ``ForkedScheduler`` stands where the command's
``subprocess.Popen`` would, with the part of Popen's interface the tests use.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from scheduler.testing.process import IDLE_PRIORITY, can_leave_idle_priority, launch_environment

PER_LAUNCH_VARIABLES = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
"""Variables that may differ between launches forked from one preloaded process: no import reads them, and each
child sets its launch's own. pytest names the running test in ``PYTEST_CURRENT_TEST``; torch sets
``TORCHINDUCTOR_CACHE_DIR`` the first time a process asks for its kernel cache (the tests' Triton kernels do)."""


def _without_per_launch(environment: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items() if name not in PER_LAUNCH_VARIABLES}


class ForkedScheduler:
    """A launcher the preloaded process forked: its pid, signals sent to it, and the exit code the preloaded process
    reports, with ``subprocess.Popen``'s ``poll``, ``wait``, ``send_signal``, ``kill`` and ``returncode``."""

    def __init__(self, connection: socket.socket, command: Sequence[str], launcher_log: Path) -> None:
        self._connection = connection
        self._command = list(command)
        self._launcher_log = launcher_log
        self._received = b""
        self._pid: int | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        """Waits for the fork, the first time (the preloaded process may still be importing)."""
        while self._pid is None:
            self._receive(None)
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(self._command, timeout or 0)
            self._receive(remaining)
        return self.returncode

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _receive(self, timeout: float | None) -> None:
        """Read what the preloaded process has said (waiting up to ``timeout``): the pid, then the exit code."""
        readable, _, _ = select.select([self._connection], [], [], timeout)
        if not readable:
            return
        data = self._connection.recv(4096)
        if not data:
            self._connection.close()
            raise RuntimeError(
                f"the preloaded launcher exited before reporting its scheduler's exit; its log:\n"
                f"{self._launcher_log.read_text(errors='replace')[-3000:]}"
            )
        self._received += data
        *lines, self._received = self._received.split(b"\n")
        for line in lines:
            if self._pid is None:
                self._pid = int(line)
            else:
                self.returncode = int(line)
                self._connection.close()


class PreloadedLauncher:
    """``python -m scheduler.preloaded_launch``, started at the first launch asked of it, for launches from ``root``
    with the environment a launch without additions has (``launch_environment``) as it starts.

    It imports at idle priority where a launch can be given the normal one back (``can_leave_idle_priority``), so
    that its imports take a core only when the tests leave one; a launch asked at normal priority gives it the
    normal one.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._environment: dict[str, str] | None = None
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._address = ""
        self._idle_priority = False
        self._log_path: Path | None = None

    def accepts(self, environment: Mapping[str, str], cwd: Path) -> bool:
        """Whether a launch with this environment and working directory runs here as its command would."""
        own = launch_environment(self.root) if self._environment is None else self._environment
        return cwd == self.root and _without_per_launch(environment) == _without_per_launch(own)

    def launch(
        self, argv: Sequence[str], environment: Mapping[str, str], log_path: Path, idle_priority: bool
    ) -> ForkedScheduler:
        """Fork ``python -m scheduler.launch *argv`` with ``environment`` (one it ``accepts``), its output appended to
        ``log_path`` (created if missing: the child only appends, and a child that cannot open its log dies
        without a word)."""
        log_path.touch()
        address, log = self._started()
        if not idle_priority and self._idle_priority:
            self._leave_idle_priority()
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(address)
        request = {
            "argv": list(argv),
            "env": dict(environment),
            "cwd": str(self.root),
            "log": str(log_path),
            "idle": idle_priority,
        }
        connection.sendall(json.dumps(request).encode() + b"\n")
        return ForkedScheduler(connection, [sys.executable, "-m", "scheduler.launch", *argv], log)

    def stop(self) -> None:
        """Close its standard input (it exits); the schedulers it forked are their owners' to stop."""
        with self._lock:
            if self._process is None:
                return
            assert self._process.stdin is not None and self._log_path is not None
            self._process.stdin.close()
            self._process.wait()
            self._process = None
            os.unlink(self._address)
            os.rmdir(os.path.dirname(self._address))
            self._log_path.unlink(missing_ok=True)

    def _started(self) -> tuple[str, Path]:
        """Its socket's address and its log, started first if it is not running."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._start()
            assert self._log_path is not None
            return self._address, self._log_path

    def _start(self) -> None:
        self._environment = launch_environment(self.root)
        self._address = os.path.join(tempfile.mkdtemp(prefix="preloaded-launch-"), "socket")
        self._idle_priority = can_leave_idle_priority()
        with socket.socket(socket.AF_UNIX) as listener:  # bound here: launches can connect before its imports end
            listener.bind(self._address)
            listener.listen()
            command = [sys.executable, "-m", "scheduler.preloaded_launch", str(listener.fileno())]
            with tempfile.NamedTemporaryFile(prefix="preloaded-launch-", suffix=".log", delete=False) as log:
                self._log_path = Path(log.name)
                self._process = subprocess.Popen(
                    [*IDLE_PRIORITY, *command] if self._idle_priority else command,
                    cwd=self.root,
                    env=self._environment,
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(listener.fileno(),),
                )

    def _leave_idle_priority(self) -> None:
        assert self._process is not None
        os.sched_setscheduler(self._process.pid, os.SCHED_OTHER, os.sched_param(0))
        self._idle_priority = False
