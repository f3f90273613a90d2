"""The environment variables the project reads (one typed table; nowhere else reads ``os.environ``), and what the
machine offers: its cores and free ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable the project reads, with its type and default."""

    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is not valid: {e}") from e


GRAMMAR_POLL_INTERVAL = EnvVar(
    "SGLANG_GRAMMAR_POLL_INTERVAL", 0.005, float, "seconds the idle loop waits for messages while grammars compile"
)
GRAMMAR_MAX_POLL_ITERATIONS = EnvVar(
    "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS",
    10000,
    int,
    "poll intervals a grammar may take to compile; times the interval, the default compile deadline",
)
CACHE_DIR = EnvVar(
    "SGLANG_CONSTRAINED_CACHE_DIR",
    Path.home() / ".cache" / "sglang_constrained",
    Path,
    "where converted tokenizers, de-quantised weights and compiled grammars are cached",
)
WORLD_SIZE = EnvVar("WORLD_SIZE", 1, int, "number of ranks (set by torchrun; 1 when launched directly)")
ENVIRONMENT_TABLE: tuple[EnvVar, ...] = (GRAMMAR_POLL_INTERVAL, GRAMMAR_MAX_POLL_ITERATIONS, CACHE_DIR, WORLD_SIZE)


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_compile_timeout() -> float:
    """SGLang's deadline: ``SGLANG_GRAMMAR_MAX_POLL_ITERATIONS`` x ``SGLANG_GRAMMAR_POLL_INTERVAL`` seconds."""
    return GRAMMAR_MAX_POLL_ITERATIONS.get() * GRAMMAR_POLL_INTERVAL.get()


def cache_path(cache_dir: str | None) -> Path:
    """``--cache-dir``, else ``$SGLANG_CONSTRAINED_CACHE_DIR``, else ``~/.cache/sglang_constrained``."""
    return CACHE_DIR.get() if cache_dir is None else Path(cache_dir)


ZMQ_PORT = 30010
"""The scheduler's request socket, where the Python client finds it."""


def free_port(host: str) -> int:
    """A port the kernel has free on ``host`` now (the process binding it moments later may rarely find it taken)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def zmq_port_for(host: str, serves_http: bool) -> int:
    """``--zmq-port`` left out: ``ZMQ_PORT``; but a lone server with an HTTP port whose ``ZMQ_PORT`` another server
    on this machine holds takes a free port instead, so that ``--port A`` and ``--port B`` start two servers (their
    clients come over HTTP; the frontend is told the port)."""
    if not serves_http or WORLD_SIZE.get() != 1:
        return ZMQ_PORT
    try:
        with socket.socket() as probe:
            probe.bind((host, ZMQ_PORT))
        return ZMQ_PORT
    except OSError:
        return free_port(host)
