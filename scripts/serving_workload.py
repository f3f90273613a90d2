"""The serving benchmarks' workload: chat prompts that ask for JSON, run as free, JSON-schema and regex requests over
the scheduler's zmq client (or through llama.cpp, ``--peer llamacpp``), and what each kind's outcomes sum up to.

Each request index has a prompt of its own (no answer is a replay of an earlier one, which the n-gram cache would
replay); ``scripts/bench_serving.py`` and ``scripts/bench_dp.py`` schedule the requests and print the rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import jsonschema

from scheduler.client import AsyncSchedulerClient
from sglang_constrained.testing import llamacpp_peer

KINDS = ("free", "json", "regex")
PERSON_SCHEMA: dict[str, Any] = {
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
WARM_UP_TOKENS = 72
"""The warm-up requests' budget: a JSON answer's shortest ending fits in it (a smaller budget is refused up front)."""


def person_schema_named(tag: str) -> dict[str, Any]:
    """``PERSON_SCHEMA`` with ``_<tag>`` after every property name: a new constraint key for each tag, the same
    shape (``bench_new_constraints``; the ending search's test of a forced byte twice, ``9b6b22``)."""
    properties = {f"{name}_{tag}": spec for name, spec in PERSON_SCHEMA["properties"].items()}
    return {**PERSON_SCHEMA, "properties": properties, "required": list(properties)}


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
