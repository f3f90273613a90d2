"""What a two-rank group started at idle priority (``chrt --idle 0 torchrun ...``) takes from a job beside it.

    python scripts/bench_launch_priority.py [--rounds 2] [--compare OTHER_CHECKOUT]

A single-threaded Python loop, timed alone and while a ``--tp-size 2`` group starts at idle priority, rounds
interleaved; with ``--compare`` the same beside a group running another checkout's code (before a change, say).
torchrun starts each rank in a session of its own; where Linux groups tasks by session (autogroups) only the rank's
``keep_launch_priority`` keeps the idle priority in force there. Prints the CPU and the slowdown per checkout.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu
from scheduler.testing.process import SchedulerProcess

REPO = Path(__file__).resolve().parent.parent
GROUP_FLAGS = ("--tp-size", "2", "--max-running-requests", "48", "--max-seq-len", "640")
LOOP_ITERATIONS = 60_000_000


def timed_loop() -> float:
    started = time.perf_counter()
    total = 0
    for i in range(LOOP_ITERATIONS):
        total += i * i
    return time.perf_counter() - started


def beside_group(root: Path) -> float:
    """The loop's time while a group running ``root``'s code starts at idle priority (stopped after)."""
    group = SchedulerProcess(*GROUP_FLAGS, ranks=2, root=root, idle_priority=True)
    try:
        time.sleep(0.2)  # the ranks are forked and importing
        return timed_loop()
    finally:
        group.stop()
        group.log_path.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compare", type=Path, help="another checkout, whose group is timed in turn with this one's")
    args = parser.parse_args()
    roots = {"this checkout": REPO} | ({str(args.compare): args.compare.resolve()} if args.compare else {})
    alone: list[float] = []
    beside: dict[str, list[float]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name, root in roots.items():
            alone.append(timed_loop())
            beside[name].append(beside_group(root))
    print(describe_cpu())
    base = statistics.median(alone)
    print(f"loop alone: median {base:.2f} s over {len(alone)} runs")
    for name, times in beside.items():
        median = statistics.median(times)
        print(f"beside an idle-priority group of {name}: median {median:.2f} s ({median / base:.2f}x alone)")


if __name__ == "__main__":
    main()
