"""Servers started ahead of the tests that use them: a start-up (the model's load and the server's set-up: ~2.5 s of
one core for a one-rank scheduler forked with its imports done, ``tests.helpers.PRELOADED_LAUNCHER``; ~8 s for a rank
group under torchrun, whose ranks import their own) then runs beside the tests before it instead of in front of its own.

A test, or a module for its module-scoped server, names what it launches with ``@pytest.mark.launches(...)`` (the flags
after the test flags, ``ranks``, ``extra_paths``, ``http=True`` for ``HttpServer``, ``warm_grammars=True`` for a
scheduler that keeps the grammar disk cache, ``count`` when it starts several alike); a session or package fixture that
launches is named where ``tests/helpers.py`` makes ``LAUNCH_AHEAD``. Before each test, ``LaunchAhead.look_ahead`` starts
the next launches the session's tests name, however far ahead (the first ones wait through the in-process tests before
them, whose walks and compiles leave a core idle), while fewer than ``MAX_WAITING`` have not been taken. They start at
idle priority (``SCHED_IDLE``: a core only when no test wants it; a rank group's ranks, each in a session of its own,
put their sessions at the lowest nice: ``scheduler.session_priority``) and get the normal one back when taken.
``launch_scheduler`` and ``http_server`` (``take_or_start``) take a started server with the same command line, or start
their own: a wrong or missing mark costs time, never a check.
What was started for tests that did not take it (a test that failed first, one skipped) is stopped once they have
passed, the rest at the session's end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from scheduler.testing.process import SchedulerProcess, can_leave_idle_priority

MAX_WAITING = 6
"""Launches started and not yet taken, once a test has taken one or while the tests leave a core idle
(``IDLE_CORES_TO_START``): each holds a model's memory."""
MAX_WAITING_BEFORE = 2
"""Launches waiting while no test has taken one yet and the tests keep every core busy (more starts beside the
in-process tests at the session's start slowed them more than they saved later), and at any time where a launch
cannot be started at idle priority (then each start takes a core from the tests)."""
IDLE_CORES_TO_START = 0.5
"""Cores left idle since the last look (over ``IDLE_WINDOW_S`` at least) that let launches start up to ``MAX_WAITING``
before any test has taken one: the in-process tests on a large vocabulary walk on one core for minutes."""
IDLE_WINDOW_S = 2.0


class IdleCores:
    """How many cores the machine left idle over the last window of at least ``IDLE_WINDOW_S``. Idle-priority
    launches count as busy: one look that finds a core idle starts up to ``MAX_WAITING`` at once, and no look
    starts more until those have finished starting."""

    def __init__(self) -> None:
        self._since = (time.monotonic(), psutil.cpu_times())
        self.last = 0.0

    def update(self) -> float:
        now, times = time.monotonic(), psutil.cpu_times()
        then, before = self._since
        if now - then >= IDLE_WINDOW_S:
            idle = (times.idle + times.iowait) - (before.idle + before.iowait)
            self.last = idle / (now - then)
            self._since = (now, times)
        return self.last


@dataclass(frozen=True)
class Launch:
    """One server's command line, as ``launch_scheduler`` or ``http_server`` builds it."""

    flags: tuple[str, ...]
    ranks: int = 1
    extra_paths: tuple[Path, ...] = ()
    http: bool = False
    warm_grammars: bool = False


def launch_of(mark: pytest.Mark) -> tuple[Launch, int]:
    """What a ``launches`` mark names, and how many alike."""
    launch = Launch(
        tuple(mark.args),
        mark.kwargs.get("ranks", 1),
        tuple(mark.kwargs.get("extra_paths", ())),
        mark.kwargs.get("http", False),
        mark.kwargs.get("warm_grammars", False),
    )
    return launch, mark.kwargs.get("count", 1)


@dataclass
class _Started:
    launch: Launch
    process: SchedulerProcess
    owner_ends_at: int
    group: int


class LaunchAhead:
    """The servers started ahead, and which tests' launches have been seen."""

    def __init__(self, start: Callable[[Launch, bool], SchedulerProcess], fixture_launches: dict[str, Launch]) -> None:
        self._start = start
        self._idle_priority: bool | None = None
        self._taken_any = False
        self._idle_cores = IdleCores()
        self._fixture_launches = fixture_launches
        self._waiting: list[_Started] = []
        self._seen: set[tuple[str, Launch]] = set()
        self._position: dict[str, int] = {}
        self._planned: list[tuple[int, int, str, Launch, int]] = []

    def plan(self, items: list[pytest.Item]) -> None:
        """The session's tests, in the order they run: each launch's owner, first and last test."""
        self._position = {item.nodeid: position for position, item in enumerate(items)}
        spans: dict[tuple[str, Launch], list[int]] = {}
        counts: dict[tuple[str, Launch], int] = {}
        for position, item in enumerate(items):
            for owner, launch, count in self._launches(item):
                spans.setdefault((owner, launch), [position, position])[1] = position
                counts[owner, launch] = count
        planned = [(first, last, *key, counts[key]) for key, (first, last) in spans.items()]
        self._planned = sorted(planned, key=lambda launch: launch[:3])

    def look_ahead(self, item: pytest.Item) -> None:
        """Stop what was started for tests that have passed without taking it; mark the launches of ``item`` and
        of the tests before it seen (a test starts its own if none waits); start the next ones while fewer than
        ``MAX_WAITING`` launches wait."""
        position = self._position.get(item.nodeid)
        if position is None:
            return
        for started in [started for started in self._waiting if started.owner_ends_at < position]:
            self._waiting.remove(started)
            _discard(started.process)
        for first, last, owner, launch, count in self._planned:
            if (owner, launch) in self._seen:
                continue
            if first > position:
                if self._idle_priority is None:
                    self._idle_priority = can_leave_idle_priority()
                busy = not self._taken_any and self._idle_cores.update() < IDLE_CORES_TO_START
                max_waiting = MAX_WAITING if self._idle_priority and not busy else MAX_WAITING_BEFORE
                if len({started.group for started in self._waiting}) >= max_waiting:
                    return
                self._waiting += [
                    _Started(launch, self._start(launch, self._idle_priority), last, first) for _ in range(count)
                ]
            self._seen.add((owner, launch))

    def take_or_start(self, launch: Launch) -> SchedulerProcess:
        """A server started ahead with this command line, else one started now. One that has exited meanwhile is
        taken too: its start-up failed as the test's own would have (or as the test expects), and its log says why."""
        self._taken_any = True
        for started in self._waiting:
            if started.launch == launch:
                self._waiting.remove(started)
                if self._idle_priority:
                    started.process.leave_idle_priority()
                return started.process
        return self._start(launch, False)

    def stop_all(self) -> None:
        for started in self._waiting:
            _discard(started.process)
        self._waiting.clear()

    def _launches(self, item: pytest.Item) -> list[tuple[str, Launch, int]]:
        """``(owner, launch, count)`` per launch ``item`` makes: the owner is the node its mark is on, or the
        fixture."""
        found = [(node.nodeid, *launch_of(mark)) for node, mark in item.iter_markers_with_node("launches")]
        for name in getattr(item, "fixturenames", ()):
            if name in self._fixture_launches:
                found.append((f"fixture {name}", self._fixture_launches[name], 1))
        return found


def _discard(process: SchedulerProcess) -> None:
    with contextlib.suppress(TimeoutError):  # killed then: nothing was asked of it
        process.stop()
    process.log_path.unlink(missing_ok=True)
