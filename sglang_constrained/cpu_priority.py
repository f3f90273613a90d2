"""The CPU priority grammar work runs at: compiles, and the disk cache's writes, yield to the serving loop."""

from __future__ import annotations

import contextlib
import os

COMPILE_NICENESS = 10
"""How far below the server's CPU priority compiles run: a busy compile gets the cycles the loop leaves, and the
loop loses about a tenth of a core to it at worst (Linux CFS weights 1024 against 110)."""
SLOW_COMPILE_NICENESS = 19
"""The lowest priority, where compile processes run once their compile leaves its slot (CFS weight 15: a new
compile at ``COMPILE_NICENESS`` gets seven times their share of a core). Threads keep theirs: a thread's priority
cannot be raised back without privileges, and the threads it would start inherit it."""


def thread_nice() -> int:
    """The calling thread's nice value (0 where there is none)."""
    return os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def set_nice(pid: int, nice: int) -> None:
    """Set a process's nice value (on Linux also a thread's, by its native id: a thread has its own there), if it
    is allowed (raising it always is); the threads it starts inherit it. Without ``setpriority`` it does nothing."""
    if hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, min(nice, SLOW_COMPILE_NICENESS))
