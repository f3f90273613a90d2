"""SGLang's router (the ``router`` extra: ``sglang-router``) as a child process in front of running servers."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from scheduler.testing.process import free_port


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
                body = httpx.get(f"{self.url}/readiness", timeout=5).json()
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
