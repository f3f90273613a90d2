"""Running streams beside new constraints: how long a new schema's first request holds up the requests already decoding.

    python -m scripts.bench_new_constraints [--compare OTHER_CHECKOUT] [--rounds 3] [--streams 4] [--schemas 6]
                                            [--backend xgrammar]

Per round and checkout (this one, and ``--compare``'s, alternating which goes first) it starts ``python -m
scheduler.launch`` from that checkout on a free port and warms it with one JSON request. Then ``--streams`` free-text
streams decode (greedy, ``ignore_eos``, ``--stream-tokens`` tokens) and, once each has its first token, ``--schemas``
requests follow one after another, each with a JSON schema no earlier request had (property names drawn anew): each is
compiled, and its shortest output searched (budget-aware constraints), while the streams decode. Printed per
checkout, medians over rounds: the streams' gaps between chunks (median, p99, max: a stall shows in p99 and max), their
output tokens/s, and the new-schema requests' time to first token; and every new-schema answer's validity.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import jsonschema

from cpu_kernels.cpu_info import describe_cpu
from scheduler.client import AsyncSchedulerClient
from scheduler.testing.process import free_port
from scripts.serving_workload import person_schema_named

REPO = Path(__file__).resolve().parents[1]
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the sea."
SCHEMA_PROMPT = [{"role": "user", "content": "Describe a person as JSON with name, age, city and hobbies."}]


def new_schema() -> dict[str, Any]:
    """``bench_serving``'s person schema with property names no earlier schema had: a new constraint key, compiled
    anew, whose shortest output xgrammar's exact search does not find within its bound (open strings)."""
    return person_schema_named(uuid.uuid4().hex[:6])


async def stream_gaps(client: AsyncSchedulerClient, index: int, tokens: int, first: asyncio.Event) -> list[float]:
    """Seconds between one greedy stream's chunks; ``first`` is set at its first token."""
    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    gaps, last = [], None
    async for output in client.stream(text=f"{STREAM_PROMPT} ({index})", sampling_params=params):
        if not output.token_ids:
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        first.set()
    return gaps


async def new_schema_request(client: AsyncSchedulerClient) -> tuple[float, bool]:
    """Time to first token of one request with a new schema, and whether its answer validates."""
    schema = new_schema()
    params = {"temperature": 0.0, "max_new_tokens": 96, "json_schema": json.dumps(schema)}
    start, ttft, text = time.perf_counter(), None, ""
    async for output in client.stream(messages=SCHEMA_PROMPT, sampling_params=params):
        if output.token_ids and ttft is None:
            ttft = time.perf_counter() - start
        text += output.text
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return ttft or float("nan"), False
    return ttft or float("nan"), True


async def one_round(endpoint: str, args: argparse.Namespace) -> dict[str, Any]:
    client = AsyncSchedulerClient(endpoint)
    try:
        await client.wait_until_ready(timeout_s=600)
        await new_schema_request(client)  # warms the JSON paths (and the vocabulary's first search)
        started = [asyncio.Event() for _ in range(args.streams)]
        streams = [
            asyncio.create_task(stream_gaps(client, i, args.stream_tokens, event)) for i, event in enumerate(started)
        ]
        await asyncio.gather(*(event.wait() for event in started))
        schema_start = time.perf_counter()
        answers = [await new_schema_request(client) for _ in range(args.schemas)]
        schema_s = time.perf_counter() - schema_start
        gaps = [gap for per_stream in await asyncio.gather(*streams) for gap in per_stream]
    finally:
        await client.close()
    gaps.sort()
    return {
        "gap median ms": statistics.median(gaps) * 1e3,
        "gap p99 ms": gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
        "gap max ms": gaps[-1] * 1e3,
        "stream tok/s": len(gaps) / sum(gaps) * args.streams,
        "new schema TTFT ms": statistics.median(ttft for ttft, _ in answers) * 1e3,
        "new schemas s": schema_s,
        "valid": sum(valid for _, valid in answers),
        "answers": len(answers),
    }


def run_checkout(checkout: Path, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    port = free_port()
    flags = ["--zmq-port", str(port), "--grammar-backend", args.backend, "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    server = subprocess.Popen([sys.executable, "-m", "scheduler.launch", *flags], cwd=checkout, env=env, stderr=log)
    try:
        return asyncio.run(one_round(f"tcp://127.0.0.1:{port}", args))
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", type=Path, default=None, help="another checkout, run side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=160)
    parser.add_argument("--schemas", type=int, default=6)
    parser.add_argument("--backend", default="xgrammar")
    args = parser.parse_args(argv)
    print(describe_cpu())
    checkouts = [REPO] if args.compare is None else [REPO, args.compare.resolve()]
    runs: dict[Path, list[dict[str, Any]]] = {checkout: [] for checkout in checkouts}
    log_path = REPO / "results" / "bench_new_constraints.log"
    log_path.parent.mkdir(exist_ok=True)
    with log_path.open("w") as log:
        for round_index in range(args.rounds):
            for checkout in checkouts if round_index % 2 == 0 else checkouts[::-1]:
                runs[checkout].append(run_checkout(checkout, args, log))
                print(f"round {round_index + 1} {checkout}: {runs[checkout][-1]}", flush=True)
    for checkout, results in runs.items():
        figures = {name: statistics.median(r[name] for r in results) for name in results[0] if name != "valid"}
        valid = sum(r["valid"] for r in results)
        answers = sum(r["answers"] for r in results)
        shown = ", ".join(f"{name} {value:.1f}" for name, value in figures.items() if name != "answers")
        print(f"{checkout}: {shown}; valid new-schema answers {valid}/{answers}")


if __name__ == "__main__":
    main()
