"""A process that leads its own session keeps the CPU priority it was launched at.

``torchrun`` starts every rank in a session of its own. Where Linux groups tasks by session (``autogroup``, on by
default in most distribution kernels), the CPU is shared between sessions first and a task's nice value or
``SCHED_IDLE`` policy counts only inside its session: ranks launched with ``nice -n 19`` or ``chrt --idle 0`` would
each take as large a share as the whole session that launched them (measured: two-rank groups started at idle
priority beside the test suite took three quarters of both cores from it). A session's own priority is its
autogroup's nice value, which this sets to the process's: its nice value, or the lowest (19) under ``SCHED_IDLE``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

LOWEST_NICE = 19
AUTOGROUP_RETRY_S = 0.1
"""Linux lets an unprivileged process change an autogroup's nice once per 100 ms machine-wide (``EAGAIN`` before):
ranks starting together take turns."""
AUTOGROUP_ATTEMPTS = 20


def autogroup_path(pid: int) -> Path:
    return Path(f"/proc/{pid}/autogroup")


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Set the nice value of ``pid``'s autogroup; False where the kernel has no autogroups or refuses."""
    for _ in range(AUTOGROUP_ATTEMPTS):
        try:
            autogroup_path(pid).write_text(f"{nice}\n")
            return True
        except BlockingIOError:
            time.sleep(AUTOGROUP_RETRY_S)
        except OSError:
            return False
    return False


def autogroup_nice(pid: int) -> int | None:
    """The nice value of ``pid``'s autogroup (``/autogroup-N nice K``); None without autogroups."""
    try:
        return int(autogroup_path(pid).read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def keep_launch_priority() -> None:
    """Give this process's session the priority this process was launched at, if it leads a session of its own
    (a no-op for a process in its launcher's session, whose priority already counts there)."""
    if os.getsid(0) != os.getpid():
        return
    nice = LOWEST_NICE if os.sched_getscheduler(0) == os.SCHED_IDLE else os.getpriority(os.PRIO_PROCESS, 0)
    if nice > 0:
        set_autogroup_nice(os.getpid(), nice)
