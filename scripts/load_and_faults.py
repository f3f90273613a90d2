"""Load and faults on a real server: mixed requests at a concurrency, a share of them invalid, clients that
disconnect, and grammar compiles that take xgrammar tens of seconds, all at once on loopback.

``python -m scripts.load_and_faults [--requests 400] [--concurrency 32] [-- SERVER FLAGS]`` starts ``python -m
scheduler.launch`` on a free loopback port, then:

- the compile cases, one line each, every request streamed: a new small schema (a two-field object, compiled in
  milliseconds alone) sent alone, then while 1 and 2 slow compiles run (``--slow-counts``): its status, validity,
  time to first token and to its answer (target beside slow compiles: 200, valid, first token within 5 s), and how
  the slow compiles ended; a schema xgrammar compiles slowly (llguidance in milliseconds) sent alone: its status
  and time to first token; a schema whose length bounds alone predict an xgrammar compile beyond the deadline: its
  status, time and message;
- the load (skipped with ``--skip-load``): the requests in rounds that alternate between "alone" and "beside a slow
  compile" (one slow compile always in flight during the latter), and one line: requests answered and lost,
  invalid outputs (a constrained answer its constraint refuses), server errors, the resident memory of the server's
  processes at start, peak and end, and the p50/p99 latency of valid requests alone and beside a slow compile
  (target: a p50 ratio of at most 1.5).

Bounded: the request count, and ``--max-seconds`` for the whole run. Prints the CPU model first.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema

from scheduler.testing.process import (
    SchedulerProcess,
    cpu_model,
    free_port,
    process_tree_memory,
    wait_until_healthy,
)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
YES_NO = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
PHONE = r"[0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue"]
QUESTION = [{"role": "user", "content": "Describe a person in one short JSON object."}]


@dataclass(frozen=True)
class Kind:
    """A kind of valid request: its extra body fields and the check its answer must pass (None: free text)."""

    name: str
    fields: dict[str, Any]
    check: Callable[[str], bool] | None


def _is_json_for(schema: dict[str, Any]) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    return check


def _json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


VALID_KINDS = (
    Kind("free", {}, None),
    Kind("json", _json_format(PERSON), _is_json_for(PERSON)),
    Kind("json", _json_format(YES_NO), _is_json_for(YES_NO)),
    Kind("regex", {"regex": PHONE}, lambda text: re.fullmatch(PHONE, text) is not None),
    Kind("choice", {"guided_choice": COLORS}, lambda text: text in COLORS),
)
"""Free text and constraints whose grammars are cached after the warm-up: what a slow compile must not slow."""

INVALID_BODIES: tuple[dict[str, Any], ...] = (
    {"messages": QUESTION, "max_tokens": "8"},
    {"messages": QUESTION, "stream": "yes"},
    {"messages": QUESTION, "regex": "(ab"},
    {"messages": QUESTION, "ebnf": "root ::="},
    {"messages": QUESTION, "guided_json": {"type": "strin"}},
    {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": True}}},
    {"messages": QUESTION, "max_tokens": 10**9},
    {"messages": [{"role": "user", "content": "x" * 2_000_000}]},
    {"messages": QUESTION, "n": 1000},
)


def slow_schema(max_length: int = 3000) -> dict[str, Any]:
    """A schema xgrammar takes tens of seconds to compile on 2 cores (long length-bounded strings; llguidance takes
    milliseconds), new each time. At the default length its predicted cost stays under the script's deadline, so
    it is compiled; at 5,000 it is predicted beyond it."""
    tag = uuid.uuid4().hex[:8]
    properties = {f"f{i}_{tag}": {"type": "string", "maxLength": max_length} for i in range(4)}
    return {"type": "object", "properties": properties}


def small_schema() -> dict[str, Any]:
    """A new two-field object each time (never cached), which every backend compiles in milliseconds."""
    tag = uuid.uuid4().hex[:8]
    return {
        "type": "object",
        "properties": {f"name_{tag}": {"type": "string"}, f"age_{tag}": {"type": "integer"}},
        "required": [f"name_{tag}", f"age_{tag}"],
        "additionalProperties": False,
    }


@dataclass
class Tally:
    answered: int = 0
    lost: int = 0
    invalid_outputs: int = 0
    server_errors: int = 0
    refused: int = 0
    disconnects: int = 0
    slow_compiles_answered: int = 0
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"alone": [], "beside": []})
    problems: list[str] = field(default_factory=list)


class MemoryWatch:
    """Samples the memory (PSS, see ``TreeMemory``) of a process and its descendants on a thread: start, peak, end
    (MiB)."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid = pid
        self.start = self.peak = self.end = self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def sample(self) -> float:
        return process_tree_memory(self.pid).pss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.end = self.sample()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.peak = max(self.peak, self.sample())


