"""The HTTP frontend process: ``start_http_frontend`` (in the launcher) binds the port and starts
``python -m scheduler.http.server`` on the inherited socket, serving ``scheduler.http.app``.

The scheduler loop is synchronous and CPU-bound, so HTTP lives in another process that talks to it over zmq
with one ``AsyncSchedulerClient`` (one socket, any number of concurrent requests). The frontend stops on
SIGINT/SIGTERM, on ``HttpFrontend.stop``, and by itself when the launcher dies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

import uvicorn
from fastapi import FastAPI

import scheduler.lean_imports  # noqa: F401  (first: before anything imports jsonschema)
from scheduler.client import SchedulerGoneError
from scheduler.server_args import ServerArgs, add_server_args, server_args_from
from scheduler.startup_heap import imports_kept_out_of_collections

logger = logging.getLogger("scheduler.http")

GRACEFUL_SHUTDOWN_S = 2
STOP_TIMEOUT_S = 10.0
ORPHAN_CHECK_INTERVAL_S = 1.0
_FRONTEND_FLAGS = (
    "host",
    "port",
    "zmq_port",
    "model_path",
    "chat_template",
    "max_seq_len",
    "grammar_max_spec_bytes",
    "cache_dir",
    "tool_call_parser",
    "log_level",
)
"""The ``ServerArgs`` settings the frontend reads, passed on as their flags (``--setting-name``)."""


class HttpFrontend:
    """The running frontend process started by ``start_http_frontend``."""

    def __init__(self, process: subprocess.Popen[bytes], url: str) -> None:
        self.process = process
        self.url = url
        self.is_stopping = False

    def on_unexpected_exit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(exit_code)`` on a watcher thread if the process exits before ``stop`` is called."""

        def wait() -> None:
            exit_code = self.process.wait()
            if not self.is_stopping:
                callback(exit_code)

        threading.Thread(target=wait, name="http-frontend-watch", daemon=True).start()

    def stop(self) -> None:
        """SIGTERM (in-flight responses get ``GRACEFUL_SHUTDOWN_S`` to finish), SIGKILL if it does not exit."""
        self.is_stopping = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("the HTTP frontend (pid %d) ignored SIGTERM: killing it", self.process.pid)
                self.process.kill()
                self.process.wait()
        logger.info("HTTP frontend stopped (exit code %s)", self.process.returncode)


def start_http_frontend(server_args: ServerArgs) -> HttpFrontend:
    """Bind ``--host``:``--port`` here, so that a taken port fails in the caller, and serve it in a new process.

    The process reaches the scheduler at ``server_args.serving.zmq_endpoint``; requests that arrive before it is up
    wait in the socket's backlog.
    """
    serving, settings = server_args.serving, server_args.settings()
    if serving.port is None:
        raise ValueError("start_http_frontend needs --port")
    listener = socket.create_server((serving.host, serving.port))
    try:
        host, port = listener.getsockname()[:2]
        flags = [
            item
            for name in _FRONTEND_FLAGS
            if settings[name] is not None
            for item in (f"--{name.replace('_', '-')}", str(settings[name]))
        ]
        command = [sys.executable, "-m", "scheduler.http.server", *flags, "--listen-fd", str(listener.fileno())]
        process = subprocess.Popen(command, pass_fds=(listener.fileno(),))
    finally:
        listener.close()
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    logger.info("HTTP frontend (pid %d) serving on %s", process.pid, url)
    return HttpFrontend(process, url)


async def _serve(app: FastAPI, listener: socket.socket, log_level: str) -> None:
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=log_level,
        access_log=log_level == "debug",
        loop="asyncio",
        http="h11",
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    launcher = os.getppid()

    async def exit_when_orphaned() -> None:
        while os.getppid() == launcher:
            await asyncio.sleep(ORPHAN_CHECK_INTERVAL_S)
        logger.warning("the launcher (pid %d) is gone: shutting down", launcher)
        frontend = getattr(app.state, "frontend", None)  # None before the app has started
        if frontend is not None:
            gone = f"the scheduler (launcher pid {launcher}) is gone: the server is shutting down"
            frontend.client.fail_pending(SchedulerGoneError(gone))
        server.should_exit = True

    watchdog = asyncio.create_task(exit_when_orphaned())
    try:
        await server.serve(sockets=[listener])
    finally:
        watchdog.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scheduler.http.server", description=__doc__)
    add_server_args(parser)
    parser.add_argument("--listen-fd", type=int, required=True, help="a bound TCP socket inherited from the launcher")
    args = parser.parse_args(argv)
    server_args = server_args_from(args)
    log_level = server_args.serving.log_level
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    with imports_kept_out_of_collections():  # the app's imports, transformers among them
        from scheduler.http.app import create_app
    asyncio.run(_serve(create_app(server_args), socket.socket(fileno=args.listen_fd), log_level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
