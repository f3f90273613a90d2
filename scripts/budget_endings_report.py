"""Budget-aware constraints with the embedded model: greedy answers to the vendored MaskBench schemas under small
token budgets, through the scheduler's loop in this process, counted by how each ended.

    python -m scripts.budget_endings_report [--backends xgrammar llguidance] [--budgets 24 40]
                                            [--folders Github_easy Glaiveai2K] [--limit 200] [--concurrency 16]

Per backend and budget, the schemas' requests all sent at once: answers that end valid with "stop" (judged as the
tests judge, ``json_judge``: formats and patterns included), requests refused up front (a budget below the schema's
shortest output), constraints the backend refuses, answers cut at their budget ("length": no ending was found from
the grammar's start, so the request went unsteered) and answers that end with "stop" yet do not validate (must be 0).
Each cut or invalid answer is printed with its case. Prints the CPU model first.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from cpu_kernels.cpu_info import describe_cpu
from scheduler.client import make_request
from scheduler.io_struct import AbortCause, GenerateOutput
from scheduler.model.runner import ModelRunner
from scheduler.scheduler import Scheduler
from scheduler.server_args import ServerArgs
from scheduler.testing.in_process import submit, turn_until_finished
from sglang_constrained.testing.maskbench import iter_case_paths, load_case
from sglang_constrained.testing.random_walk import json_judge

MASKBENCH = Path(__file__).resolve().parents[1] / "tests" / "data" / "maskbench"
PROMPT = "Answer with one JSON object that follows this schema: {schema}"
MAX_PROMPT_SCHEMA_CHARS = 300
MAX_SECONDS = 1800.0


def outcome(output: GenerateOutput, schema: Any) -> str:
    """How one answer ended: valid, refused, invalid constraint, cut, or invalid."""
    reason = output.finish_reason
    assert reason is not None
    if reason.type == "abort":
        if reason.cause is None:
            return "aborted"
        names = {AbortCause.BAD_REQUEST: "refused", AbortCause.INVALID_CONSTRAINT: "invalid constraint"}
        return names.get(reason.cause, f"aborted ({reason.cause.name})")
    if reason.type == "length":
        return "cut"
    return "valid" if json_judge(schema)(output.text) is None else "INVALID"


def run(scheduler: Scheduler, cases: list[tuple[str, Any]], budget: int) -> Counter[str]:
    """Every case's request at once through ``scheduler``'s loop; the count of each outcome."""
    sent: dict[str, tuple[str, Any]] = {}
    requests = []
    for name, schema in cases:
        prompt = PROMPT.format(schema=json.dumps(schema)[:MAX_PROMPT_SCHEMA_CHARS])
        params = {"temperature": 0.0, "max_new_tokens": budget, "json_schema": json.dumps(schema)}
        requests.append(make_request(messages=[{"role": "user", "content": prompt}], sampling_params=params))
        sent[requests[-1].rid] = (name, schema)
    submit(scheduler, requests)
    finished = turn_until_finished(scheduler, list(sent), MAX_SECONDS)
    counts: Counter[str] = Counter()
    for rid, (name, schema) in sent.items():
        ended = outcome(finished[rid], schema)
        counts[ended] += 1
        if ended in ("cut", "INVALID"):
            print(f"  {ended} {name}: {finished[rid].text[-160:]!r}")
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[24, 40])
    parser.add_argument("--folders", nargs="+", default=["Github_easy", "Glaiveai2K"])
    parser.add_argument("--limit", type=int, default=200, help="most schemas")
    parser.add_argument("--concurrency", type=int, default=16, help="--max-running-requests of the scheduler")
    args = parser.parse_args(argv)
    print(describe_cpu())
    paths = [path for folder in args.folders for path in iter_case_paths(MASKBENCH, folder)][: args.limit]
    cases = [(path.stem, load_case(path).schema) for path in paths]
    runner = ModelRunner(ServerArgs.of(max_running_requests=args.concurrency).model)
    for backend in args.backends:
        for budget in args.budgets:
            runner.kv.flush()
            scheduler = Scheduler(ServerArgs.of(grammar_backend=backend, max_running_requests=args.concurrency), runner)
            try:
                counts = run(scheduler, cases, budget)
            finally:
                scheduler.shutdown(None)
            shown = ", ".join(f"{name} {count}" for name, count in sorted(counts.items()))
            print(f"{backend} budget {budget}: {len(cases)} schemas: {shown}", flush=True)


if __name__ == "__main__":
    main()
