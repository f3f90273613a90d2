"""Data parallel against threads on the same cores: ``--dp-size 2`` (two replicas of one torch thread each, under
torchrun) and one rank with two torch threads, on JSON-schema requests, side by side in one run.

Starts both schedulers (zmq only), warms each up (the schema compiled, every path run once), then runs ``--rounds``
rounds, the two in alternating order, each time ``--waves`` x ``--concurrency`` JSON-schema requests with
``--concurrency`` in flight (``scripts.serving_workload``'s requests and summary). Prints each one's aggregate output
tokens/s (all output tokens over all wall time), their ratio, how the replicas split the requests, and the grammar
compiles per distinct constraint behind the replicas (target 1: compiled once for both, not once per replica).

    python -m scripts.bench_dp [--concurrency 16] [--rounds 3] [--waves 2] [--max-new-tokens 72] [--backend xgrammar]
"""

from __future__ import annotations

import argparse
import asyncio
import re
from typing import Any

from scheduler.client import AsyncSchedulerClient
from scheduler.io_struct import Pong
from scheduler.testing.process import SchedulerProcess
from scripts.serving_workload import WARM_UP_INDEX, WARM_UP_TOKENS, Outcome, format_row, run_kind, run_one, summarise

KIND = "json"
DP_LABEL = "dp=2 x 1 thread"
THREADS_LABEL = "dp=1 x 2 threads"


def run_dp_benchmark(
    concurrency: int = 16,
    rounds: int = 3,
    waves: int = 2,
    max_new_tokens: int = 72,
    backend: str = "xgrammar",
    temperature: float = 0.7,
) -> list[str]:
    """Launch both configurations, run the rounds, stop them; returns the printed lines."""
    flags = ("--grammar-backend", backend, "--max-running-requests", str(concurrency), "--log-level", "warning")
    servers = {
        DP_LABEL: SchedulerProcess(*flags, "--dp-size", "2", ranks=2, env={"OMP_NUM_THREADS": "1"}),
        THREADS_LABEL: SchedulerProcess(*flags, env={"OMP_NUM_THREADS": "2"}),
    }
    try:
        for server in servers.values():
            server.wait_until_ready()
        endpoints = {label: server.endpoint for label, server in servers.items()}
        return asyncio.run(_bench(endpoints, concurrency, rounds, waves * concurrency, max_new_tokens, temperature))
    finally:
        for server in servers.values():
            server.stop()
            server.log_path.unlink(missing_ok=True)


async def _bench(
    endpoints: dict[str, str],
    concurrency: int,
    rounds: int,
    num_requests: int,
    max_new_tokens: int,
    temperature: float,
) -> list[str]:
    clients = {label: AsyncSchedulerClient(endpoint) for label, endpoint in endpoints.items()}
    try:
        for client in clients.values():
            await client.wait_until_ready(timeout_s=600)
            await run_one(
                client, KIND, WARM_UP_INDEX, WARM_UP_TOKENS
            )  # compile and cache the schema, warm every path once
        before = await clients[DP_LABEL].wait_until_ready()
        collected: dict[str, tuple[list[Outcome], float]] = {label: ([], 0.0) for label in clients}
        for round_index in range(rounds):
            order = list(clients) if round_index % 2 == 0 else list(clients)[::-1]
            indices = range(round_index * num_requests, (round_index + 1) * num_requests)  # the same on both
            for label in order:
                client = clients[label]
                outcomes, wall_s = await run_kind(client, KIND, concurrency, indices, max_new_tokens, temperature)
                previous, previous_s = collected[label]
                collected[label] = (previous + outcomes, previous_s + wall_s)
        after = await clients[DP_LABEL].wait_until_ready()
    finally:
        for client in clients.values():
            await client.close()
    rows = {label: summarise(KIND, *collected[label]) for label in clients}
    lines = [format_row(concurrency, rows[label], label) for label in clients]
    ratio = rows[DP_LABEL]["output_tokens_per_s"] / rows[THREADS_LABEL]["output_tokens_per_s"]
    lines.append(f"ratio {DP_LABEL} / {THREADS_LABEL} at C={concurrency}: aggregate output tok/s {ratio:.3f}")
    served = [
        a.num_finished_requests - b.num_finished_requests for a, b in zip(after.replicas, before.replicas, strict=True)
    ]
    lines.append(f"{DP_LABEL}: requests served per replica {served}")
    compiles, constraints = _shared_compiles(after)
    per_constraint = compiles / constraints if constraints else float("nan")
    verdict = "ok" if per_constraint == 1 else "MISS (target 1)"
    lines.append(
        f"{DP_LABEL}: grammar compiles per distinct constraint {per_constraint:.2f} ({verdict}; {compiles:g} compiles "
        f"of {constraints:g} constraints for both replicas)"
    )
    return lines


def _shared_compiles(pong: Pong) -> tuple[float, float]:
    """Rank 0's compiles for every replica and the distinct constraints among them, over every constraint kind."""
    totals: list[float] = []
    for name in ("sglang:grammar_shared_compiles_total", "sglang:grammar_shared_constraints_total"):
        values = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([\d.e+]+)$", pong.metrics_text, re.MULTILINE)
        totals.append(sum(map(float, values)))
    return totals[0], totals[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both configurations")
    parser.add_argument(
        "--waves", type=int, default=2, help="requests per configuration and round = waves x concurrency"
    )
    parser.add_argument("--max-new-tokens", type=int, default=72)
    parser.add_argument("--backend", default="xgrammar", help="--grammar-backend of both schedulers")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy requests")
    args = parser.parse_args(argv)
    settings: dict[str, Any] = vars(args)
    for line in run_dp_benchmark(**settings):
        print(line)


if __name__ == "__main__":
    main()
