"""Replicas behind SGLang's router outlive each other, measured: ``python -m scheduler.launch --dp-size 2 --router
sglang`` under steady load, one replica's server process killed (SIGKILL) mid-run.

``python -m scripts.router_faults [--concurrency 8] [--before-kill 20] [--after-rejoin 15] [--policy round_robin]
[--health-check-interval 5] [-- SERVER FLAGS]`` starts the launcher on a free loopback port, then ``--concurrency``
clients each send one chat request after another through the router: free text, JSON schemas, a regex and a choice,
streamed and not, every answer checked (200, a finish reason, a constrained text its constraint accepts). After
``--before-kill`` seconds replica 0's server process is killed; the load goes on until the launcher has restarted it
and it has answered a request through the router again, then ``--after-rejoin`` seconds more. Prints the CPU first,
then:

- requests sent, answered and valid, failed: those in flight at the kill apart from the rest (which must be none:
  the router retries a request that fails on the dead replica before any byte of its answer, so only a stream
  already under way there can be lost), and invalid answers;
- the surviving replica's generations and how many it aborted (must be none);
- seconds from the kill until: the router's last attempt on the dead replica (its circuit breaker's failure count
  for that worker, ``smg_worker_cb_outcomes_total``, stops growing), that breaker opening and closing again, the
  router's health checks counting it unhealthy (``/readiness``; only if it stays dead past their failure threshold,
  3 checks), the launcher restarting it, it answering ``/health``, the router counting it healthy again, and it
  answering a request again; the router's retries;
- request latency p50/p99 before the kill, from the kill until the rejoin, and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import httpx

from cpu_kernels.cpu_info import describe_cpu
from scheduler.testing.router import ReplicaSet, ReplicaStart, is_healthy, num_generations, router_installed
from scripts.load_and_faults import QUESTION, VALID_KINDS, Kind, percentile

SERVER_FLAGS = ("--max-running-requests", "16", "--max-seq-len", "512")


@dataclass(frozen=True)
class Outcome:
    """One request through the router: when it was sent and ended (``time.monotonic()``), and what went wrong
    (empty: a valid answer)."""

    sent: float
    ended: float
    problem: str = ""


@dataclass
class Timeline:
    """Seconds after the kill at which each step of the recovery was first seen (None: not seen)."""

    killed_at: float = 0.0
    last_dead_attempt: float | None = None
    breaker_open: float | None = None
    breaker_closed: float | None = None
    router_unhealthy: float | None = None
    restarted: float | None = None
    replica_healthy: float | None = None
    router_healthy: float | None = None
    served_again: float | None = None
    restart: ReplicaStart | None = None
    dead_attempts: int = 0

    def mark(self, name: str) -> None:
        if getattr(self, name) is None:
            setattr(self, name, time.monotonic() - self.killed_at)


async def chat(http: httpx.AsyncClient, kind: Kind, stream: bool, max_tokens: int) -> Outcome:
    """One request; its problem is empty when it was answered in full and a constrained answer is valid."""
    body = {"messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": stream, **kind.fields}
    sent = time.monotonic()
    try:
        response = await http.post("/v1/chat/completions", json=body)
        text, finish_reason = read_answer(response, stream)
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Outcome(sent, time.monotonic(), f"{kind.name}{' stream' * stream}: {type(e).__name__}: {e}"[:300])
    if finish_reason is None:
        return Outcome(sent, time.monotonic(), f"{kind.name}{' stream' * stream}: no finish reason")
    if kind.check is not None and finish_reason == "stop" and not kind.check(text):
        return Outcome(sent, time.monotonic(), f"{kind.name}: INVALID {text[:80]!r}")
    return Outcome(sent, time.monotonic())


def read_answer(response: httpx.Response, stream: bool) -> tuple[str, str | None]:
    """``(text, finish reason)``; ``ValueError`` for an error status, an error event or a stream cut short."""
    if response.status_code != 200:
        raise ValueError(f"{response.status_code} {response.text[:200]}")
    if not stream:
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        raise ValueError(f"a stream cut short after {len(events)} events: {events[-1:]!r}")
    chunks = [json.loads(event) for event in events[:-1]]
    errors = [chunk["error"] for chunk in chunks if "error" in chunk]
    if errors:
        raise ValueError(f"streamed error: {errors[0]}")
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    finish = [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]
    return "".join(choice["delta"].get("content") or "" for choice in choices), (finish[-1] if finish else None)


async def warm_up(url: str, max_tokens: int) -> list[Outcome]:
    """Every kind, streamed and not, twice: each replica has compiled the grammars before the load."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        turns = [(kind, stream) for kind in VALID_KINDS for stream in (False, True)] * 2
        return list(await asyncio.gather(*(chat(http, kind, stream, max_tokens) for kind, stream in turns)))


