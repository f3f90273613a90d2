"""Start-up of ``python -m scheduler.launch`` with a warm cache (or a new machine's first), side by side with another
checkout.

    python scripts/bench_startup.py [--rounds 3] [--compare ../other-checkout] [--ranks 2] [--first-start]
                                    [-- extra launcher flags]

Each round starts the scheduler of this checkout (and of ``--compare``'s, alternating which goes first), one at a
time (with ``--ranks 2``, under torchrun), and measures:

- ready: seconds from starting the process to its first answer to a ping (what a user restarting a server, and
  each test that starts one, waits for);
- CPU at ready: CPU seconds the process tree (scheduler, fork server, compile processes) used until then;
- first request: seconds from sending a JSON-schema request (greedy, 8 new tokens) right after ready to its first
  streamed token and to its end: a start-up that defers work must not move it into the first request;
- CPU settled: CPU seconds of the tree once it has been idle for a second after that request (work moved to the
  background still counts).

Phases come from the log's timestamps: the loader's, the model runner's and the scheduler's ready line. The machine
may be shared: the load average and CPU pressure are printed beside the figures; compare the ratios.

``--first-start``: each start in a cache of its own (``SGLANG_CONSTRAINED_CACHE_DIR``) holding only this machine's
kernel builds, as after the README's set-up: the tokenizer's and the model's conversions are timed with the rest.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from cpu_kernels.cpu_info import describe_cpu
from scheduler.server_args import ModelArgs
from scheduler.testing.process import REPO_ROOT, SchedulerProcess
from sglang_constrained.testing.benchmarking import cpu_pressure

SERVER_FLAGS = ("--max-running-requests", "48", "--max-seq-len", "640")
"""The test suite's flags (``tests.helpers.TEST_SERVER_FLAGS``): what its twenty-odd starts pay."""
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}}, "required": ["answer"]}
PHASES = {
    "loaded": r"scheduler\.model\.loader: loaded",
    "runner": r"scheduler\.model\.runner: model runner",
    "ready": r"scheduler\.scheduler: scheduler ready",
}
IDLE_CPU_SHARE = 0.05
"""Below this share of one core over a second, the tree counts as settled."""


@dataclass(frozen=True)
class StartUp:
    ready_s: float
    cpu_at_ready_s: float
    first_token_s: float
    first_request_s: float
    cpu_settled_s: float
    phases: dict[str, float]


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of ``pid`` and its live descendants (and the children they have reaped)."""
    total = 0.0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def wait_until_idle(pid: int, timeout_s: float = 120.0) -> float:
    """The tree's CPU seconds once a second passes with less than ``IDLE_CPU_SHARE`` of a core used."""
    deadline = time.monotonic() + timeout_s
    before = tree_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = tree_cpu_seconds(pid)
        if now - before < IDLE_CPU_SHARE:
            return now
        before = now
    return before


def log_phases(log: str, started: float) -> dict[str, float]:
    """Seconds from ``started`` (a wall-clock time) to each phase's log line."""
    phases = {}
    for name, pattern in PHASES.items():
        match = re.search(rf"^(\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d{{3}}) \S+ (?:\[rank 0\] )?{pattern}", log, re.M)
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            phases[name] = stamp - started
    return phases


def start_once(root: Path, flags: tuple[str, ...], ranks: int, first_start: bool) -> StartUp:
    if not first_start:
        return _start_once(root, flags, ranks, {})
    with tempfile.TemporaryDirectory() as cache:
        kernels = ModelArgs().kernel_build_path
        shutil.copytree(kernels, Path(cache) / kernels.name, symlinks=True)
        return _start_once(root, flags, ranks, {"SGLANG_CONSTRAINED_CACHE_DIR": cache})


def _start_once(root: Path, flags: tuple[str, ...], ranks: int, env: dict[str, str]) -> StartUp:
    started_wall, started = time.time(), time.perf_counter()
    server = SchedulerProcess(*SERVER_FLAGS, *flags, ranks=ranks, root=root, env=env)
    try:
        server.wait_until_ready()
        ready_s = time.perf_counter() - started
        cpu_at_ready = tree_cpu_seconds(server.process.pid)
        sent = time.perf_counter()
        first_token_s = 0.0
        with server.client() as client:
            chunks = client.generate_stream(
                messages=[{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
                sampling_params={"temperature": 0, "max_new_tokens": 8, "json_schema": SCHEMA},
            )
            for chunk in chunks:
                if chunk.finish_reason is not None and chunk.finish_reason.type == "abort":
                    raise RuntimeError(f"the request failed: {chunk.finish_reason.message}")
                if chunk.token_ids and not first_token_s:
                    first_token_s = time.perf_counter() - sent
        first_request_s = time.perf_counter() - sent
        cpu_settled = wait_until_idle(server.process.pid)
        phases = log_phases(server.log(), started_wall)
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
    return StartUp(ready_s, cpu_at_ready, first_token_s, first_request_s, cpu_settled, phases)


def summary(runs: list[StartUp]) -> dict[str, float]:
    values = {
        "ready": [r.ready_s for r in runs],
        "CPU at ready": [r.cpu_at_ready_s for r in runs],
        "first token": [r.first_token_s for r in runs],
        "first request": [r.first_request_s for r in runs],
        "CPU settled": [r.cpu_settled_s for r in runs],
    }
    for phase in PHASES:
        values[f"log: {phase}"] = [r.phases[phase] for r in runs if phase in r.phases]
    return {name: statistics.median(v) for name, v in values.items() if v}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", type=Path, help="another checkout (the baseline), started alternately")
    parser.add_argument("--ranks", type=int, default=1, help="ranks under torchrun (1: the launcher alone)")
    parser.add_argument("--first-start", action="store_true", help="each start in a new cache (kernels built)")
    parser.add_argument("flags", nargs="*", help="extra launcher flags (after --)")
    args = parser.parse_args(argv)
    roots = {"this": REPO_ROOT} | ({"baseline": args.compare.resolve()} if args.compare else {})
    print(
        f"CPU: {describe_cpu()}, {os.cpu_count()} cores; {args.ranks} rank(s), flags {list(args.flags)}; "
        f"{'first starts' if args.first_start else 'warm cache'}; load average {os.getloadavg()[0]:.1f}"
    )
    runs: dict[str, list[StartUp]] = {name: [] for name in roots}
    for round_index in range(args.rounds):
        order = list(roots) if round_index % 2 == 0 else list(reversed(roots))
        for name in order:
            run = start_once(roots[name], tuple(args.flags), args.ranks, args.first_start)
            runs[name].append(run)
            print(
                f"round {round_index + 1} {name}: ready {run.ready_s:.1f} s (CPU {run.cpu_at_ready_s:.1f} s), first "
                f"token {run.first_token_s:.2f} s, request {run.first_request_s:.2f} s, CPU settled "
                f"{run.cpu_settled_s:.1f} s; log {', '.join(f'{k} {v:.1f}' for k, v in run.phases.items())}; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    medians = {name: summary(r) for name, r in runs.items()}
    print(
        f"medians of {args.rounds} rounds, seconds (load average {os.getloadavg()[0]:.1f}, CPU pressure "
        f"{cpu_pressure()}):"
    )
    for metric in medians["this"]:
        line = f"  {metric:14s} this {medians['this'][metric]:6.2f}"
        if "baseline" in medians and metric in medians["baseline"]:
            base = medians["baseline"][metric]
            line += f"  baseline {base:6.2f}  this/baseline {medians['this'][metric] / base:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
