"""The serving part of the settings: where the server listens, how it logs, what it imports and seeds first."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.server_args.environment import GRAMMAR_POLL_INTERVAL, ZMQ_PORT
from scheduler.server_args.options import option

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServingArgs:
    """The sockets (zmq for the Python client, HTTP with ``--port``), logging, the sampling seed and the loop's
    idle wait."""

    host: str = option("127.0.0.1", "address the zmq socket and the HTTP server bind (loopback by default)")
    port: int | None = option(None, "serve the OpenAI-compatible HTTP API on this port (default: no HTTP server)")
    zmq_port: int = option(
        ZMQ_PORT,
        f"the scheduler's request socket (default {ZMQ_PORT}; with --port, a free one if {ZMQ_PORT} is taken)",
        is_resolved_at_launch=True,
    )
    import_modules: tuple[str, ...] = option(
        (),
        "import this module first (repeatable), e.g. one that calls register_grammar_backend",
        name="--import-module",
        action="append",
    )
    seed: int = option(0)
    log_level: str = option("info", choices=LOG_LEVELS)
    poll_interval: float | None = None
    """Seconds the idle loop waits for messages (default: ``$SGLANG_GRAMMAR_POLL_INTERVAL``); no flag."""

    @property
    def zmq_endpoint(self) -> str:
        """The address the scheduler's request socket binds and clients connect to."""
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def poll_interval_s(self) -> float:
        return GRAMMAR_POLL_INTERVAL.get() if self.poll_interval is None else self.poll_interval

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
