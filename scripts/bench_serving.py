"""Serving cost of constraints: free, JSON-schema and regex requests on the embedded model, side by side.

Starts ``python -m scheduler.launch`` on a free loopback port, then at each concurrency level runs chat prompts
that ask for JSON as free, JSON-schema and regex requests (each prompt asked once per scheduler, so that no answer
is a replay of an earlier one), the kinds taking turns in rotated order for ``--rounds`` rounds, each with
``concurrency`` streams in flight. Per kind: output tokens/s
(all output tokens over the kind's wall time), time to first token, time per output token after the first,
average output length, and the share of outputs that validate (``jsonschema`` / ``re.fullmatch``; outputs cut
by the token limit are counted apart, as not valid). Forwards per output token are counted from the stream:
the scheduler sends one chunk per step in which a request gained tokens, and each such step is one model
forward that request took part in. ``--profile`` runs the scheduler under cProfile and prints where its time went.
``--peer llamacpp`` (where llama-cpp-python is installed: the ``llamacpp`` extra) also runs the free and JSON
requests through llama.cpp on the same GGUF file, each round right after ours, and prints ours over it;
``--model-runner llamacpp`` runs our schedulers on llama.cpp's kernels too (``scheduler.model.llamacpp_runner``).
``--ranks`` runs the benchmarks of several ranks instead: data parallel (``scripts/bench_dp.py``: 2 replicas x 1
thread against 1 rank x 2 threads, JSON at concurrency 16, and grammar compiles per distinct schema) and tensor
parallel (``scripts/bench_tp.py``: per-token latency and memory per rank, tp=1 against tp=2).
``--compare-speculation`` starts two schedulers, ``--speculative-algorithm none`` and the default, runs every
kind on both back to back, and prints speculation on over off, JSON on over free off, forwards per token and, per
draft source, the acceptance rate and mean accepted run (from the schedulers' counters).

    python scripts/bench_serving.py [--backend xgrammar] [--concurrency 1 8 32] [--max-new-tokens 72] [--profile]
                                    [--peer llamacpp] [--model-runner llamacpp] [--compare-speculation]
                                    [--temperature 0.7]
    python -m scripts.bench_serving --ranks

Over 300 lines: the requests, their schedule and their summary are shared by the profile and the peer runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pstats
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from scheduler.client import AsyncSchedulerClient
from scheduler.server_args import MODEL_RUNNERS
from sglang_constrained.testing import llamacpp_peer
from sglang_constrained.testing.benchmarking import cpu_pressure

REPO = Path(__file__).resolve().parents[1]
KINDS = ("free", "json", "regex")
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PERSON_REGEX = (
    r'\{"name": "[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12})?", "age": (0|[1-9][0-9]?), '
    r'"city": "[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?", "hobbies": \["[a-z ]{3,20}"(, "[a-z ]{3,20}"){0,3}\]\}'
)
PROMPT_TEMPLATES = (
    "Describe a {who} as JSON with name, age, city and hobbies.",
    "Give me a JSON object for a {who}: name, age, city, hobbies.",
    "Invent a {who}. Answer in JSON with name, age, city and hobbies.",
    "Return JSON describing a {who} (name, age, city, hobbies).",
    "Create a JSON profile of a {who} with name, age, city and hobbies.",
    "Output a JSON record for a {who}: name, age, city, hobbies.",
    "Make up a {who} and describe them in JSON (name, age, city, hobbies).",
    "Write a JSON object about a {who}: name, age, city and a list of hobbies.",
)
ADJECTIVES = ("cheerful", "quiet", "young", "famous", "busy", "patient", "curious", "friendly", "shy", "bold", "gentle")
ROLES = (
    "chess player", "baker", "retired sailor", "painter", "marathon runner", "librarian", "gardener", "pilot",
    "nurse", "carpenter", "violinist", "chemist", "farmer", "journalist", "firefighter", "potter", "translator",
    "beekeeper", "surgeon", "tailor", "geologist", "mechanic", "poet",
)  # fmt: skip
DISTINCT_PROMPTS = len(PROMPT_TEMPLATES) * len(ADJECTIVES) * len(ROLES)
"""Template, adjective and role counts are coprime, so request ``i`` < this gets its own prompt and consecutive
requests differ in all three: no request repeats an earlier one, whose answer the n-gram cache would replay."""
WARM_UP_INDEX = DISTINCT_PROMPTS - 1


def prompt_for(index: int) -> str:
    """The chat prompt of request ``index``: distinct for every index below ``DISTINCT_PROMPTS``."""
    who = f"{ADJECTIVES[index % len(ADJECTIVES)]} {ROLES[index % len(ROLES)]}"
    return PROMPT_TEMPLATES[index % len(PROMPT_TEMPLATES)].format(who=who)


@dataclass
class Outcome:
    """One request as the client saw it."""

    kind: str
    text: str
    num_tokens: int
    num_chunks: int
    finish: str
    ttft_s: float
    tpot_s: float | None


CONSTRAINTS: dict[str, dict[str, Any]] = {
    "free": {},
    "json": {"json_schema": PERSON_SCHEMA},
    "regex": {"regex": PERSON_REGEX},
}


def is_valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(PERSON_REGEX, text) is not None
    try:
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


async def run_one(
    client: AsyncSchedulerClient, kind: str, index: int, max_new_tokens: int, temperature: float = 0.7
) -> Outcome:
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": index, **CONSTRAINTS[kind]}
    messages = [{"role": "user", "content": prompt_for(index)}]
    start = time.perf_counter()
    first = last = None
    text, num_tokens, num_chunks, finish = "", 0, 0, "none"
    async for output in client.stream(messages=messages, sampling_params=params):
        now = time.perf_counter()
        if output.token_ids:
            first = first or now
            last = now
            num_chunks += 1
            num_tokens += len(output.token_ids)
        text += output.text
        if output.finished and output.finish_reason is not None:
            finish = output.finish_reason.type
    ttft = (first or time.perf_counter()) - start
    tpot = (last - first) / (num_tokens - 1) if first and last and num_tokens > 1 else None
    return Outcome(kind, text, num_tokens, num_chunks, finish, ttft, tpot)


async def run_kind(
    client: AsyncSchedulerClient,
    kind: str,
    concurrency: int,
    indices: range,
    max_new_tokens: int,
    temperature: float = 0.7,
) -> tuple[list[Outcome], float]:
    """Requests ``indices`` of one kind with ``concurrency`` in flight; returns outcomes and wall seconds."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(index: int) -> Outcome:
        async with gate:
            return await run_one(client, kind, index, max_new_tokens, temperature)

    start = time.perf_counter()
    outcomes = await asyncio.gather(*(gated(i) for i in indices))
    return list(outcomes), time.perf_counter() - start


