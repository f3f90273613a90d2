"""``python -m scheduler.launch --grammar-backend xgrammar [--port 30000]``: load the model and serve (zmq, and
HTTP with ``--port``) until SIGINT/SIGTERM; under ``torchrun`` on every rank (see ``scheduler.serve``).

This module imports no engine, model or torch at its top. With xgrammar, its compile processes' fork server starts
first and imports xgrammar (~2.5 s of CPU) while this process imports the server's modules (as much again), instead
of after them; and the fork server, which imports the main module (``compile_processes``), finds this one light.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import scheduler.lean_imports  # noqa: F401  (first: before anything imports jsonschema)
from scheduler.server_args import WORLD_SIZE, ServerArgs
from sglang_constrained.xgrammar_fork_server import start_xgrammar_fork_server


def main(argv: Sequence[str] | None = None) -> int:
    server_args = ServerArgs.parse(argv)
    server_args.check_world_size(WORLD_SIZE.get())
    backends = server_args.grammar_backend_order if server_args.grammar_backend == "auto" else ()
    if "xgrammar" in (server_args.grammar_backend, *backends):
        start_xgrammar_fork_server()
    from scheduler.serve import serve  # after the fork server's start: see the module docstring

    return serve(server_args)


def exit_now(code: int) -> None:
    """Exit without joining the grammar compile threads: a compile inside a native engine cannot be interrupted,
    and the interpreter would otherwise wait for it (minutes, for a pathological schema) after shutdown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
