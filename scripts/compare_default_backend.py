"""The default backend's question, side by side: a server with ``--grammar-backend auto`` and one with ``xgrammar``,
started alternately round by round, each measured for

- ready: seconds from starting the process to its first answer to a ping;
- memory idle: the process tree's proportional set size (scheduler, fork server, compile processes) once ready;
- first constrained request: seconds to the end of a greedy 16-token JSON-schema request sent right after ready
  (the compile included), then the same for a schema xgrammar refuses and llguidance compiles (auto's hand-over),
  and whether it was served or refused;
- memory after: the tree's PSS after those requests.

    python -m scripts.compare_default_backend [--rounds 3]

Medians over the rounds; the CPU model and the machine's CPU pressure are printed beside them (the machine may be
shared: compare the ratios).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import psutil

from cpu_kernels.cpu_info import describe_cpu
from scheduler.client import make_request
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.testing.benchmarking import cpu_pressure
from tests.helpers import PERSON_SCHEMA, PRODUCT_SCHEMA

BACKENDS = ("xgrammar", "auto")
FLAGS = ("--disable-grammar-disk-cache", "--max-seq-len", "512")
RATIOS = ("ready", "idle", "person", "after")


def tree_pss_mib(pid: int) -> float:
    """The proportional set size of ``pid`` and its descendants, in MiB (shared pages split among their users)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total / 2**20


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def measure(backend: str) -> dict[str, float]:
    start = time.perf_counter()
    server = SchedulerProcess("--grammar-backend", backend, *FLAGS)
    try:
        server.wait_until_ready()
        ready_s = time.perf_counter() - start
        time.sleep(1.0)
        idle_mib = tree_pss_mib(server.process.pid)
        with server.client() as client:

            def ask(schema: dict[str, Any]) -> bool:
                """Whether the request was served (not refused)."""
                params = {"json_schema": schema, "temperature": 0, "max_new_tokens": 16}
                [output] = client.generate_batch([make_request(text="JSON:", sampling_params=params)])
                return output.finish_reason is not None and output.finish_reason.type != "abort"

            person_s = timed(lambda: ask(PERSON_SCHEMA))
            start_product = time.perf_counter()
            product_served = ask(PRODUCT_SCHEMA)
            product_s = time.perf_counter() - start_product
        after_mib = tree_pss_mib(server.process.pid)
    finally:
        server.stop()
    return {
        "ready": ready_s,
        "idle": idle_mib,
        "person": person_s,
        "product": product_s,
        "served": float(product_served),
        "after": after_mib,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    print(f"CPU: {describe_cpu()}; CPU pressure {cpu_pressure():.2f}")
    results: dict[str, list[dict[str, float]]] = {backend: [] for backend in BACKENDS}
    for round_index in range(options.rounds):
        order = BACKENDS if round_index % 2 == 0 else BACKENDS[::-1]
        for backend in order:
            results[backend].append(measure(backend))
    columns = {
        "ready": "ready s",
        "idle": "PSS idle MiB",
        "person": "1st JSON s",
        "product": "xgr-refused schema s",
        "served": "served (1) or 400 (0)",
        "after": "PSS after MiB",
    }
    print(f"{'backend':10}" + "".join(f"{title:>24}" for title in columns.values()))
    medians = {b: {k: statistics.median(r[k] for r in results[b]) for k in columns} for b in BACKENDS}
    for backend in BACKENDS:
        print(f"{backend:10}" + "".join(f"{medians[backend][key]:>24.2f}" for key in columns))
    ratios = "".join(
        f"{medians['auto'][key] / medians['xgrammar'][key]:>24.2f}" if key in RATIOS else f"{'':>24}" for key in columns
    )
    print(f"{'auto/xgr':10}" + ratios)
    print(f"CPU pressure at the end {cpu_pressure():.2f}")


if __name__ == "__main__":
    main()
