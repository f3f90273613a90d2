"""``python -m scheduler.launch --grammar-backend xgrammar [--port 30000]``: load the model and serve (zmq, and
HTTP with ``--port``) until SIGINT/SIGTERM; under ``torchrun`` on every rank (see ``scheduler.serve``). With
``--dp-size N --router sglang``: N independent servers behind SGLang's router (see ``scheduler.replicas``).

With xgrammar, its compile processes' fork server is this process forked once the server's modules are imported
(``forked_fork_server``), with nothing left to import. Where this Python's fork server cannot be made so, it is
multiprocessing's own, a new interpreter importing xgrammar (seconds of CPU): it starts first, so that its imports run
beside this process's own, and finds this module light (it imports no engine, model or torch at its top).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

import scheduler.lean_imports  # noqa: F401  (first: before anything imports jsonschema)
from scheduler.replicas import serve_replicas
from scheduler.server_args import WORLD_SIZE, parse_server_args
from scheduler.session_priority import keep_launch_priority
from scheduler.startup_heap import imports_kept_out_of_collections
from sglang_constrained.backends.xgrammar.fork_server import start_xgrammar_fork_server
from sglang_constrained.compile.forked_fork_server import can_fork_fork_server


def main(argv: Sequence[str] | None = None) -> int:
    keep_launch_priority()  # first: a rank in a session of its own (torchrun's) runs at its launch priority
    server_args = parse_server_args(argv)
    server_args.parallel.check_world_size(WORLD_SIZE.get())
    if server_args.parallel.router is not None:
        return serve_replicas(server_args, sys.argv[1:] if argv is None else argv)
    grammar_args = server_args.grammar
    backends = grammar_args.grammar_backend_order if grammar_args.grammar_backend == "auto" else ()
    uses_xgrammar = "xgrammar" in (grammar_args.grammar_backend, *backends)
    forks_its_fork_server = uses_xgrammar and can_fork_fork_server()
    if uses_xgrammar and not forks_its_fork_server:
        start_xgrammar_fork_server()  # a new interpreter, whose imports run beside the next line's
    with imports_kept_out_of_collections():
        from scheduler.serve import serve

    if forks_its_fork_server:
        start_xgrammar_fork_server()  # this process, forked with its imports done
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
