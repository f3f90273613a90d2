"""A real scheduler process for a test, which must also stop cleanly when the test is done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from scheduler.process import SchedulerProcess

TEST_SERVER_FLAGS = ("--max-running-requests", "48", "--max-seq-len", "640")
"""Enough slots for the concurrency tests, a KV cache small enough to start in seconds."""


@contextlib.contextmanager
def launch_scheduler(
    *flags: str, ranks: int = 1, extra_paths: tuple[Path, ...] = (), check_clean_stop: bool = True
) -> Iterator[SchedulerProcess]:
    """A scheduler with the test flags; on exit it gets SIGTERM and (unless the test stopped it otherwise) every
    rank must have stopped cleanly: exit code 0, or under torchrun each rank's own "stopped" line."""
    launched = SchedulerProcess(*TEST_SERVER_FLAGS, *flags, ranks=ranks, extra_paths=extra_paths)
    try:
        launched.wait_until_ready()
        yield launched
    finally:
        exit_code = launched.stop()
        log = launched.log()
        if check_clean_stop and ranks == 1:
            assert exit_code == 0, f"the scheduler exited with {exit_code}; log:\n{log[-3000:]}"
        elif check_clean_stop:  # torchrun reports the SIGTERM it got; what matters is each rank's clean stop
            for rank in range(ranks):
                assert f"[rank {rank}] scheduler.launch: stopped" in log, f"rank {rank} did not stop:\n{log[-3000:]}"
        launched.log_path.unlink(missing_ok=True)
