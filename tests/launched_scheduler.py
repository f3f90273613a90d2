"""Start a real scheduler process (``python -m scheduler.launch``) for a test, and stop it cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scheduler.client import SchedulerClient
from scheduler.io_struct import Pong

REPO_ROOT = Path(__file__).resolve().parents[1]
TEST_SERVER_FLAGS = ("--max-running-requests", "48", "--max-seq-len", "640")
"""Enough slots for the concurrency tests, a KV cache small enough to start in seconds."""


@dataclass
class LaunchedScheduler:
    endpoint: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def client(self) -> SchedulerClient:
        return SchedulerClient(self.endpoint, timeout_s=300)

    def status(self) -> Pong:
        with self.client() as client:
            return client.wait_until_ready(timeout_s=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def launch_scheduler(
    *flags: str,
    ranks: int = 1,
    extra_paths: tuple[Path, ...] = (),
    ready_timeout_s: float = 600,
    check_clean_stop: bool = True,
) -> Iterator[LaunchedScheduler]:
    """A scheduler on a free loopback port (under torchrun with several ``ranks``); ``extra_paths`` go on its
    PYTHONPATH. On exit it gets SIGTERM and, unless the test stops it otherwise, every rank must stop cleanly."""
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="scheduler-", suffix=".log", delete=False) as log_file:
        log_path = Path(log_file.name)
    launcher = [sys.executable, "-m", "scheduler.launch"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        launcher += ["--master-port", str(free_port()), "-m", "scheduler.launch"]
    command = [*launcher, "--zmq-port", str(port), *TEST_SERVER_FLAGS, *flags]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, extra_paths), os.environ.get("PYTHONPATH", "")]))
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    launched = LaunchedScheduler(f"tcp://127.0.0.1:{port}", process, log_path)
    try:
        _wait_until_ready(launched, ready_timeout_s)
        yield launched
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            exit_code = process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            message = f"the scheduler did not stop within 60 s of SIGTERM; log:\n{launched.log()[-3000:]}"
            raise AssertionError(message) from None
        log = launched.log()
        if check_clean_stop and ranks == 1:
            assert exit_code == 0, f"the scheduler exited with {exit_code}; log:\n{log[-3000:]}"
        elif (
            check_clean_stop
        ):  # torchrun itself reports the SIGTERM it got; what matters is that every rank stopped cleanly
            for rank in range(ranks):
                assert f"[rank {rank}] scheduler.launch: stopped" in log, (
                    f"rank {rank} did not stop; log:\n{log[-3000:]}"
                )
        log_path.unlink(missing_ok=True)


def _wait_until_ready(launched: LaunchedScheduler, timeout_s: float) -> None:
    """Ping until the scheduler answers; fail at once, with its log, if the process exits first."""
    deadline = time.monotonic() + timeout_s
    with launched.client() as client:
        while time.monotonic() < deadline:
            if launched.process.poll() is not None:
                raise AssertionError(f"the scheduler exited at start-up; log:\n{launched.log()[-3000:]}")
            try:
                client.wait_until_ready(timeout_s=2)
                return
            except TimeoutError:
                continue
    raise AssertionError(f"the scheduler was not ready within {timeout_s:g} s; log:\n{launched.log()[-3000:]}")
