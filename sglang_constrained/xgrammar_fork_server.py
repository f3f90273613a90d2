"""The fork server of xgrammar's compile processes, started without importing xgrammar.

The fork server spends its ~2.5 s of CPU importing xgrammar (and with it torch and transformers); a launcher that
starts it before its own imports (``scheduler.launch``) has both run at once, on two cores, instead of one after the
other. The server's ``XGrammarGrammarBackend`` later forks its compile processes from it.
"""

from __future__ import annotations

from sglang_constrained.compile_processes import start_fork_server

XGRAMMAR_COMPILE_PRELOAD = ("sglang_constrained.xgrammar_backend",)
"""What the compile processes' fork server imports once (the backend's module, and so xgrammar)."""


def start_xgrammar_fork_server() -> None:
    """Start the fork server now, in the background (see ``compile_processes.start_fork_server``)."""
    start_fork_server(XGRAMMAR_COMPILE_PRELOAD)
