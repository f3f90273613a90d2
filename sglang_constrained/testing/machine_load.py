"""How busy the whole machine has been: what the suite's profile (``scripts/profile_suite.py`` and its per-test probe,
``scripts/suite_probe.py``) counts, so that a run's and a test's figures add up the same way."""

from __future__ import annotations

import psutil


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent outside idle and I/O wait since boot (every process's)."""
    times = psutil.cpu_times()
    return times.user + times.nice + times.system + times.irq + times.softirq + times.steal
