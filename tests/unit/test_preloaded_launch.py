"""The session's one-rank schedulers are forked from a process with their imports done
(``scheduler.testing.preloaded``): what their owners see of them must be what the command gives.

Every server test runs on such a scheduler; the command itself still starts the rank groups (torchrun), the servers
of ``test_servers_by_http_port`` and ``test_multirank``'s comparisons of torchrun's ranks with a forked scheduler.
These tests share the session's preloaded process; one starts a scheduler and kills it once it has started its threads.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest

from scheduler.testing.preloaded import ForkedScheduler
from scheduler.testing.process import SchedulerProcess, can_leave_idle_priority
from tests.helpers import MODEL, PRELOADED_LAUNCHER


def test_a_refused_flag_exits_with_argparses_code_and_message_in_the_log() -> None:
    launched = SchedulerProcess("--no-such-flag", launcher=PRELOADED_LAUNCHER)
    try:
        assert isinstance(launched.process, ForkedScheduler)
        assert launched.process.wait(timeout=120) == 2
        assert "python -m scheduler.launch: error: unrecognized arguments: --no-such-flag" in launched.log()
    finally:
        launched.log_path.unlink(missing_ok=True)


def test_a_killed_scheduler_reports_the_signal_as_popen_does() -> None:
    launched = SchedulerProcess(launcher=PRELOADED_LAUNCHER)
    try:
        assert launched.process.poll() is None
        launched.process.send_signal(signal.SIGKILL)
        assert launched.process.wait(timeout=120) == -signal.SIGKILL
        assert launched.process.poll() == -signal.SIGKILL
    finally:
        launched.log_path.unlink(missing_ok=True)


def test_a_launch_with_an_environment_of_its_own_starts_the_command() -> None:
    """A variable read at import time (OpenMP's thread count) would not reach a fork: the command starts instead."""
    launched = SchedulerProcess("--no-such-flag", env={"OMP_NUM_THREADS": "1"}, launcher=PRELOADED_LAUNCHER)
    try:
        assert isinstance(launched.process, subprocess.Popen)
        assert launched.process.wait(timeout=120) == 2
    finally:
        launched.log_path.unlink(missing_ok=True)


def test_an_idle_launch_is_idle_once_its_pid_is_known_and_stays_normal_once_given_back() -> None:
    """The preloaded process sets an idle launch's policy before it answers the pid. Set by the child itself, it
    could come after the owner had given the launch the normal policy back (``leave_idle_priority``, as soon as a
    test takes a server started ahead), and the server ran idle for good: seen on a busy machine."""
    if not can_leave_idle_priority():
        pytest.skip("this process cannot give a child the normal policy back (chrt or CAP_SYS_NICE missing)")
    launched = SchedulerProcess(idle_priority=True, launcher=PRELOADED_LAUNCHER)
    try:
        assert isinstance(launched.process, ForkedScheduler)
        assert os.sched_getscheduler(launched.process.pid) == os.SCHED_IDLE
        launched.leave_idle_priority()
        process = psutil.Process(launched.process.pid)
        deadline = time.monotonic() + 120
        while process.num_threads() == 1 and time.monotonic() < deadline:  # until its start has run on
            time.sleep(0.05)
        assert process.num_threads() > 1
        assert {os.sched_getscheduler(thread.id) for thread in process.threads()} == {os.SCHED_OTHER}
    finally:
        launched.process.send_signal(signal.SIGKILL)
        launched.process.wait(timeout=120)
        launched.log_path.unlink(missing_ok=True)


def test_the_sessions_one_rank_server_is_forked(one_rank_server: SchedulerProcess) -> None:
    """It was started for another test, under another ``PYTEST_CURRENT_TEST``: a variable per launch, not a reason to
    start the command."""
    assert isinstance(one_rank_server.process, ForkedScheduler)
    assert one_rank_server.status().model == MODEL
