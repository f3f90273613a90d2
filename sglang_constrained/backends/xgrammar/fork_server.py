"""The fork server of xgrammar's compile processes, started by a launcher that has not imported xgrammar yet.

Where this process can fork itself into the fork server (``forked_fork_server``), starting it imports xgrammar here
first; else the fork server is a new interpreter, which spends seconds of CPU importing xgrammar (and with it torch
and transformers), and a launcher that starts it before its own imports (``scheduler.launch``) has both run at once,
on two cores. The server's ``XGrammarGrammarBackend`` later forks its compile processes from it.
"""

from __future__ import annotations

from sglang_constrained.compile.processes import start_fork_server

XGRAMMAR_COMPILE_PRELOAD = ("sglang_constrained.backends.xgrammar.backend",)
"""What the compile processes' fork server imports once (the backend's module, and so xgrammar)."""


def start_xgrammar_fork_server() -> None:
    """Start the fork server now (see ``compile_processes.start_fork_server``)."""
    start_fork_server(XGRAMMAR_COMPILE_PRELOAD)
