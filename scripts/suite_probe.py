"""A pytest plugin for ``scripts/profile_suite.py``: per test, its wall time and the machine's busy CPU meanwhile.

Busy CPU is the whole machine's (psutil's ``cpu_times``, outside idle and I/O wait): the tests' servers, compile
processes and anything started in the background count, so that a test's ratio of CPU to wall says how many cores
were busy while it ran (the suite's two lanes run side by side: ``tests/lanes.py``). Written as tab-separated lines
(node id, wall s, busy CPU s) to ``$SUITE_PROBE_OUT/<worker>.tsv``, a file per pytest-xdist worker (``main.tsv``
where the tests run in one process).
"""

from __future__ import annotations

import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO

import pytest

from sglang_constrained.testing.machine_load import busy_cpu_seconds

_out: IO[str] | None = None


def _opened() -> IO[str]:
    global _out
    if _out is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _out = open(Path(os.environ["SUITE_PROBE_OUT"]) / f"{worker}.tsv", "w")  # noqa: SIM115 (closed at the end)
    return _out


def pytest_unconfigure(config: pytest.Config) -> None:
    if _out is not None:
        _out.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    started, busy = time.monotonic(), busy_cpu_seconds()
    yield
    out = _opened()
    out.write(f"{item.nodeid}\t{time.monotonic() - started:.3f}\t{busy_cpu_seconds() - busy:.3f}\n")
    out.flush()
