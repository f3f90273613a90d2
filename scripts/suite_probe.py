"""A pytest plugin for ``scripts/profile_suite.py``: per test, its wall time and the machine's busy CPU meanwhile.

Busy CPU is the whole machine's (psutil's ``cpu_times``, outside idle and I/O wait): the tests' servers, compile
processes and anything started in the background count, so that a test's ratio of CPU to wall says how many cores
were busy while it ran. Written as tab-separated lines (node id, wall s, busy CPU s) to the file
``$SUITE_PROBE_OUT``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from typing import IO

import psutil
import pytest

_out: IO[str] | None = None


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent outside idle and I/O wait since boot."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq + times.steal


def pytest_configure(config: pytest.Config) -> None:
    global _out
    _out = open(os.environ["SUITE_PROBE_OUT"], "w")  # noqa: SIM115 (kept open for the session, closed at its end)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _out is not None:
        _out.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    started, busy = time.monotonic(), busy_cpu_seconds()
    yield
    assert _out is not None
    _out.write(f"{item.nodeid}\t{time.monotonic() - started:.3f}\t{busy_cpu_seconds() - busy:.3f}\n")
    _out.flush()
