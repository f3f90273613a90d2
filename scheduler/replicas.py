"""``python -m scheduler.launch --dp-size N --router sglang --port P``: N independent servers behind SGLang's router.

Each replica is a whole server of its own (``python -m scheduler.launch`` with the same flags, on a free HTTP and zmq
port): no collective joins them, so one that dies stops none of the others. The launcher starts them, waits until
each answers ``/health``, then starts SGLang's router (the ``router`` extra) on ``--port`` in front of them and of any
``--worker-urls`` (servers on other machines). While it runs it restarts a replica that exits (on the same ports, so
the router's health checks find it again) and stops everything if the router exits; SIGINT/SIGTERM stop the router,
then the replicas (each answers its live requests first).

The lockstep mode (``torchrun ... --dp-size N`` without ``--router``) stays where ranks must agree each turn: one
process group, grammars compiled once for all replicas; see the README's "Several ranks".
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from scheduler.server_args import ServerArgs, free_port

logger = logging.getLogger("scheduler.launch")

OWNED_FLAGS = (
    "--dp-size",
    "--router",
    "--router-policy",
    "--router-health-check-interval",
    "--worker-urls",
    "--port",
    "--zmq-port",
)
"""The launcher's flags that are not passed on to each replica (which gets ports of its own)."""
STARTUP_TIMEOUT_S = 600.0
RESTART_AFTER_S = 5.0
"""A replica that exits is restarted no sooner than this after its last start (a start-up that keeps failing does
not spin)."""
POLL_INTERVAL_S = 0.5
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "warn", "warning": "warn", "error": "error"}
"""The router's log level per ``--log-level`` (its ``info`` logs every step of every worker's registration)."""


@dataclass
class Replica:
    """One server process of the set, and the ports it keeps across restarts."""

    index: int
    command: list[str]
    url: str
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0

    def start(self) -> None:
        # a session (and process group) of its own: what is left of it once it has exited (its HTTP frontend, which
        # would hold the port a moment longer) is killed by group before it is restarted
        self.process = subprocess.Popen(self.command, start_new_session=True)
        self.started_at = time.monotonic()
        logger.info("replica %d (pid %d) starting on %s", self.index, self.process.pid, self.url)

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def kill_remains(self) -> None:
        """Kill what is left of the replica's process group (its launcher has exited)."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def replica_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` without the launcher's own flags (``OWNED_FLAGS``, with their values, in either ``--flag value`` or
    ``--flag=value`` form)."""
    kept: list[str] = []
    skipping = False
    for arg in argv:
        if arg.startswith("--"):
            name = arg.split("=", 1)[0]
            skipping = name in OWNED_FLAGS and "=" not in arg
            if name in OWNED_FLAGS:
                continue
        elif skipping:
            continue
        kept.append(arg)
    return kept


