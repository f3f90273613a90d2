"""The suite in two lanes, one pytest-xdist worker each: the tests that start servers and rank groups, and the grammar
backends' in-process tests beside them at the lowest CPU priority.

One process running every test left a core idle for about a quarter of the run (AMD EPYC Zen 5, 2 cores: 241 of
1,033 core-seconds), in the server tests' waits on their servers, clients and sleeps; the backend tests'
compiles and walks keep both cores busy. In a lane of their own at nice 19 they take what the other lane leaves.
Measured there from an empty cache (``scripts/profile_suite.py``): one process 524.2 and 518.9 s (792 and 782 s of
the machine's CPU, 1.53 cores); two lanes 456.6 s (891 s, 1.91 cores), the lanes' tests ending 2 s apart. The lanes
take more CPU (each worker's imports and fixtures, and two busy cores slow each other's tests), less than the idle
core gave. A lane's tests run in collection order on its worker, with the session fixtures, servers
started ahead (``tests/launch_ahead.py``) and preparations (``tests/prepare_ahead.py``) its own tests name; no
server is started in the background lane. A run whose paths hold one lane's tests (``pytest tests/unit``) runs
in one process, without the workers' start (~5 s of imports each); ``-n 0`` runs any selection so.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

from scheduler.session_priority import LOWEST_NICE
from sglang_constrained.cpu_priority import set_nice

FOREGROUND = "foreground"
BACKGROUND = "background"
BACKGROUND_PATHS = ("tests/backends/",)
"""Where the background lane's tests live: in-process, no server, CPU-bound."""
LANE_WORKERS = {FOREGROUND: "gw0", BACKGROUND: "gw1"}


def lane_of(nodeid: str) -> str:
    return BACKGROUND if nodeid.startswith(BACKGROUND_PATHS) else FOREGROUND


def lanes_under(args: Iterable[str], rootdir: Path) -> set[str]:
    """The lanes of the tests that a run's paths (pytest's positional arguments) can hold."""
    lanes = set()
    background = [(rootdir / path).resolve() for path in BACKGROUND_PATHS]
    for arg in args:
        path = (rootdir / arg.split("::")[0]).resolve()
        if any(path.is_relative_to(folder) for folder in background):
            lanes.add(BACKGROUND)
            continue
        lanes.add(FOREGROUND)
        if any(folder.is_relative_to(path) for folder in background):
            lanes.add(BACKGROUND)
    return lanes


def in_worker() -> bool:
    """Whether this process is a pytest-xdist worker (which runs one lane's tests)."""
    return "PYTEST_XDIST_WORKER" in os.environ


class LaneScheduling(LoadScopeScheduling):
    """Each lane to its worker (``LANE_WORKERS``) as one unit; a run with one lane gives it to the remaining worker."""

    def _split_scope(self, nodeid: str) -> str:
        return lane_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        own = next((lane for lane, worker in LANE_WORKERS.items() if worker == node.gateway.id), None)
        if own in self.workqueue:
            self.workqueue.move_to_end(own, last=False)
        super()._assign_work_unit(node)


def lower_priority() -> None:
    """Every thread of this process to the lowest nice (Linux keeps one per thread; threads and processes started
    later take their starter's)."""
    for thread in os.listdir("/proc/self/task"):
        set_nice(int(thread), LOWEST_NICE)
