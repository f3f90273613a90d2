"""A process leading a session of its own (as torchrun starts each rank) keeps the priority it was launched at:
its session's autogroup takes its nice value, or the lowest under ``SCHED_IDLE``, so that it does not take a whole
session's share of the CPU from the session that launched it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.session_priority import LOWEST_NICE, autogroup_nice

pytestmark = pytest.mark.skipif(not Path("/proc/self/autogroup").exists(), reason="this kernel has no autogroups")

REPORT_AUTOGROUP_NICE = (
    "from scheduler.session_priority import autogroup_nice, keep_launch_priority\n"
    "import json, os\n"
    "keep_launch_priority()\n"
    "print(json.dumps(autogroup_nice(os.getpid())))\n"
)


def autogroup_nice_of_child(prefix: list[str], new_session: bool) -> int | None:
    completed = subprocess.run(
        [*prefix, sys.executable, "-c", REPORT_AUTOGROUP_NICE],
        start_new_session=new_session,
        capture_output=True,
        text=True,
        check=True,
    )
    nice: int | None = json.loads(completed.stdout)
    return nice


@pytest.mark.skipif(shutil.which("chrt") is None, reason="needs chrt (util-linux)")
def test_a_session_leader_started_at_idle_priority_puts_its_session_at_the_lowest_nice() -> None:
    assert autogroup_nice_of_child(["chrt", "--idle", "0"], new_session=True) == LOWEST_NICE


def test_a_session_leader_started_niced_gives_its_session_its_nice() -> None:
    assert autogroup_nice_of_child(["nice", "-n", "7"], new_session=True) == 7


def test_a_process_in_its_launchers_session_leaves_that_session_alone() -> None:
    """Also where the launcher's session is in the kernel's default group (no autogroup of its own, an empty
    ``/proc/PID/autogroup``), as for a session that has never called ``setsid`` since boot."""
    before = Path("/proc/self/autogroup").read_text()
    assert autogroup_nice_of_child(["nice", "-n", "7"], new_session=False) == autogroup_nice(os.getpid())
    assert Path("/proc/self/autogroup").read_text() == before
