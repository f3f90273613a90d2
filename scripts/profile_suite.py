"""The README's test command timed as CI runs it, and where its time and CPU go.

    python scripts/profile_suite.py [--warm] [--out DIR] [-- extra pytest arguments]

By default the cache (``SGLANG_CONSTRAINED_CACHE_DIR``) starts empty, as on a new machine and in ``.ci/run``: the
model's conversion, the tokenizers' and the narrower kernels' builds happen during the run; only the native kernels
are built first, as ``scripts/setup.sh`` does. ``--warm`` keeps this machine's cache, which hides that work (runs
of one commit's tests measured 470.9 s and 472.6 s warm, 491-551 s cold here, 2026-11-26): the budget is for the
cold run.

Prints the CPU, pytest's summary and slowest tests, the run's wall time with the machine's busy CPU and the cores
that kept busy, and per lane (``tests/lanes.py``: a pytest-xdist worker each, side by side) and package its wall
time and the machine's busy CPU meanwhile (every process's, both lanes': ``scripts/suite_probe.py``). The per-test
figures stay in ``DIR/tests/<worker>.tsv``, pytest's output in ``DIR/pytest.txt``. The machine may be shared:
compare runs of two commits one after the other, more than once.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu
from sglang_constrained.testing.machine_load import busy_cpu_seconds

REPO = Path(__file__).resolve().parent.parent
BUILD_NATIVE_KERNELS = (
    "from scheduler.server_args import ModelArgs; from cpu_kernels import library; "
    "library.load(ModelArgs().kernel_build_path)"
)
"""What ``scripts/setup.sh`` runs before the tests."""


def package_table(rows: list[tuple[str, float, float]]) -> list[str]:
    """Per package (``tests/<package>/...``) and in total: wall s, busy CPU s, cores busy."""
    wall: dict[str, float] = defaultdict(float)
    cpu: dict[str, float] = defaultdict(float)
    for node_id, seconds, busy in rows:
        parts = node_id.split("::")[0].split("/")
        package = parts[1] if len(parts) > 2 else parts[0]
        wall[package] += seconds
        cpu[package] += busy
    totals = [(package, wall[package], cpu[package]) for package in sorted(wall, key=lambda name: -wall[name])]
    totals.append(("all", sum(wall.values()), sum(cpu.values())))
    lines = [f"{'package':<14}{'wall s':>9}{'CPU s':>9}{'cores':>7}"]
    for name, seconds, busy in totals:
        lines.append(f"{name:<14}{seconds:9.1f}{busy:9.1f}{busy / max(seconds, 1e-9):7.2f}")
    return lines


def read_rows(path: Path) -> list[tuple[str, float, float]]:
    rows = []
    for line in path.read_text().splitlines():
        node_id, wall, busy = line.split("\t")
        rows.append((node_id, float(wall), float(busy)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", action="store_true", help="keep this machine's cache instead of an empty one")
    parser.add_argument("--out", type=Path, help="where the figures go (default: a new temporary folder)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="suite-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "tests").mkdir(exist_ok=True)
    environment = {**os.environ, "SUITE_PROBE_OUT": str(out / "tests")}
    if not args.warm:
        cache = out / "cache"
        cache.mkdir(exist_ok=True)
        environment["SGLANG_CONSTRAINED_CACHE_DIR"] = str(cache)
        subprocess.run([sys.executable, "-c", BUILD_NATIVE_KERNELS], env=environment, cwd=REPO, check=True)
    print(f"CPU: {describe_cpu()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start")
    print(f"cache: {'this machine' if args.warm else 'empty (as CI)'}; figures in {out}")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "scripts.suite_probe", "--durations=25", *args.pytest_args]
    started, busy = time.monotonic(), busy_cpu_seconds()
    with open(out / "pytest.txt", "w") as log:
        finished = subprocess.run(command, env=environment, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wall, busy = time.monotonic() - started, busy_cpu_seconds() - busy
    output = (out / "pytest.txt").read_text().splitlines()
    durations = next((i for i, line in enumerate(output) if "slowest" in line and "durations" in line), None)
    if durations is not None:
        print("\n".join(output[durations:-1][:27]))
    print(output[-1] if output else "pytest printed nothing")
    print(f"the run: {wall:.1f} s, the machine's busy CPU {busy:.1f} s, {busy / wall:.2f} cores")
    for lane in sorted((out / "tests").glob("*.tsv")):
        print(f"lane {lane.stem}:")
        print("\n".join(package_table(read_rows(lane))))
    return finished.returncode


if __name__ == "__main__":
    sys.exit(main())