async def load(url: str, args: argparse.Namespace, stop: threading.Event, outcomes: list[Outcome]) -> None:
    """``--concurrency`` clients, each one request after another (kinds and streaming in turn), until ``stop``;
    each outcome appended to ``outcomes``."""
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def client(offset: int) -> None:
            turns = itertools.islice(itertools.cycle(itertools.product(VALID_KINDS, (False, True))), offset, None)
            for kind, stream in turns:
                if stop.is_set():
                    return
                outcomes.append(await chat(http, kind, stream, args.max_tokens))

        await asyncio.gather(*(client(i) for i in range(args.concurrency)))


def router_metric(metrics_text: str, name: str, *labels: str) -> float:
    """The sum of the router's ``name`` samples whose labels include each of ``labels`` (``'worker="..."'``)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith((f"{name}{{", f"{name} ")) and all(label in line for label in labels)
    )


def router_retries(replicas: ReplicaSet) -> int:
    return int(router_metric(httpx.get(replicas.router_metrics_url(), timeout=10).text, "smg_worker_retries_total"))


def watch(replicas: ReplicaSet, killed: ReplicaStart, timeline: Timeline, rejoined: threading.Event) -> None:
    """Sample the recovery every 0.2 s until the restarted replica has answered a request (sets ``rejoined``)."""
    metrics_url = replicas.router_metrics_url()
    worker = f'"{killed.url}"'  # the worker label's value

    def sample() -> tuple[float, float]:
        text = httpx.get(metrics_url, timeout=10).text
        failures = router_metric(text, "smg_worker_cb_outcomes_total", worker, 'outcome="failure"')
        return failures, router_metric(text, "smg_worker_cb_state", worker)

    failures, _ = sample()
    while not rejoined.is_set():
        now_failures, breaker = sample()
        if now_failures > failures:
            timeline.last_dead_attempt = time.monotonic() - timeline.killed_at
            timeline.dead_attempts += int(now_failures - failures)
            failures = now_failures
        if breaker == 1:  # open
            timeline.mark("breaker_open")
        elif breaker == 0 and timeline.breaker_open is not None:  # closed again
            timeline.mark("breaker_closed")
        healthy = replicas.num_healthy()
        if healthy is not None and healthy < replicas.dp_size:
            timeline.mark("router_unhealthy")
        start = replicas.current(killed.index)
        if start.pid != killed.pid:
            timeline.restart = start
            timeline.mark("restarted")
            if timeline.replica_healthy is None and is_healthy(start.url):
                timeline.mark("replica_healthy")
            if timeline.router_unhealthy is not None and healthy == replicas.dp_size:
                timeline.mark("router_healthy")
            if timeline.replica_healthy is not None and num_generations(start.url) > 0:
                timeline.mark("served_again")
                rejoined.set()
                if timeline.breaker_open is not None and timeline.breaker_closed is None:
                    timeline.mark("breaker_closed")  # it served: the breaker let requests through
        time.sleep(0.2)


def aborted_generations(server_url: str) -> int:
    """A server's generations that finished as aborted (its frontend's counter, by finish reason)."""
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    pattern = re.compile(r'^sglang:num_requests_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)', re.MULTILINE)
    return int(sum(float(value) for value in pattern.findall(metrics)))


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24, help="of each request")
    parser.add_argument("--before-kill", type=float, default=20.0, help="seconds of load before the kill")
    parser.add_argument("--after-rejoin", type=float, default=15.0, help="seconds of load after the rejoin")
    parser.add_argument("--policy", default="round_robin", help="the router's (--router-policy)")
    parser.add_argument("--health-check-interval", type=int, default=5, help="the router's, in seconds")
    parser.add_argument("--max-seconds", type=float, default=900.0, help="the recovery's bound")
    parser.add_argument("server_flags", nargs="*", help="extra flags for each replica (after --)")
    args = parser.parse_args()
    if not router_installed():
        raise SystemExit('SGLang\'s router is not installed: pip install -e ".[router]"')
    print(f"CPU: {describe_cpu()}, {os.cpu_count()} cores (shared with other work)", flush=True)
    replicas = ReplicaSet(
        2,
        *SERVER_FLAGS,
        *args.server_flags,
        policy=args.policy,
        health_check_interval_s=args.health_check_interval,
    )
    timeline = Timeline()
    outcomes: list[Outcome] = []
    stop, rejoined = threading.Event(), threading.Event()
    try:
        replicas.wait_for_workers(healthy=2)
        survivor = replicas.current(1)
        problems = [o.problem for o in asyncio.run(warm_up(replicas.url, args.max_tokens)) if o.problem]
        if problems:
            raise SystemExit(f"the warm-up failed: {problems}")
        killed = replicas.current(0)
        retries_before = router_retries(replicas)

        def kill_then_watch() -> None:
            if stop.wait(args.before_kill):
                return
            timeline.killed_at = time.monotonic()
            os.kill(killed.pid, signal.SIGKILL)
            print(f"killed replica 0 (pid {killed.pid}, {killed.url}) after {args.before_kill:g} s of load", flush=True)
            watch(replicas, killed, timeline, rejoined)
            if not stop.wait(args.after_rejoin):
                stop.set()

        watcher = threading.Thread(target=kill_then_watch, daemon=True)
        watcher.start()
        bound = args.before_kill + args.max_seconds + args.after_rejoin
        with contextlib.suppress(TimeoutError):
            asyncio.run(asyncio.wait_for(load(replicas.url, args, stop, outcomes), bound))
        stop.set()
        rejoined.set()
        watcher.join()
        retries = router_retries(replicas) - retries_before
        survivor_answered, survivor_aborted = num_generations(survivor.url), aborted_generations(survivor.url)
    finally:
        stop.set()
        rejoined.set()
        exit_code = replicas.stop()
        replicas.log_path.unlink(missing_ok=True)
    report(outcomes, timeline, retries, survivor_answered, survivor_aborted, exit_code)


def report(
    outcomes: list[Outcome], timeline: Timeline, retries: int, survivor_answered: float, survivor_aborted: int,
    exit_code: int,
) -> None:  # fmt: skip
    kill = timeline.killed_at
    failed = [o for o in outcomes if o.problem]
    in_flight = [o for o in failed if o.sent < kill <= o.ended]
    otherwise = [o for o in failed if not o.sent < kill <= o.ended]
    invalid = [o for o in failed if "INVALID" in o.problem]
    for outcome in failed[:10]:
        print(
            f"  failed {outcome.sent - kill:+.1f} s .. {outcome.ended - kill:+.1f} s after the kill: {outcome.problem}"
        )
    rejoin = kill + (timeline.served_again or float("inf"))
    phases = {
        "before the kill": [o for o in outcomes if o.ended < kill],
        "kill to rejoin": [o for o in outcomes if kill <= o.sent and o.ended < rejoin],
        "after the rejoin": [o for o in outcomes if o.sent >= rejoin],
    }
    latencies = "; ".join(
        f"{name} {percentile([o.ended - o.sent for o in group], 0.5):.2f}/"
        f"{percentile([o.ended - o.sent for o in group], 0.99):.2f} s (n={len(group)})"
        for name, group in phases.items()
    )
    print(
        f"router faults: {len(outcomes)} sent, {len(outcomes) - len(failed)} answered and valid, {len(failed)} failed: "
        f"{len(in_flight)} in flight at the kill, {len(otherwise)} otherwise (target 0); {len(invalid)} invalid. "
        f"Surviving replica: {survivor_answered:.0f} generations, {survivor_aborted} aborted (target 0)."
    )
    print(
        f"from the kill: router's last attempt on the dead replica {seconds(timeline.last_dead_attempt)} "
        f"({timeline.dead_attempts} attempts failed there, {retries} retries in all), its circuit breaker for it opens "
        f"{seconds(timeline.breaker_open)} and closes {seconds(timeline.breaker_closed)}, router counts it unhealthy "
        f"{seconds(timeline.router_unhealthy)}, launcher restarts it {seconds(timeline.restarted)}, it answers /health "
        f"{seconds(timeline.replica_healthy)}, router counts it healthy {seconds(timeline.router_healthy)}, it serves "
        f"again {seconds(timeline.served_again)}; launcher exit code {exit_code}"
    )
    print(f"latency p50/p99: {latencies}")


if __name__ == "__main__":
    main()