def serve_replicas(server_args: ServerArgs, argv: Sequence[str]) -> int:
    """Run the replicas and the router until SIGINT/SIGTERM or the router's exit; returns the exit code. The whole
    ``server_args``: the replicas and router are the parallel part's, the address and logging the serving part's."""
    serving, parallel = server_args.serving, server_args.parallel
    logging.basicConfig(level=serving.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if importlib.util.find_spec("sglang_router") is None:
        logger.error('--router sglang needs SGLang\'s router: pip install -e ".[router]" (or sglang-router)')
        return 2
    assert serving.port is not None  # ServerArgs checks it
    connect_host = "127.0.0.1" if serving.host in ("0.0.0.0", "") else serving.host
    flags = replica_argv(argv)
    replicas = []
    for index in range(parallel.dp_size):
        port, zmq_port = free_port(serving.host), free_port(serving.host)
        command = [sys.executable, "-m", "scheduler.launch", *flags, "--port", str(port), "--zmq-port", str(zmq_port)]
        replicas.append(Replica(index, command, f"http://{connect_host}:{port}"))
    stop_requested: list[int] = []

    def request_stop(signum: int, _: FrameType | None) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    for replica in replicas:
        replica.start()
    router: subprocess.Popen[bytes] | None = None
    try:
        if not _wait_until_healthy(replicas, stop_requested):
            return 0 if stop_requested else 1
        metrics_port = free_port(serving.host)
        router = subprocess.Popen(_router_command(server_args, [r.url for r in replicas], metrics_port))
        logger.info(
            "SGLang's router (pid %d, %s) serving on http://%s:%d in front of %d replicas%s; the router's metrics on "
            "http://%s:%d/metrics",
            router.pid,
            parallel.router_policy,
            connect_host,
            serving.port,
            len(replicas),
            f" and {len(parallel.worker_urls)} servers by URL" if parallel.worker_urls else "",
            connect_host,
            metrics_port,
        )
        return _supervise(replicas, router, stop_requested)
    finally:
        if router is not None and router.poll() is None:
            router.send_signal(signal.SIGTERM)
            _wait(router, "the router")
        for replica in replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in replicas:
            if replica.process is not None:
                _wait(replica.process, f"replica {replica.index}")
                replica.kill_remains()


def _supervise(replicas: list[Replica], router: subprocess.Popen[bytes], stop_requested: list[int]) -> int:
    """Restart replicas that exit; return when a stop is requested (0) or the router exits (its code, else 1)."""
    while not stop_requested:
        code = router.poll()
        if code is not None:
            logger.error("the router exited with code %d: stopping the replicas", code)
            return code or 1
        for replica in replicas:
            exit_code = replica.exit_code()
            if exit_code is None:
                continue
            if time.monotonic() - replica.started_at < RESTART_AFTER_S:
                continue
            replica.kill_remains()
            replica.restarts += 1
            logger.warning(
                "replica %d exited with code %d: restarting it (restart %d); the router sends its requests to the "
                "others meanwhile",
                replica.index,
                exit_code,
                replica.restarts,
            )
            replica.start()
        time.sleep(POLL_INTERVAL_S)
    return 0


def _wait_until_healthy(replicas: list[Replica], stop_requested: list[int]) -> bool:
    """Until every replica answers ``/health``; False (logged) if one exits at start-up, a stop is requested or
    ``STARTUP_TIMEOUT_S`` passes."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    waiting = list(replicas)
    while waiting and not stop_requested:
        for replica in list(waiting):
            code = replica.exit_code()
            if code is not None:
                logger.error("replica %d exited with code %d at start-up", replica.index, code)
                return False
            if _is_healthy(replica.url):
                logger.info("replica %d serving on %s", replica.index, replica.url)
                waiting.remove(replica)
        if time.monotonic() > deadline:
            late = [r.index for r in waiting]
            logger.error("replicas %s did not answer /health within %g s", late, STARTUP_TIMEOUT_S)
            return False
        time.sleep(POLL_INTERVAL_S)
    return not waiting


def _is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _router_command(server_args: ServerArgs, replica_urls: list[str], metrics_port: int) -> list[str]:
    serving, parallel = server_args.serving, server_args.parallel
    interval = str(parallel.router_health_check_interval)
    return [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        serving.host,
        "--port",
        str(serving.port),
        "--policy",
        parallel.router_policy,
        "--worker-urls",
        *replica_urls,
        *parallel.worker_urls,
        # its Prometheus exporter's default port (29000) is one per machine
        "--prometheus-port",
        str(metrics_port),
        "--health-check-interval-secs",
        interval,
        # a replica whose requests failed while it died is tried again as soon as it is back, not a minute later
        # (the router's circuit breaker stays open 60 s by default)
        "--cb-timeout-duration-secs",
        interval,
        "--log-level",
        ROUTER_LOG_LEVELS[serving.log_level],
    ]


def _wait(process: subprocess.Popen[bytes], name: str, timeout_s: float = 60.0) -> None:
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        logger.warning("%s (pid %d) did not stop within %g s of SIGTERM: killing it", name, process.pid, timeout_s)
        process.kill()
        process.wait()