async def valid_request(http: httpx.AsyncClient, kind: Kind, phase: str, tally: Tally, max_tokens: int) -> None:
    body = {"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, **kind.fields}
    started = time.perf_counter()
    try:
        response = await http.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        tally.lost += 1
        tally.problems.append(f"{kind.name}: {type(e).__name__}")
        return
    elapsed = time.perf_counter() - started
    tally.answered += 1
    if response.status_code >= 500:
        tally.server_errors += 1
        tally.problems.append(f"{kind.name}: {response.status_code} {response.text[:200]}")
        return
    if response.status_code != 200:
        tally.lost += 1
        tally.problems.append(f"{kind.name}: {response.status_code} {response.text[:200]}")
        return
    choice = response.json()["choices"][0]
    text, finished = choice["message"]["content"], choice["finish_reason"]
    if kind.check is not None and finished == "stop" and not kind.check(text):
        tally.invalid_outputs += 1
        tally.problems.append(f"{kind.name}: invalid output {text[:100]!r}")
    tally.latencies[phase].append(elapsed)


async def invalid_request(http: httpx.AsyncClient, body: dict[str, Any], tally: Tally) -> None:
    try:
        response = await http.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as e:
        tally.lost += 1
        tally.problems.append(f"invalid: {type(e).__name__}")
        return
    tally.answered += 1
    if response.status_code >= 500:
        tally.server_errors += 1
        tally.problems.append(f"invalid: {response.status_code} {response.text[:200]}")
    elif 400 <= response.status_code < 500:
        tally.refused += 1
    else:
        tally.problems.append(f"invalid body answered {response.status_code}: {json.dumps(body)[:100]}")


async def disconnecting_request(http: httpx.AsyncClient, tally: Tally) -> None:
    """A streamed request whose client leaves after the first chunk."""
    body = {"messages": QUESTION, "max_tokens": 200, "stream": True}
    with contextlib.suppress(httpx.HTTPError):
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_bytes():
                break
    tally.disconnects += 1


async def slow_compiles(http: httpx.AsyncClient, beside: asyncio.Event, done: asyncio.Event, tally: Tally) -> None:
    """Keep one slow compile in flight whenever ``beside`` is set, until ``done``."""
    while not done.is_set():
        await beside.wait()
        body = {"messages": QUESTION, "max_tokens": 4, **_json_format(slow_schema())}
        with contextlib.suppress(httpx.HTTPError):
            response = await http.post("/v1/chat/completions", json=body)
            tally.slow_compiles_answered += 1
            if response.status_code >= 500:
                tally.server_errors += 1
                tally.problems.append(f"slow compile: {response.status_code} {response.text[:200]}")


async def run_load(url: str, args: argparse.Namespace, tally: Tally) -> None:
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.max_seconds)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        for kind in VALID_KINDS:  # warm-up: every valid kind's grammar compiled and cached
            await valid_request(http, kind, "alone", Tally(), args.max_tokens)
        beside, done = asyncio.Event(), asyncio.Event()
        compiler = asyncio.create_task(slow_compiles(http, beside, done, tally))
        semaphore = asyncio.Semaphore(args.concurrency)

        async def one(phase: str) -> None:
            async with semaphore:
                draw = rng.random()
                if draw < args.invalid_share:
                    await invalid_request(http, rng.choice(INVALID_BODIES), tally)
                elif draw < args.invalid_share + args.disconnect_share:
                    await disconnecting_request(http, tally)
                else:
                    await valid_request(http, rng.choice(VALID_KINDS), phase, tally, args.max_tokens)

        per_round = max(1, args.requests // (2 * args.rounds))
        try:
            for _, phase in itertools.product(range(args.rounds), ("alone", "beside")):
                if phase == "beside":
                    beside.set()
                    await asyncio.sleep(args.compile_head_start)  # the slow compile is under way
                await asyncio.gather(*(one(phase) for _ in range(per_round)))
                beside.clear()
        finally:  # also when --max-seconds cuts the run: nothing may outlive the client
            done.set()
            compiler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await compiler


@dataclass(frozen=True)
class Answer:
    """One streamed request's outcome: HTTP status, seconds to its first token (or to the error) and to its end,
    the error message if any, and whether a finished answer satisfied its schema (None: not checked)."""

    status: int
    first_token_s: float
    seconds: float
    message: str = ""
    is_valid: bool | None = None
    request_id: str = ""

    def describe(self, server_log: str = "") -> str:
        """The outcome; with the server's log, also how long its grammar took to be ready there (compile and wait
        for a slot, without the generation's share of a busy machine)."""
        validity = {None: "", True: ", valid", False: ", INVALID"}[self.is_valid]
        if self.status != 200 or self.message:
            return f"{self.status}{validity} in {self.seconds:.2f} s ({self.message[:150]})"
        ready = re.search(rf"rid={re.escape(self.request_id)}-0 \S+ grammar_ready_after_s=([\d.]+)", server_log)
        grammar = f"grammar ready in {ready.group(1)} s, " if ready else ""
        return f"200{validity}, {grammar}first token in {self.first_token_s:.2f} s, answered in {self.seconds:.2f} s"


async def ask_schema(http: httpx.AsyncClient, schema: dict[str, Any], max_tokens: int) -> Answer:
    """Ask for a streamed JSON answer to ``schema``; checks the answer when it finished."""
    body = {"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True, **_json_format(schema)}
    started = time.perf_counter()
    first_token_s, text, finish_reason, request_id = None, "", None, ""
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            message = response.json().get("error", {}).get("message", "")
            return Answer(response.status_code, math.nan, time.perf_counter() - started, message)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            request_id = chunk.get("id", request_id)
            if "error" in chunk:
                elapsed = time.perf_counter() - started
                return Answer(200, math.nan, elapsed, f"streamed error: {chunk['error'].get('message', '')}")
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    first_token_s = first_token_s or time.perf_counter() - started
                    text += choice["delta"]["content"]
                finish_reason = choice.get("finish_reason") or finish_reason
    is_valid = _is_json_for(schema)(text) if finish_reason == "stop" else None
    seconds = time.perf_counter() - started
    return Answer(200, first_token_s or math.nan, seconds, is_valid=is_valid, request_id=request_id)


async def new_schema_beside_slow_compiles(
    http: httpx.AsyncClient, num_slow: int, head_start_s: float, max_tokens: int
) -> tuple[Answer, list[Answer]]:
    """A new small schema sent ``head_start_s`` after ``num_slow`` slow compiles started; all their answers."""
    slow = [asyncio.create_task(ask_schema(http, slow_schema(), 4)) for _ in range(num_slow)]
    await asyncio.sleep(head_start_s)
    small = await ask_schema(http, small_schema(), max_tokens)
    return small, list(await asyncio.gather(*slow))


async def run_compile_cases(url: str, args: argparse.Namespace, server_log: Callable[[], str]) -> list[str]:
    """The compile cases' lines (see the module's docstring)."""
    lines = []
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.max_seconds)) as http:
        await ask_schema(http, small_schema(), args.max_tokens)  # warm-up: the first compile of the server
        alone = await ask_schema(http, small_schema(), 32)
        lines.append(f"new small schema alone: {alone.describe(server_log())}")
        for num_slow in args.slow_counts:
            small, slow = await new_schema_beside_slow_compiles(http, num_slow, args.compile_head_start, 32)
            lines.append(
                f"new small schema beside {num_slow} slow compile{'s' * (num_slow > 1)}: "
                f"{small.describe(server_log())}; the slow: {'; '.join(answer.describe() for answer in slow)}"
            )
        slow_alone = await ask_schema(http, slow_schema(), 4)
        lines.append(f"a schema xgrammar compiles slowly, alone: {slow_alone.describe(server_log())}")
        predicted = await ask_schema(http, slow_schema(5000), 4)
        lines.append(f"a schema predicted beyond xgrammar's deadline: {predicted.describe(server_log())}")
    return lines


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=4, help="alternations of alone and beside a slow compile")
    parser.add_argument("--max-tokens", type=int, default=16, help="of each valid request")
    parser.add_argument("--invalid-share", type=float, default=0.15)
    parser.add_argument("--disconnect-share", type=float, default=0.05)
    parser.add_argument("--compile-head-start", type=float, default=1.0, help="seconds a slow compile runs first")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="the whole run's bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slow-counts", type=int, nargs="+", default=[1, 2], help="slow compiles beside the new small schema"
    )
    parser.add_argument("--skip-load", action="store_true", help="run the compile cases only")
    parser.add_argument("server_flags", nargs="*", help="extra flags for scheduler.launch (after --)")
    args = parser.parse_args()
    port = free_port()
    server = SchedulerProcess(
        "--port", str(port), "--max-running-requests", "32", "--max-seq-len", "512", "--grammar-compile-timeout",
        "20", *args.server_flags,
    )  # fmt: skip
    tally = Tally()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores (shared with other work: compare runs side by side)")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(url, server.process, server.log, 600.0)
        for line in asyncio.run(run_compile_cases(url, args, server.log)):
            print(line, flush=True)
        if args.skip_load:
            return
        memory = MemoryWatch(server.process.pid)
        started = time.perf_counter()
        try:
            asyncio.run(asyncio.wait_for(run_load(url, args, tally), args.max_seconds))
        except TimeoutError:
            tally.problems.append(f"the run was cut at --max-seconds {args.max_seconds:g}")
        elapsed = time.perf_counter() - started
        is_alive = httpx.get(f"{url}/health", timeout=30).status_code == 200
        memory.stop()
    finally:
        exit_code = server.stop()
    alone, beside = tally.latencies["alone"], tally.latencies["beside"]
    ratio = percentile(beside, 0.5) / percentile(alone, 0.5)
    for problem in tally.problems[:10]:
        print(f"  problem: {problem}")
    print(
        f"load-and-faults: {tally.answered} answered, {tally.lost} lost, {tally.invalid_outputs} invalid outputs, "
        f"{tally.server_errors} server errors ({tally.refused} refused as meant, {tally.disconnects} disconnects, "
        f"{tally.slow_compiles_answered} slow compiles answered) in {elapsed:.0f} s; PSS start/peak/end "
        f"{memory.start:.0f}/{memory.peak:.0f}/{memory.end:.0f} MB; valid p50/p99 alone "
        f"{percentile(alone, 0.5):.2f}/{percentile(alone, 0.99):.2f} s (n={len(alone)}), beside a slow compile "
        f"{percentile(beside, 0.5):.2f}/{percentile(beside, 0.99):.2f} s (n={len(beside)}); p50 ratio {ratio:.2f} "
        f"(target <= 1.5); server {'alive' if is_alive else 'DEAD'}, exit code {exit_code}"
    )


if __name__ == "__main__":
    main()