def summarise(kind: str, outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    tokens = sum(o.num_tokens for o in outcomes)
    tpots = [o.tpot_s for o in outcomes if o.tpot_s is not None]
    completed = [o for o in outcomes if o.finish == "stop"]
    row: dict[str, Any] = {
        "kind": kind,
        "requests": len(outcomes),
        "output_tokens_per_s": tokens / wall_s,
        "ttft_median_ms": statistics.median(o.ttft_s for o in outcomes) * 1e3,
        "tpot_median_ms": statistics.median(tpots) * 1e3 if tpots else float("nan"),
        "avg_output_tokens": tokens / len(outcomes),
        "forwards_per_output_token": sum(o.num_chunks for o in outcomes) / max(tokens, 1),
        "cut_by_length": sum(o.finish == "length" for o in outcomes),
        "aborted": sum(o.finish not in ("stop", "length") for o in outcomes),
    }
    row["samples"] = [o.text for o in outcomes[:2]]
    if kind != "free":
        row["valid"] = sum(is_valid(kind, o.text) for o in completed)
        row["valid_share"] = row["valid"] / len(outcomes)
    return row


def run_peer(
    peer: llamacpp_peer.LlamaCppPeer, kind: str, indices: range, max_new_tokens: int
) -> tuple[list[Outcome], float]:
    """The same requests as ``run_kind`` through llama.cpp, one at a time; outcomes and wall seconds."""
    start = time.perf_counter()
    results = peer.run_kind(kind, [prompt_for(i) for i in indices], list(indices), max_new_tokens)
    wall_s = time.perf_counter() - start
    outcomes = [
        Outcome(kind, r["text"], r["num_tokens"], r["num_tokens"], r["finish"], r["ttft_s"], r["tpot_s"])
        for r in results
    ]
    return outcomes, wall_s


def format_peer_ratio(concurrency: int, kind: str, ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Output tokens/s, ours over llama.cpp's, against the issue's targets."""
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    target = 2.0 if concurrency > 1 else (0.5 if kind == "free" else 1.0)
    verdict = "ok" if ratio >= target else f"MISS (target >= {target:g})"
    return (
        f"ours/llama.cpp {kind} at C={concurrency}: output tok/s {ratio:.3f} ({verdict}); llama.cpp "
        f"{theirs['output_tokens_per_s']:.1f} tok/s, TPOT {theirs['tpot_median_ms']:.1f} ms, "
        f"valid {theirs.get('valid', '-')}/{theirs['requests']}"
    )


SpeculationCounters = dict[str, Any]
ZERO_COUNTERS: SpeculationCounters = {
    "forwards": 0,
    "tokens": 0,
    "forced": 0,
    "proposed": {},
    "accepted": {},
    "runs": {},
}


async def speculation_counters(client: AsyncSchedulerClient) -> SpeculationCounters:
    pong = await client.wait_until_ready()
    return {
        "forwards": pong.num_forwards,
        "tokens": pong.num_output_tokens,
        "forced": pong.num_forced_tokens,
        "proposed": dict(pong.drafts_proposed),
        "accepted": dict(pong.drafts_accepted),
        "runs": dict(pong.draft_runs),
    }


def counters_delta(after: SpeculationCounters, before: SpeculationCounters) -> SpeculationCounters:
    delta: SpeculationCounters = {}
    for name, value in after.items():
        if isinstance(value, dict):
            delta[name] = {source: count - before[name].get(source, 0) for source, count in value.items()}
        else:
            delta[name] = value - before[name]
    return delta


async def bench(endpoints: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kind on every scheduler (``endpoints``: label -> address), back to back, round after round."""
    peer = None
    if args.peer == "llamacpp":
        if not llamacpp_peer.is_available():
            raise SystemExit("--peer llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'")
        peer = llamacpp_peer.LlamaCppPeer(threads=os.cpu_count() or 1, schema=PERSON_SCHEMA)
    clients = {label: AsyncSchedulerClient(endpoint) for label, endpoint in endpoints.items()}
    for label, client in clients.items():
        pong = await client.wait_until_ready(timeout_s=600)
        print(f"scheduler {label or ''} ready: {pong.model}, grammar backend {pong.grammar_backend}")
        for kind in KINDS:  # compile and cache the grammars, warm every path once
            await run_one(client, kind, WARM_UP_INDEX, 4)
    rows = []
    level_start = 0  # each scheduler gets request i of a level, kind and round once: the same prompts, none repeated
    for concurrency in args.concurrency:
        num_requests = max(args.min_requests, args.waves * concurrency)
        level_size = args.rounds * len(KINDS) * num_requests
        runs = [(label, kind) for label in clients for kind in KINDS]
        collected: dict[tuple[str, str], tuple[list[Outcome], float]] = {run: ([], 0.0) for run in runs}
        counters = {run: counters_delta(ZERO_COUNTERS, ZERO_COUNTERS) for run in runs}
        peer_collected: dict[str, tuple[list[Outcome], float]] = {kind: ([], 0.0) for kind in llamacpp_peer.PEER_KINDS}
        round_tpots: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        round_rates: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
        for round_index in range(args.rounds):
            order = runs[round_index % len(runs) :] + runs[: round_index % len(runs)]
            for label, kind in order if round_index % 2 == 0 else order[::-1]:
                client = clients[label]
                first = level_start + (round_index * len(KINDS) + KINDS.index(kind)) * num_requests
                indices = range(first, first + num_requests)
                before = await speculation_counters(client)
                outcomes, wall_s = await run_kind(
                    client, kind, concurrency, indices, args.max_new_tokens, args.temperature
                )
                delta = counters_delta(await speculation_counters(client), before)
                counters[label, kind] = counters_sum(counters[label, kind], delta)
                previous, previous_s = collected[label, kind]
                collected[label, kind] = (previous + outcomes, previous_s + wall_s)
                round_tpots[label, kind].append(statistics.median(o.tpot_s or math.nan for o in outcomes))
                round_rates[label, kind].append(sum(o.num_tokens for o in outcomes) / wall_s)
                if peer is not None and kind in peer_collected and label == next(iter(clients)):
                    outcomes, wall_s = run_peer(peer, kind, indices, args.max_new_tokens)
                    previous, previous_s = peer_collected[kind]
                    peer_collected[kind] = (previous + outcomes, previous_s + wall_s)
        level_start += level_size
        level = {run: summarise(run[1], *collected[run]) for run in runs}
        for label, kind in runs:
            row = level[label, kind]
            rows.append(
                {
                    "concurrency": concurrency,
                    "scheduler": label,
                    **row,
                    "round_tpot_ms": [t * 1e3 for t in round_tpots[label, kind]],
                    "round_output_tokens_per_s": round_rates[label, kind],
                    "speculation": counters[label, kind],
                }
            )
            print(format_row(concurrency, row, label))
        print(f"C={concurrency}: CPU pressure (share of the last minute a task waited for a core) {cpu_pressure()}")
        for label in clients:
            for kind in ("json", "regex"):
                free_tpots, own_tpots = round_tpots[label, "free"], round_tpots[label, kind]
                paired = [free / own for free, own in zip(free_tpots, own_tpots, strict=True)]
                print(format_ratio(concurrency, level[label, kind], level[label, "free"], statistics.median(paired)))
        if set(clients) == set(SPECULATION_LABELS):
            for line in speculation_lines(concurrency, level, round_rates, counters):
                print(line)
        if peer is not None:
            ours = next(iter(clients))
            for kind, (outcomes, wall_s) in peer_collected.items():
                theirs = summarise(kind, outcomes, wall_s)
                rows.append({"concurrency": concurrency, "peer": "llamacpp", **theirs})
                print(format_peer_ratio(concurrency, kind, level[ours, kind], theirs))
    for client in clients.values():
        await client.close()
    return rows


def counters_sum(a: SpeculationCounters, b: SpeculationCounters) -> SpeculationCounters:
    total: SpeculationCounters = {}
    for name, value in a.items():
        if isinstance(value, dict):
            total[name] = {source: value.get(source, 0) + b[name].get(source, 0) for source in {*value, *b[name]}}
        else:
            total[name] = value + b[name]
    return total


SPECULATION_LABELS = ("spec-off", "spec-on")


def speculation_lines(
    concurrency: int,
    level: dict[tuple[str, str], dict[str, Any]],
    round_rates: dict[tuple[str, str], list[float]],
    counters: dict[tuple[str, str], SpeculationCounters],
) -> list[str]:
    """Speculation on over off per kind, JSON on over free off, and what each draft source achieved.

    Ratios of output tokens/s are the median over rounds of each round's pair (run back to back, so a load spike
    on this shared machine skews one round, not the result), then the pooled ratio over all rounds.
    """
    off, on = SPECULATION_LABELS

    def median_ratio(numerator: tuple[str, str], denominator: tuple[str, str]) -> float:
        return statistics.median(a / b for a, b in zip(round_rates[numerator], round_rates[denominator], strict=True))

    def paired(numerator: tuple[str, str], denominator: tuple[str, str]) -> str:
        pooled = level[numerator]["output_tokens_per_s"] / level[denominator]["output_tokens_per_s"]
        return f"{median_ratio(numerator, denominator):.3f} (median of rounds; pooled {pooled:.3f})"

    lines = []
    for kind in KINDS:
        ratio = median_ratio((on, kind), (off, kind))
        target = 1.5 if (kind == "json" and concurrency == 1) else (0.97 if concurrency >= 32 else None)
        verdict = "" if target is None else (" (ok)" if ratio >= target else f" (MISS: target >= {target:g})")
        forwards = level[on, kind]["forwards_per_output_token"]
        forwards_verdict = (" (ok)" if forwards <= 0.6 else " (MISS: target <= 0.6)") if kind == "json" else ""
        lines.append(
            f"speculation on/off {kind} at C={concurrency}: output tok/s {paired((on, kind), (off, kind))}{verdict}; "
            "forwards/token "
            f"{level[off, kind]['forwards_per_output_token']:.3f} -> {forwards:.3f}{forwards_verdict}"
        )
    faster_than_free = median_ratio((on, "json"), (off, "free"))
    verdict = "" if concurrency != 1 else (" (ok)" if faster_than_free >= 1.3 else " (MISS: target >= 1.3)")
    lines.append(
        f"JSON with speculation / free without at C={concurrency}: output tok/s "
        f"{paired((on, 'json'), (off, 'free'))}{verdict}"
    )
    for kind in KINDS:
        spec = counters[on, kind]
        parts = [f"forced {spec['forced']} of {spec['tokens']} tokens"]
        for source in sorted(spec["proposed"]):
            proposed, accepted, runs = spec["proposed"][source], spec["accepted"].get(source, 0), spec["runs"][source]
            rate = accepted / proposed if proposed else 0.0
            mean_run = accepted / max(runs, 1)
            parts.append(f"{source} drafts: acceptance {rate:.2f} ({accepted}/{proposed}), mean run {mean_run:.2f}")
        lines.append(f"  C={concurrency} {kind} speculation: " + "; ".join(parts))
    return lines


def format_row(concurrency: int, row: dict[str, Any], label: str = "") -> str:
    valid = f"valid {row['valid']}/{row['requests']}" if "valid" in row else f"{'':>12}"
    return (
        f"C={concurrency:<3} {label}{' ' if label else ''}{row['kind']:>5}: {row['output_tokens_per_s']:7.1f} tok/s"
        f"  TTFT {row['ttft_median_ms']:7.1f} ms  TPOT {row['tpot_median_ms']:6.1f} ms"
        f"  avg len {row['avg_output_tokens']:5.1f}  {valid}"
        f"  cut {row['cut_by_length']}  aborted {row['aborted']}  forwards/token {row['forwards_per_output_token']:.3f}"
    )


def format_ratio(concurrency: int, row: dict[str, Any], free: dict[str, Any], paired_decode: float) -> str:
    """``paired_decode``: the median over rounds of free TPOT / constrained TPOT, each pair run back to back."""
    verdict = "ok" if paired_decode >= 0.95 else "MISS (target >= 0.95)"
    return (
        f"ratio {row['kind']}/free at C={concurrency}: decode throughput (1/TPOT) median of rounds "
        f"{paired_decode:.3f} ({verdict}), pooled {free['tpot_median_ms'] / row['tpot_median_ms']:.3f}; "
        f"output tok/s {row['output_tokens_per_s'] / free['output_tokens_per_s']:.3f}; "
        f"TTFT {row['ttft_median_ms'] / free['ttft_median_ms']:.3f}"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


STEP_PARTS = (
    ("step (whole loop turn)", "scheduler/scheduler.py", "step"),
    ("model forward", "scheduler/model/runner.py", "forward"),
    ("mask fill (update_regex_vocab_mask)", "scheduler/sampling_batch_info.py", "update_regex_vocab_mask"),
    ("mask apply (apply_logits_bias)", "scheduler/sampling_batch_info.py", "apply_logits_bias"),
    ("sampling tensors (prepare)", "scheduler/sampling_batch_info.py", "prepare"),
    ("sample", "scheduler/sampler.py", "sample"),
    ("accept token, text, stop checks (_accept)", "scheduler/scheduler.py", "_accept"),
    ("stream chunks (_send_progress)", "scheduler/scheduler.py", "_send_progress"),
    ("finish (_finish)", "scheduler/scheduler.py", "_finish"),
    ("grammar admission (get_ready_grammar_requests)", "scheduler/grammar_manager.py", "get_ready_grammar_requests"),
)


def print_profile(path: Path, limit: int) -> dict[str, dict[str, float]]:
    """Where the scheduler's loop spent its time (cumulative seconds per part), then its heaviest functions."""
    stats = pstats.Stats(str(path), stream=sys.stdout)
    cumulative = {(file, name): (calls, seconds) for (file, _, name), (_, calls, _, seconds, _) in stats.stats.items()}  # type: ignore[attr-defined]
    parts = {}
    for label, suffix, name in STEP_PARTS:
        found = [value for (file, function), value in cumulative.items() if function == name and file.endswith(suffix)]
        calls, seconds = found[0] if found else (0, 0.0)
        parts[label] = {"calls": calls, "seconds": seconds}
    step_s = parts[STEP_PARTS[0][0]]["seconds"] or float("nan")
    print("scheduler time by part (cProfile, cumulative; its overhead inflates Python-heavy parts):")
    for label, part in parts.items():
        per_call = part["seconds"] / part["calls"] * 1e3 if part["calls"] else 0.0
        print(
            f"  {label:<48} {part['seconds']:8.2f} s  {part['calls']:>7} calls  {per_call:8.3f} ms/call"
            f"  {part['seconds'] / step_s:6.1%} of step"
        )
    stats.sort_stats("tottime").print_stats(limit)
    return parts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="xgrammar", help="--grammar-backend of the scheduler")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-new-tokens", type=int, default=72)
    parser.add_argument("--waves", type=int, default=1, help="requests per kind and round = waves x concurrency")
    parser.add_argument("--min-requests", type=int, default=2, help="at least this many requests per kind and round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds over the three kinds, in rotated order")
    parser.add_argument("--profile", action="store_true", help="run the scheduler under cProfile and print the top")
    parser.add_argument("--model-runner", choices=MODEL_RUNNERS, default="torch", help="the schedulers' engine")
    parser.add_argument("--peer", choices=["llamacpp"], default=None, help="also run the requests through llama.cpp")
    parser.add_argument(
        "--compare-speculation", action="store_true", help="speculation off and on, two schedulers side by side"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy requests")
    parser.add_argument("--ranks", action="store_true", help="data- and tensor-parallel ranks against one rank")
    parser.add_argument("--output", type=Path, default=None, help="default: results/bench_serving_<backend>.json")
    args = parser.parse_args(argv)
    if args.ranks:
        try:  # here, not on top: bench_dp imports this module's helpers
            from scripts.bench_dp import run_dp_benchmark
            from scripts.bench_tp import run_tp_benchmark
        except ModuleNotFoundError:
            parser.error("--ranks runs as a module, from the repository: python -m scripts.bench_serving --ranks")
        for line in [*run_dp_benchmark(backend=args.backend), *run_tp_benchmark()]:
            print(line)
        return
    needed = sum(args.rounds * len(KINDS) * max(args.min_requests, args.waves * c) for c in args.concurrency)
    if needed >= WARM_UP_INDEX:
        parser.error(
            f"{needed} requests per scheduler, but only {WARM_UP_INDEX} distinct prompts: fewer rounds or waves"
        )
    results_dir = REPO / "results"
    results_dir.mkdir(exist_ok=True)
    runner_suffix = "" if args.model_runner == "torch" else f"_{args.model_runner}"
    output = args.output or results_dir / f"bench_serving_{args.backend}{runner_suffix}.json"
    labels = SPECULATION_LABELS if args.compare_speculation else ("",)
    ports = {label: free_port() for label in labels}
    profile_path = results_dir / f"bench_serving_{args.backend}.prof"
    log_path = results_dir / f"bench_serving_{args.backend}.log"
    servers = []
    with log_path.open("w") as log:
        for label, port in ports.items():
            launch = ["-m", "scheduler.launch", "--zmq-port", str(port), "--grammar-backend", args.backend]
            launch += ["--max-running-requests", str(max(args.concurrency)), "--log-level", "warning"]
            launch += ["--model-runner", args.model_runner]
            if label in SPECULATION_LABELS:
                launch += ["--speculative-algorithm", "none" if label == SPECULATION_LABELS[0] else "grammar+ngram"]
            prefix = ["-m", "cProfile", "-o", str(profile_path)] if args.profile and label == labels[-1] else []
            servers.append(subprocess.Popen([sys.executable, *prefix, *launch], cwd=REPO, stderr=log))
        try:
            rows = asyncio.run(bench({label: f"tcp://127.0.0.1:{port}" for label, port in ports.items()}, args))
        finally:
            for server in servers:
                server.send_signal(signal.SIGTERM)
            for server in servers:
                server.wait(timeout=120)
    report = {
        "backend": args.backend,
        "model_runner": args.model_runner,
        "max_new_tokens": args.max_new_tokens,
        "profiled": args.profile,
    }
    report |= {"temperature": args.temperature, "compare_speculation": args.compare_speculation}
    report |= {
        "load_average_1min": os.getloadavg()[0],
        "cpu_pressure_avg60": cpu_pressure(),
        "schema": PERSON_SCHEMA,
        "regex": PERSON_REGEX,
        "rows": rows,
    }
    if args.profile:
        report["profile"] = print_profile(profile_path, limit=25)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output} (scheduler log: {log_path})")


if __name__ == "__main__":
    main()
