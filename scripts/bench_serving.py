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
``--peer vllm --vllm-venv PATH`` runs our server's HTTP API against vLLM's (from that virtual environment), phase by
phase, at vLLM's defaults and with both cores bound, and prints a table of ours over vLLM (``scripts/vllm_peer.py``,
whose docstring has vLLM's set-up);
``--model-runner llamacpp`` runs our schedulers on llama.cpp's kernels too (``scheduler.model.llamacpp_runner``).
``--ranks`` runs the benchmarks of several ranks instead: data parallel (``scripts/bench_dp.py``: 2 replicas x 1
thread against 1 rank x 2 threads, JSON at concurrency 16, and grammar compiles per distinct schema) and tensor
parallel (``scripts/bench_tp.py``: per-token latency and memory per rank, tp=1 against tp=2).
``--compare-budget`` starts two schedulers, budget-aware constraints off (``--disable-budget-aware-constraints``:
outputs cut at the token limit) and on (steered to end inside it), and runs every kind on both back to back: the valid
and cut counts of each are the feature's effect, its tokens/s and time per token its cost.
``--compare-speculation`` starts two schedulers, ``--speculative-algorithm none`` and the default, runs every
kind on both back to back, and prints speculation on over off, JSON on over free off, forwards per token and, per
draft source, the acceptance rate and mean accepted run (from the schedulers' counters).

    python -m scripts.bench_serving [--backend xgrammar] [--concurrency 1 8 32] [--max-new-tokens 72] [--profile]
                                    [--peer llamacpp] [--model-runner llamacpp] [--compare-speculation]
                                    [--compare-budget]
                                    [--peer vllm --vllm-venv /tmp/vllm-venv]
                                    [--temperature 0.7] [--model-path FILE.gguf]
    python -m scripts.bench_serving --ranks

The requests and their summaries: ``scripts.serving_workload``; speculation on against off:
``scripts.serving_speculation``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import pstats
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from scheduler.client import AsyncSchedulerClient
from scheduler.server_args import MODEL_RUNNERS
from scheduler.startup_heap import freeze_startup_heap
from scheduler.testing.process import free_port, wait_until_healthy
from scripts import vllm_peer
from scripts.bench_dp import run_dp_benchmark
from scripts.bench_tp import run_tp_benchmark
from scripts.serving_speculation import (
    SPECULATION_LABELS,
    ZERO_COUNTERS,
    counters_delta,
    counters_sum,
    speculation_counters,
    speculation_lines,
)
from scripts.serving_workload import (
    KINDS,
    PERSON_REGEX,
    PERSON_SCHEMA,
    WARM_UP_INDEX,
    WARM_UP_TOKENS,
    Outcome,
    format_peer_ratio,
    format_ratio,
    format_row,
    run_kind,
    run_one,
    run_peer,
    summarise,
)
from sglang_constrained.testing import llamacpp_peer
from sglang_constrained.testing.benchmarking import cpu_pressure

BUDGET_LABELS = ("budget-off", "budget-on")
"""``--compare-budget``: the scheduler with budget-aware constraints off, and on (the default)."""
REPO = Path(__file__).resolve().parents[1]


async def bench(endpoints: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every kind on every scheduler (``endpoints``: label -> address), back to back, round after round."""
    peer = None
    if args.peer == "llamacpp":
        if not llamacpp_peer.is_available():
            raise SystemExit("--peer llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'")
        peer = llamacpp_peer.LlamaCppPeer(
            os.cpu_count() or 1, PERSON_SCHEMA, model_path=args.model_path, temperature=args.temperature
        )
    clients = {label: AsyncSchedulerClient(endpoint) for label, endpoint in endpoints.items()}
    for label, client in clients.items():
        pong = await client.wait_until_ready(timeout_s=600)
        print(f"scheduler {label or ''} ready: {pong.model}, grammar backend {pong.grammar_backend}")
        for kind in KINDS:  # compile and cache the grammars, warm every path once
            await run_one(client, kind, WARM_UP_INDEX, WARM_UP_TOKENS)
    freeze_startup_heap()  # this process's own full collection paused it ~200 ms mid-run, inside the timed requests
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


PROFILED_LAUNCH = (
    "import cProfile, sys; from scheduler.launch import exit_now, main; profile = cProfile.Profile(); "
    "code = profile.runcall(main, sys.argv[2:]); profile.dump_stats(sys.argv[1]); exit_now(code)"
)
"""``python -c PROFILED_LAUNCH <profile path> <launch flags>``: the launcher under cProfile, its stats written before
``exit_now`` ends the process (``python -m cProfile`` would write nothing: the launcher leaves by ``os._exit``)."""

STEP_PARTS = (
    ("step (whole loop turn)", "scheduler.scheduler", "Scheduler.step"),
    ("grammar admission", "scheduler.grammar_manager", "GrammarManager.get_ready_grammar_requests"),
    ("prefill batches", "scheduler.batch_executor", "BatchExecutor.prefill"),
    ("decode batches", "scheduler.batch_executor", "BatchExecutor.decode"),
    ("drafts (propose)", "scheduler.speculative", "DraftProposer.propose"),
    ("model forward", "scheduler.model.runner_contract", "BaseModelRunner.forward"),
    ("sampling tensors (prepare)", "scheduler.sampling_batch_info", "SamplingBatchInfo.prepare"),
    (
        "mask fill (update_regex_vocab_mask)",
        "scheduler.sampling_batch_info",
        "SamplingBatchInfo.update_regex_vocab_mask",
    ),
    ("mask apply (apply_logits_bias)", "scheduler.sampling_batch_info", "SamplingBatchInfo.apply_logits_bias"),
    ("sample", "scheduler.sampler", "sample"),
    ("budget steering (steer: rows near the budget)", "scheduler.budget_steering", "BudgetSteering.steer"),
    ("budget checks (a sampled choice within WATCH)", "scheduler.budget_steering", "BudgetSteering.refused_samples"),
    ("budget plans (record: follow the output)", "scheduler.budget_steering", "BudgetSteering.record"),
    ("budget refusal (start's ending, once per schema)", "scheduler.budget_steering", "BudgetSteering.refusal"),
    ("accept token, grammar, finish (_accept)", "scheduler.batch_executor", "BatchExecutor._accept"),
    ("stream chunks (_after_batch)", "scheduler.scheduler", "Scheduler._after_batch"),
    ("finish (_finish)", "scheduler.scheduler", "Scheduler._finish"),
)
"""The parts of a loop turn ``--profile`` reports: (label, module, function's qualified name). Each names one function
of its module (``tests/unit/test_serving_profile.py`` fails when one is renamed or moved); the profile finds it by
its file and name."""


def print_profile(path: Path, limit: int) -> dict[str, dict[str, float]]:
    """Where the scheduler's loop spent its time (cumulative seconds per part), then its heaviest functions."""
    stats = pstats.Stats(str(path), stream=sys.stdout)
    cumulative = {(file, name): (calls, seconds) for (file, _, name), (_, calls, _, seconds, _) in stats.stats.items()}  # type: ignore[attr-defined]
    parts = {}
    for label, module, qualname in STEP_PARTS:
        suffix, name = module.replace(".", "/") + ".py", qualname.rsplit(".", 1)[-1]
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
    parser.add_argument("--model-runner", choices=MODEL_RUNNERS, default="exact", help="the schedulers' engine")
    parser.add_argument(
        "--peer", choices=["llamacpp", "vllm"], default=None, help="also run the requests through llama.cpp or vLLM"
    )
    parser.add_argument("--vllm-venv", type=Path, default=None, help="--peer vllm: the virtual environment of vLLM")
    parser.add_argument(
        "--compare-speculation", action="store_true", help="speculation off and on, two schedulers side by side"
    )
    parser.add_argument(
        "--compare-budget",
        action="store_true",
        help="budget-aware constraints off and on (--disable-budget-aware-constraints), two schedulers side by side",
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="0 for greedy requests")
    parser.add_argument(
        "--model-path", type=Path, default=None, help="a GGUF file for ours and --peer llamacpp (default: embedded)"
    )
    parser.add_argument("--ranks", action="store_true", help="data- and tensor-parallel ranks against one rank")
    parser.add_argument("--output", type=Path, default=None, help="default: results/bench_serving_<backend>.json")
    args = parser.parse_args(argv)
    if args.ranks:
        for line in [*run_dp_benchmark(backend=args.backend), *run_tp_benchmark()]:
            print(line)
        return
    if args.model_path is not None and (args.peer == "vllm" or args.ranks):
        parser.error("--model-path is for our scheduler and --peer llamacpp, not --peer vllm or --ranks")
    if args.compare_speculation and args.compare_budget:
        parser.error("--compare-speculation and --compare-budget each start two schedulers: one at a time")
    if args.peer == "vllm" and (args.vllm_venv is None or args.compare_speculation):
        parser.error("--peer vllm needs --vllm-venv PATH (set-up: scripts/vllm_peer.py), not --compare-speculation")
    needed = sum(args.rounds * len(KINDS) * max(args.min_requests, args.waves * c) for c in args.concurrency)
    if args.peer == "vllm":
        needed = vllm_peer.requests_per_server(args)
    if needed >= WARM_UP_INDEX:
        parser.error(
            f"{needed} requests per scheduler, but only {WARM_UP_INDEX} distinct prompts: fewer rounds or waves"
        )
    results_dir = REPO / "results"
    results_dir.mkdir(exist_ok=True)
    runner_suffix = "" if args.model_runner == "exact" else f"_{args.model_runner}"
    peer_suffix = "_vllm" if args.peer == "vllm" else ""
    output = args.output or results_dir / f"bench_serving_{args.backend}{runner_suffix}{peer_suffix}.json"
    labels = SPECULATION_LABELS if args.compare_speculation else BUDGET_LABELS if args.compare_budget else ("",)
    ports = {label: free_port() for label in labels}
    http_port = free_port()  # --peer vllm: both servers are driven over HTTP
    profile_path = results_dir / f"bench_serving_{args.backend}.prof"
    log_path = results_dir / f"bench_serving_{args.backend}.log"
    servers = []
    with log_path.open("w") as log:
        for label, port in ports.items():
            flags = ["--zmq-port", str(port), "--grammar-backend", args.backend]
            flags += ["--max-running-requests", str(max(args.concurrency)), "--log-level", "warning"]
            flags += ["--model-runner", args.model_runner]
            if args.model_path is not None:
                flags += ["--model-path", str(args.model_path)]
            if args.peer == "vllm":
                flags += ["--port", str(http_port)]
            if label == BUDGET_LABELS[0]:
                flags += ["--disable-budget-aware-constraints"]
            if label in SPECULATION_LABELS:
                flags += ["--speculative-algorithm", "none" if label == SPECULATION_LABELS[0] else "grammar+ngram"]
            is_profiled = args.profile and label == labels[-1]
            launch = ["-c", PROFILED_LAUNCH, str(profile_path)] if is_profiled else ["-m", "scheduler.launch"]
            servers.append(subprocess.Popen([sys.executable, *launch, *flags], cwd=REPO, stderr=log))
        try:
            if args.peer == "vllm":
                url = f"http://127.0.0.1:{http_port}"
                started = functools.partial(
                    wait_until_healthy, url, servers[0], log_path.read_text, vllm_peer.HEALTH_TIMEOUT_S
                )
                rows = asyncio.run(vllm_peer.compare(url, started, args, results_dir))
            else:
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
    report |= {"temperature": args.temperature, "compare_speculation": args.compare_speculation, "peer": args.peer}
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
