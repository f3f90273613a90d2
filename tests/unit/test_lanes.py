"""The suite's two lanes (``tests/lanes.py``): which lanes a run's paths hold, the background lane's priority, and
the fork server the session starts before any test, whose children find the engine imported."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_constrained.compile.processes import why_processes_cannot_start
from tests.lanes import BACKGROUND, FOREGROUND, lanes_under

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "lanes"),
    [
        (["tests/unit"], {FOREGROUND}),
        (["tests/unit/test_lanes.py::test_x"], {FOREGROUND}),
        (["tests/backends"], {BACKGROUND}),
        (["tests/backends/xgrammar/test_x.py::test_y"], {BACKGROUND}),
        (["tests"], {FOREGROUND, BACKGROUND}),
        ([], set()),
        (["."], {FOREGROUND, BACKGROUND}),
        (["tests/unit", "tests/backends"], {FOREGROUND, BACKGROUND}),
    ],
)
def test_a_runs_paths_give_the_lanes_of_the_tests_they_can_hold(args: list[str], lanes: set[str]) -> None:
    assert lanes_under(args, REPO) == lanes


THREAD_NICES_AFTER_LOWERING = """
import json, os, threading
from tests.lanes import lower_priority
started = threading.Event()
done = threading.Event()
early = threading.Thread(target=lambda: (started.set(), done.wait()))
early.start()
started.wait()
lower_priority()
late = threading.Thread(target=done.wait)
late.start()
nices = [os.getpriority(os.PRIO_PROCESS, int(thread)) for thread in os.listdir("/proc/self/task")]
done.set()
print(json.dumps(nices))
"""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's per-thread /proc entries")
def test_the_background_lane_runs_every_thread_at_the_lowest_priority() -> None:
    """Threads started before the lane took its priority (the engines' pools) and after it both run at nice 19."""
    completed = subprocess.run(
        [sys.executable, "-c", THREAD_NICES_AFTER_LOWERING], cwd=REPO, capture_output=True, text=True, check=True
    )
    nices = json.loads(completed.stdout)
    assert len(nices) == 3
    assert set(nices) == {19}


def engine_imported() -> bool:
    return "xgrammar" in sys.modules and "torch" in sys.modules


@pytest.mark.skipif(why_processes_cannot_start() is not None, reason="processes cannot start here")
def test_a_fork_server_child_of_a_test_finds_the_engine_imported() -> None:
    """The session starts the fork server with xgrammar (and torch) preloaded before any test (``tests/conftest.py``):
    a test that starts the first fork-server process itself (torch's ``start_processes``) must not make every later
    compile process import the engine again."""
    with multiprocessing.get_context("forkserver").Pool(1) as pool:
        assert pool.apply(engine_imported)
