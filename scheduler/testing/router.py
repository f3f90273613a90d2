"""SGLang's router (the ``router`` extra: ``sglang-router``) as a child process in front of running servers
(``RouterProcess``), or the launcher's replicas behind it (``ReplicaSet``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from scheduler.testing.process import REPO_ROOT, free_port, loopback_http

REPLICA_START = re.compile(r"replica (\d+) \(pid (\d+)\) starting on (\S+)")
"""The launcher's line for each start of a replica (``scheduler.replicas``)."""
ROUTER_METRICS = re.compile(r"router's metrics on (\S+)")


def router_installed() -> bool:
    """Whether the ``router`` extra is installed (``pip install -e ".[router]"``)."""
    return importlib.util.find_spec("sglang_router") is not None


class RouterProcess:
    """``python -m sglang_router.launch_router`` on a free loopback port in front of ``worker_urls``, its output in a
    log file; its Prometheus exporter on a free port too (its default, 29000, is one per machine)."""

    def __init__(self, worker_urls: list[str], policy: str = "cache_aware", *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = list(worker_urls)
        command = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-port",
            str(free_port()),
            "--policy",
            policy,
            "--log-level",
            "warn",
            "--worker-urls",
            *self.worker_urls,
            *flags,
        ]
        self.command = tuple(command)
        with tempfile.NamedTemporaryFile(prefix="router-", suffix=".log", delete=False) as log_file:
            self.log_path = Path(log_file.name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_until_ready(self, timeout_s: float = 60.0) -> None:
        """Until the router's ``/readiness`` counts every worker healthy; raises with its log if it exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the router exited with code {self.process.returncode}:\n{self.log()[-3000:]}")
            try:
                body = loopback_http().get(f"{self.url}/readiness", timeout=5).json()
                if body.get("healthy_workers") == len(self.worker_urls):
                    return
            except (httpx.TransportError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"the router did not see its workers healthy within {timeout_s:g} s:\n{self.log()[-3000:]}")

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@dataclass(frozen=True)
class ReplicaStart:
    """One start of a replica, as the launcher logged it."""

    index: int
    pid: int
    url: str


class ReplicaSet:
    """``python -m scheduler.launch --dp-size N --router sglang`` on a free loopback port: the launcher, its replicas
    and SGLang's router, their output in one log file. What the launcher logs tells the replicas' pids and URLs and
    the router's metrics address."""

    def __init__(
        self, dp_size: int, *flags: str, policy: str = "cache_aware", health_check_interval_s: int = 1
    ) -> None:
        self.dp_size = dp_size
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "scheduler.launch", "--dp-size", str(dp_size), "--router", "sglang"]
        command += ["--port", str(self.port), "--router-policy", policy]
        command += ["--router-health-check-interval", str(health_check_interval_s), *flags]
        self.command = tuple(command)
        python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
        with tempfile.NamedTemporaryFile(prefix="replicas-", suffix=".log", delete=False) as log_file:
            self.log_path = Path(log_file.name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": python_path},
            )

    def num_healthy(self) -> int | None:
        """The workers the router counts healthy now (its ``/readiness``); None while it does not answer."""
        try:
            return int(loopback_http().get(f"{self.url}/readiness", timeout=5).json().get("healthy_workers", 0))
        except (httpx.TransportError, ValueError):
            return None

    def wait_for_workers(self, healthy: int, timeout_s: float = 600.0) -> None:
        """Until the router counts ``healthy`` workers healthy; raises with the log if the launcher exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launcher exited with code {self.process.returncode}:\n{self.log()[-3000:]}")
            if self.num_healthy() == healthy:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the router did not count {healthy} workers healthy within {timeout_s:g} s")

    def starts(self) -> list[ReplicaStart]:
        """Every replica start so far, in order."""
        return [ReplicaStart(int(i), int(pid), url) for i, pid, url in REPLICA_START.findall(self.log())]

    def current(self, index: int) -> ReplicaStart:
        """Replica ``index``'s latest start."""
        return [start for start in self.starts() if start.index == index][-1]

    def wait_for_restart(self, index: int, killed_pid: int, timeout_s: float = 600.0) -> ReplicaStart:
        """Replica ``index``'s start after ``killed_pid`` died, once it answers ``/health``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            start = self.current(index)
            if start.pid != killed_pid and is_healthy(start.url):
                return start
            time.sleep(0.2)
        raise TimeoutError(f"replica {index} did not come back within {timeout_s:g} s:\n{self.log()[-3000:]}")

    def router_metrics_url(self) -> str:
        """Where the router's Prometheus exporter serves (the launcher logs it)."""
        found = ROUTER_METRICS.search(self.log())
        if found is None:
            raise RuntimeError("the launcher has not logged the router's metrics address yet")
        return found.group(1)

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM (the router, then the replicas stop); if the launcher does not exit in time, its whole tree is
        killed. Returns the launcher's exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait()

    def kill(self) -> None:
        """SIGKILL the launcher and everything it started (a failed test's clean-up)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            for process in [
                *psutil.Process(self.process.pid).children(recursive=True),
                psutil.Process(self.process.pid),
            ]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def is_healthy(server_url: str) -> bool:
    """Whether a server answers ``/health`` with 200 now."""
    try:
        return loopback_http().get(f"{server_url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def num_generations(server_url: str) -> float:
    """The generations a server has answered since it started (its frontend's ``sglang:num_requests`` counter)."""
    return server_metric(server_url, "sglang:num_requests_total")


def server_metric(server_url: str, name: str) -> float:
    """The sum of a server's ``name`` samples over their labels (its ``/metrics``)."""
    metrics = loopback_http().get(f"{server_url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith((f"{name}{{", f"{name} "))
    )
