"""Run the scheduler as a child process (one rank, or several under torchrun) and wait until it serves."""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import psutil

from scheduler.client import SchedulerClient
from scheduler.io_struct import Pong
from scheduler.session_priority import autogroup_nice, set_autogroup_nice

if TYPE_CHECKING:
    from scheduler.testing.preloaded import ForkedScheduler, PreloadedLauncher

REPO_ROOT = Path(__file__).resolve().parents[2]


IDLE_PRIORITY = ("chrt", "--idle", "0")
"""A command's prefix that runs it under ``SCHED_IDLE``: it gets a core only when no other task wants it."""
EPHEMERAL_PORTS_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PORTS_BELOW_EPHEMERAL = 10_000
"""How many ports below the kernel's ephemeral range ``free_port`` picks from."""
_given_ports: set[int] = set()
_given_ports_lock = threading.Lock()


@functools.cache
def loopback_http() -> httpx.Client:
    """One HTTP client for the polls of local servers. ``httpx.get`` builds a client, and its TLS context (~20 ms of
    CPU), at every call: the polls of servers and routers while they start took ~7 s of the test suite's process.
    No connection is kept: a server polled may be a new one on the same port."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


def wait_until_healthy(
    url: str, process: subprocess.Popen[bytes] | ForkedScheduler, log: Callable[[], str], timeout_s: float
) -> None:
    """Until ``GET {url}/health`` answers 200; fails at once, with the tail of ``log()``, if ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if loopback_http().get(f"{url}/health", timeout=5).status_code == 200:
                return
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} at start-up:\n{log()[-3000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer within {timeout_s:g} s")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, and that nothing else is likely to take before the
    process it is meant for binds it (seconds later, after its imports).

    The port lies below the kernel's ephemeral range, where no outgoing connection (gloo's, torchrun's) and no bind
    to port 0 lands, and this process never gives it twice. (A port the kernel picked from the ephemeral range
    was once taken meanwhile by another group's connection, and the scheduler failed to bind it.)"""
    if not EPHEMERAL_PORTS_FILE.is_file():
        return _kernel_picked_port()
    first_ephemeral = int(EPHEMERAL_PORTS_FILE.read_text().split()[0])
    candidates = list(range(max(1024, first_ephemeral - PORTS_BELOW_EPHEMERAL), first_ephemeral))
    random.shuffle(candidates)
    with _given_ports_lock:
        for port in candidates:
            if port not in _given_ports and _can_bind(port):
                _given_ports.add(port)
                return port
    return _kernel_picked_port()


def _can_bind(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _kernel_picked_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class TreeMemory:
    """Memory of a process and its descendants, in MiB. ``rss`` adds each process's resident pages, so pages they
    share (a fork server's children share its imports) count once per process; ``pss`` splits each shared page
    between the processes that map it, so it sums to what the tree really holds."""

    rss: float
    pss: float


def cpu_model() -> str:
    """The CPU's model name as Linux reports it (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def process_tree_memory(pid: int) -> TreeMemory:
    """``pid``'s and its descendants' memory now (processes that exit meanwhile are left out)."""
    rss = pss = 0
    for process in process_tree(pid):
        try:
            info = process.memory_full_info()
        except psutil.Error:
            continue
        rss += info.rss
        pss += info.pss
    return TreeMemory(rss / 2**20, pss / 2**20)


def can_leave_idle_priority() -> bool:
    """Whether a child started at idle priority (``SchedulerProcess(idle_priority=True)``) can be given back the normal
    one: it needs ``chrt`` (util-linux) and ``CAP_SYS_NICE`` (or an ``RLIMIT_NICE`` that allows it), tried on a
    child of this process's own."""
    if shutil.which("chrt") is None:
        return False
    child = subprocess.Popen([*IDLE_PRIORITY, "sleep", "60"])
    try:
        os.sched_setscheduler(child.pid, os.SCHED_OTHER, os.sched_param(0))
    except PermissionError:
        return False
    finally:
        child.kill()
        child.wait()
    return True


def launch_environment(
    root: Path = REPO_ROOT, extra_paths: tuple[Path, ...] = (), env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a launch from ``root``: this process's, ``env`` added, ``extra_paths`` and ``root`` first
    on PYTHONPATH."""
    python_path = [*map(str, extra_paths), str(root), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(python_path)}


class SchedulerProcess:
    """``python -m scheduler.launch`` on a free loopback port, its output in a log file.

    With ``ranks > 1`` it runs under ``torch.distributed.run`` (torchrun). ``extra_paths`` go on PYTHONPATH
    (for ``--import-module`` and entry-point plugins); ``env`` adds to the environment (``OMP_NUM_THREADS``, say);
    ``root``: the checkout whose code runs (this one by default; a benchmark may compare another). ``launcher``: a
    one-rank launch it can make as the command would is forked from it, with its imports done
    (``scheduler.testing.preloaded``).
    """

    def __init__(
        self,
        *flags: str,
        ranks: int = 1,
        extra_paths: tuple[Path, ...] = (),
        env: Mapping[str, str] | None = None,
        root: Path = REPO_ROOT,
        idle_priority: bool = False,
        launcher: PreloadedLauncher | None = None,
    ) -> None:
        self.zmq_port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.zmq_port}"
        self.ranks = ranks
        with tempfile.NamedTemporaryFile(prefix="scheduler-", suffix=".log", delete=False) as log_file:
            self.log_path = Path(log_file.name)
        program = [sys.executable, "-m", "scheduler.launch"]
        if ranks > 1:
            program = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
            program += ["--master-port", str(free_port()), "-m", "scheduler.launch"]
        arguments = ["--zmq-port", str(self.zmq_port), *flags]
        command = [*program, *arguments]
        self.command = tuple(command)
        environment = launch_environment(root, extra_paths, env)
        self.process: subprocess.Popen[bytes] | ForkedScheduler
        if launcher is not None and ranks == 1 and launcher.accepts(environment, root):
            self.process = launcher.launch(arguments, environment, self.log_path, idle_priority)
            return
        started = [*IDLE_PRIORITY, *command] if idle_priority else command
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(started, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=environment)

    def leave_idle_priority(self) -> None:
        """Every thread of every process of the tree back to the normal scheduling policy (Linux keeps one per
        thread; threads and processes started later take their starter's), and each rank's session of its own back
        to the normal nice (``keep_launch_priority``). Passes over the tree until one finds nothing left idle, so
        that a rank or thread started during a pass is not missed."""
        changed = True
        while changed and self.process.poll() is None:
            changed = False
            with contextlib.suppress(psutil.NoSuchProcess):  # the launcher exited meanwhile (a failed start)
                for process in process_tree(self.process.pid):
                    with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                        if os.getsid(process.pid) == process.pid and (autogroup_nice(process.pid) or 0) > 0:
                            changed |= set_autogroup_nice(process.pid, 0)
                        for thread in process.threads():
                            if os.sched_getscheduler(thread.id) == os.SCHED_IDLE:
                                os.sched_setscheduler(thread.id, os.SCHED_OTHER, os.sched_param(0))
                                changed = True

    def client(self, timeout_s: float = 600.0) -> SchedulerClient:
        return SchedulerClient(self.endpoint, timeout_s=timeout_s)

    def wait_until_ready(self, timeout_s: float = 600.0) -> Pong:
        """Ping until the scheduler answers; raises at once, with its log, if the process exits first."""
        deadline = time.monotonic() + timeout_s
        with self.client() as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the scheduler exited at start-up; log:\n{self.log()[-3000:]}")
                try:
                    return client.wait_until_ready(timeout_s=2)
                except TimeoutError:
                    continue
        raise TimeoutError(f"the scheduler was not ready within {timeout_s:g} s; log:\n{self.log()[-3000:]}")

    def status(self) -> Pong:
        with self.client() as client:
            return client.wait_until_ready(timeout_s=30)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the scheduler answers live requests, then exits); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise TimeoutError(f"the scheduler did not stop within {timeout_s:g} s of SIGTERM") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank_pids(self) -> list[int]:
        """Each rank's pid, in rank order: the process itself, or under torchrun its workers (by their ``RANK``)."""
        if self.ranks == 1:
            return [self.process.pid]
        workers = {child.environ().get("RANK"): child.pid for child in psutil.Process(self.process.pid).children()}
        missing = [rank for rank in range(self.ranks) if str(rank) not in workers]
        if missing:
            raise RuntimeError(f"no torchrun worker with RANK in {missing} among {sorted(workers.values())}")
        return [workers[str(rank)] for rank in range(self.ranks)]

    def rank_anonymous_memory(self) -> list[int]:
        """Each rank's resident anonymous memory in bytes (its heap and private mappings, where the weights live),
        in rank order: its own process, not its compile processes. Its files' resident pages (its libraries' code,
        50-125 MiB) are left out: they count once the process touches them, so a process forked from one that had
        imported its libraries counts fewer than a new one, and they come and go with the machine's memory."""
        memory = [psutil.Process(pid).memory_info() for pid in self.rank_pids()]
        return [info.rss - info.shared for info in memory]

    def rank_weight_bytes(self) -> list[int]:
        """The bytes of model weights each rank holds, in rank order, as its model runner logged them."""
        pattern = r"(?:\[rank (\d+)\] )?scheduler\.model\.runner: .*?weight_bytes=(\d+)"
        logged = {int(rank or 0): int(size) for rank, size in re.findall(pattern, self.log())}
        if sorted(logged) != list(range(self.ranks)):
            raise RuntimeError(f"the model runners logged their weights for ranks {sorted(logged)} of {self.ranks}")
        return [logged[rank] for rank in range(self.ranks)]
