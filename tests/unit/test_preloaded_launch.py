"""The session's one-rank schedulers are forked from a process with their imports done
(``scheduler.testing.preloaded``): what their owners see of them must be what the command gives.

Every server test runs on such a scheduler; the command itself still starts the rank groups (torchrun), the servers
of ``test_servers_by_http_port`` and ``test_multirank``'s comparisons of torchrun's ranks with a forked scheduler.
These tests share the session's preloaded process and start no model.
"""

from __future__ import annotations

import signal
import subprocess

from scheduler.testing.preloaded import ForkedScheduler
from scheduler.testing.process import SchedulerProcess
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


def test_the_sessions_one_rank_server_is_forked(one_rank_server: SchedulerProcess) -> None:
    """It was started for another test, under another ``PYTEST_CURRENT_TEST``: a variable per launch, not a reason to
    start the command."""
    assert isinstance(one_rank_server.process, ForkedScheduler)
    assert one_rank_server.status().model == MODEL
