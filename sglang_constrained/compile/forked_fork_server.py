"""The compile processes' fork server made by forking this process, where multiprocessing starts a new interpreter.

multiprocessing's fork server is a fresh interpreter that imports the modules it preloads: for xgrammar's compile
processes, xgrammar and with it torch and transformers, seconds of CPU at every server start and on every rank,
importing what the server has just imported itself. A process whose imports are done can fork itself into that
server instead: the fork runs multiprocessing's own loop (``multiprocessing.forkserver.main``) and the compile
processes fork from it as before, finding every import done.

It is done only where it is safe: on the main thread, with no other Python thread running (a native thread pool
idle since an import, OpenBLAS's, is fork-safe, as it is in multiprocessing's own fork server, which imports the
same libraries before it forks), before the process has loaded a model or opened a socket (the launcher calls it
right after its imports), and where ``multiprocessing.forkserver`` is the one this module drives
(``can_fork_fork_server``: CPython 3.10-3.13; 3.14 adds an authentication key). Elsewhere the caller starts
multiprocessing's own fork server. Either way multiprocessing connects to it the same way; if it dies, the next
compile process starts a new one of multiprocessing's own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import multiprocessing.forkserver
import os
import socket
import sys
import threading
import traceback
from collections.abc import Sequence
from multiprocessing import connection, resource_tracker, util
from typing import Any

_FORK_SERVER_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
_FORK_SERVER_STATE = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_lock")


def can_fork_fork_server() -> bool:
    """Whether this Python's ``multiprocessing.forkserver`` is the one ``fork_fork_server`` knows how to drive."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    parameters = tuple(inspect.signature(multiprocessing.forkserver.main).parameters)
    return (
        parameters == _FORK_SERVER_MAIN_PARAMETERS
        and all(hasattr(server, name) for name in _FORK_SERVER_STATE)
        and not hasattr(server, "_forkserver_authkey")
    )


def fork_fork_server(preload: Sequence[str]) -> bool:
    """Import ``preload`` here, then fork this process into multiprocessing's fork server; False (nothing done) where
    that is not safe or not known to work (see the module doc), or when a fork server already runs."""
    server: Any = multiprocessing.forkserver._forkserver  # its state is private: typeshed declares none of it
    if not can_fork_fork_server() or threading.current_thread() is not threading.main_thread():
        return False
    for name in preload:
        importlib.import_module(name)
    if threading.active_count() != 1:
        return False
    with server._lock:  # released before the fork, which would copy it held: no other thread runs meanwhile
        if server._forkserver_pid is not None:
            return False
    resource_tracker.ensure_running()  # before the fork: its children reach the tracker the parent started
    with socket.socket(socket.AF_UNIX) as listener:
        address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server exits once every write end (this process's) is closed
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _serve(listener.fileno(), alive_r, alive_w)
        os.close(alive_r)
    with server._lock:
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def _serve(listener_fd: int, alive_r: int, alive_w: int) -> None:
    """The forked fork server: multiprocessing's loop until the parent's end of the pipe closes; never returns into
    the parent's code."""
    code = 1
    try:
        os.close(alive_w)
        multiprocessing.forkserver.main(listener_fd, alive_r, [])
        code = 0
    except SystemExit as stop:  # how the loop ends when the parent has gone
        code = stop.code if isinstance(stop.code, int) else 0
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)
