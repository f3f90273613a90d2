"""Tensor parallel on the embedded model, side by side: per-token latency and memory per rank, tp=1 against tp=2.

    python scripts/bench_tp.py [--requests 4] [--max-new-tokens 48] [--rounds 2]

Starts one scheduler on one rank and one under ``torchrun --nproc-per-node 2 ... --tp-size 2``, both with
``--speculative-algorithm none`` (one forward per output token) and without the prefix cache, and keeps them up
together. Each round sends every prompt to both, one request at a time (concurrency 1, greedy, ``ignore_eos`` so
every output has ``--max-new-tokens`` tokens), alternating which server goes first. Per-token latency is the time
from a request's first streamed token to its last over the tokens in between (decode only; the median over
requests). Memory per rank: resident anonymous memory (``rank_anonymous_memory``: the heap, where the weights live,
without the files' pages) once both served, and the bytes of weights each rank's model runner holds (logged at
start). Also prints how many greedy outputs of tp=2 differ from tp=1's. torchrun gives each rank one thread; the
single rank uses the machine's cores, so both runs use the same cores.

Then new JSON schemas, each sent once to each server (alternating which goes first; the grammar disk cache is off):
the time to a request's first token, which is mostly its compile under ``auto``. Three are MaskBench schemas that
xgrammar compiles in 2-3 s at SmolLM2's vocabulary (``auto`` hands them to llguidance after 1 s), three small objects.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from cpu_kernels.cpu_info import describe_cpu
from scheduler.client import SchedulerClient
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.testing.maskbench import load_case

PROMPTS = (
    "Tell me a fun fact about octopuses.",
    "Describe a fictional person as JSON with name, age and city.",
    "Write a short poem about the sea.",
    "What is your phone number?",
)
SERVER_FLAGS = (
    "--speculative-algorithm", "none", "--disable-radix-cache", "--max-seq-len", "512", "--disable-grammar-disk-cache",
)  # fmt: skip
MIB = 2**20
MASKBENCH = Path(__file__).parents[1] / "tests" / "data" / "maskbench"
SLOW_SCHEMA_CASES = ("Github_trivial---o9933", "Github_trivial---o9912", "Github_trivial---o9790")
"""Among ``tests/backends/test_conformance.py``'s costly cases: xgrammar takes 2-3 s on each at SmolLM2's vocabulary."""


def new_schemas() -> list[tuple[str, dict[str, Any]]]:
    """``(name, schema)``: the slow MaskBench cases, then three small closed objects (told apart by their titles)."""
    schemas = [(name, load_case(next(MASKBENCH.glob(f"*/{name}.json"))).schema) for name in SLOW_SCHEMA_CASES]
    person = {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}}
    for i in range(3):
        small = {"title": f"small {i}", "type": "object", "properties": person, "required": ["name", "age"]}
        schemas.append((f"small object {i}", {**small, "additionalProperties": False}))
    return schemas


def first_token_seconds(client: SchedulerClient, schema: dict[str, Any]) -> float:
    """Seconds from sending a greedy request for ``schema`` to its first token (its output read to the end)."""
    start = time.perf_counter()
    first = None
    chunks = client.generate_stream(
        messages=[{"role": "user", "content": "Answer in JSON."}],
        sampling_params={"json_schema": schema, "temperature": 0, "max_new_tokens": 128},
    )
    for chunk in chunks:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("a schema's request gave no token")
    return first


def timed_request(client: SchedulerClient, prompt: str, max_new_tokens: int) -> tuple[list[int], float]:
    """The greedy output's tokens and its decode time per token (first streamed token to last), in seconds."""
    first = last = 0.0
    tokens: list[int] = []
    chunks = client.generate_stream(
        messages=[{"role": "user", "content": prompt}],
        sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    )
    for chunk in chunks:
        if chunk.token_ids:
            last = time.perf_counter()
            first = first or last
            tokens += chunk.token_ids
    if len(tokens) < 2:
        raise RuntimeError(f"a request gave {len(tokens)} tokens; per-token latency needs at least 2")
    return tokens, (last - first) / (len(tokens) - 1)


def run_tp_benchmark(num_requests: int = 4, max_new_tokens: int = 48, rounds: int = 2) -> list[str]:
    """Start tp=1 and tp=2 schedulers, time both interleaved, and return the printable result lines."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    servers = {1: SchedulerProcess(*SERVER_FLAGS), 2: SchedulerProcess(*SERVER_FLAGS, "--tp-size", "2", ranks=2)}
    try:
        for server in servers.values():
            server.wait_until_ready()
        latencies: dict[int, list[float]] = {1: [], 2: []}
        outputs: dict[int, list[list[int]]] = {1: [], 2: []}
        for round_index in range(rounds):
            for i, prompt in enumerate(prompts):
                order = (1, 2) if (round_index + i) % 2 == 0 else (2, 1)
                for tp in order:
                    with servers[tp].client() as client:
                        tokens, seconds = timed_request(client, prompt, max_new_tokens)
                    latencies[tp].append(seconds)
                    if round_index == 0:
                        outputs[tp].append(tokens)
        anonymous = {tp: server.rank_anonymous_memory() for tp, server in servers.items()}
        weights = {tp: server.rank_weight_bytes() for tp, server in servers.items()}
        first_tokens: dict[str, dict[int, float]] = {}
        for i, (name, schema) in enumerate(new_schemas()):
            for tp in (1, 2) if i % 2 == 0 else (2, 1):
                with servers[tp].client() as client:
                    first_tokens.setdefault(name, {})[tp] = first_token_seconds(client, schema)
    finally:
        for server in servers.values():
            server.stop()
            server.log_path.unlink(missing_ok=True)
    ms = {tp: 1e3 * statistics.median(values) for tp, values in latencies.items()}
    lines = [f"CPU: {describe_cpu()}"]
    lines += [
        f"tp={tp}: {ms[tp]:.1f} ms per output token (median of {len(latencies[tp])} requests x {max_new_tokens} "
        f"tokens, greedy, concurrency 1)"
        for tp in (1, 2)
    ]
    lines.append(f"tp=2 / tp=1 per-token latency: {ms[2] / ms[1]:.2f}x")
    for tp in (1, 2):
        for rank, (resident, held) in enumerate(zip(anonymous[tp], weights[tp], strict=True)):
            lines.append(
                f"tp={tp} rank {rank}: anonymous resident memory {resident / MIB:.0f} MiB, weights {held / MIB:.1f} "
                f"MiB ({held / weights[1][0]:.2f} of tp=1's), anonymous memory {resident / anonymous[1][0]:.2f} of "
                "tp=1's"
            )
    same = sum(a == b for a, b in zip(outputs[1], outputs[2], strict=True))
    lines.append(f"greedy outputs tp=2 vs tp=1: {same}/{len(prompts)} identical token for token")
    for name, by_tp in first_tokens.items():
        lines.append(f"new schema {name}: first token tp=1 {by_tp[1]:.2f} s, tp=2 {by_tp[2]:.2f} s")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4, help="prompts per round, each sent to both servers")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for line in run_tp_benchmark(args.requests, args.max_new_tokens, args.rounds):
        print(line)


if __name__ == "__main__":
    main()
