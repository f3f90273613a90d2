"""OpenAI's predicted outputs on an edit workload: the same requests with and without a ``prediction``, side by side.

    python scripts/bench_predicted_outputs.py [--rounds 3] [--concurrency 1] [--flags ...] [--output PATH]

Two edits of a document the prompt holds, greedy, on one scheduler (the server's defaults, or ``--flags``): change
one field of a ~300-token JSON object under its schema, and rename a variable in a code block; the prediction is the
document as it was (what a client sends: the answer is expected to repeat most of it). Each round runs every
workload without and with the prediction, alternating which goes first, each on an empty prefix cache; with
``--concurrency C`` C copies run at once. Prints, per workload, output tok/s (from the request's send to its end, so
the prompt's prefill is in it), decode tok/s (after the first token), forwards per output token (the scheduler's
counter), the drafts that stood (of every source), the prediction's accepted and rejected tokens, whether the
outputs are identical (they must be), and the ratios with / without (medians of per-round ratios). Prompt lookup
drafts from the prompt, which holds the document, in both columns: the prediction's gain is over that. Writes JSON
(default: results/bench_predicted_outputs.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cpu_kernels.cpu_info import describe_cpu
from scheduler.client import AsyncSchedulerClient
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.testing.benchmarking import cpu_pressure

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "bench_predicted_outputs.json"

EMPLOYEE: dict[str, Any] = {
    "id": "emp-20417",
    "name": "Maria Gonzalez",
    "email": "maria.gonzalez@example.com",
    "title": "Senior Data Engineer",
    "department": "Analytics",
    "manager": "David Chen",
    "start_date": "2019-03-11",
    "office": {"building": "North Tower", "floor": 12, "city": "Madrid", "country": "Spain"},
    "skills": ["Python", "SQL", "Spark", "Airflow", "Kubernetes"],
    "projects": [
        {"name": "Customer churn model", "status": "active", "hours": 320},
        {"name": "Data lake migration", "status": "done", "hours": 540},
        {"name": "Realtime dashboards", "status": "planned", "hours": 80},
    ],
    "salary_band": "E4",
    "remote": False,
    "languages": ["Spanish", "English", "French"],
    "emergency_contact": {"name": "Luis Gonzalez", "phone": "+34 600 123 456"},
}
ORDERS_CODE = """def summarize_orders(orders, tax_rate):
    total = 0.0
    count = 0
    for order in orders:
        if order["status"] == "cancelled":
            continue
        total += order["price"] * order["quantity"]
        count += 1
    average = total / count if count else 0.0
    total_with_tax = total * (1 + tax_rate)
    return {
        "count": count,
        "total": total,
        "average": average,
        "total_with_tax": total_with_tax,
    }
"""


@dataclass(frozen=True)
class Workload:
    name: str
    request: dict[str, Any]
    """``AsyncSchedulerClient.stream`` arguments (``prediction`` aside)."""
    prediction: str


@dataclass
class Run:
    """One request's measurements."""

    seconds: float
    decode_seconds: float
    num_tokens: int
    num_forwards: int
    accepted: int
    rejected: int
    num_drafted: int
    num_drafts_stood: int
    token_ids: list[int]


def schema_of(value: Any) -> dict[str, Any]:
    """The JSON schema of an example value: its types, every key required, nothing else allowed."""
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0])}
    properties = {key: schema_of(item) for key, item in value.items()}
    return {"type": "object", "properties": properties, "required": list(value), "additionalProperties": False}


def workloads() -> list[Workload]:
    document = json.dumps(EMPLOYEE, indent=2)
    code = f"```python\n{ORDERS_CODE}```"
    json_edit = {
        "messages": [
            {
                "role": "user",
                "content": f"Here is a JSON object:\n{document}\nChange the office city to Lima and give back the "
                "whole object, unchanged otherwise.",
            }
        ],
        "sampling_params": {"json_schema": schema_of(EMPLOYEE), "max_new_tokens": 512, "temperature": 0},
    }
    rename = {
        "messages": [
            {
                "role": "user",
                "content": f"Rename the variable `total` to `subtotal` in this Python code and give back the whole "
                f"code:\n{code}",
            }
        ],
        "sampling_params": {"max_new_tokens": 400, "temperature": 0},
    }
    return [Workload("json field edit", json_edit, document), Workload("code rename", rename, code)]


async def run_one(client: AsyncSchedulerClient, request: dict[str, Any]) -> tuple[float, float, Any, list[int]]:
    """(seconds to the end, seconds after the first token, final output, all token ids) of one streamed request."""
    started = time.perf_counter()
    first_token_at = None
    token_ids: list[int] = []
    final = None
    async for output in client.stream(**request):
        if output.token_ids and first_token_at is None:
            first_token_at = time.perf_counter()
        token_ids += output.token_ids
        final = output
    ended = time.perf_counter()
    if final is None or final.finish_reason is None or final.finish_reason.type == "abort":
        raise RuntimeError(f"the request failed: {final}")
    return ended - started, ended - (first_token_at or ended), final, token_ids


async def measure(client: AsyncSchedulerClient, request: dict[str, Any], concurrency: int) -> Run:
    """``concurrency`` copies of ``request`` at once on an empty prefix cache; seconds are the slowest copy's."""
    done = await client.flush_cache()
    if not done.success:
        raise RuntimeError(done.message)
    before = await client.wait_until_ready()
    results = await asyncio.gather(*(run_one(client, request) for _ in range(concurrency)))
    after = await client.wait_until_ready()
    token_ids = results[0][3]
    if any(ids != token_ids for *_, ids in results):
        raise RuntimeError("copies of one greedy request gave different outputs")
    return Run(
        seconds=max(seconds for seconds, *_ in results),
        decode_seconds=max(decode for _, decode, *_ in results),
        num_tokens=sum(len(ids) for *_, ids in results),
        num_forwards=after.num_forwards - before.num_forwards,
        accepted=sum(final.usage.accepted_prediction_tokens for _, _, final, _ in results),
        rejected=sum(final.usage.rejected_prediction_tokens for _, _, final, _ in results),
        num_drafted=sum(after.drafts_proposed.values()) - sum(before.drafts_proposed.values()),
        num_drafts_stood=sum(after.drafts_accepted.values()) - sum(before.drafts_accepted.values()),
        token_ids=token_ids,
    )


def tok_s(run: Run) -> float:
    return run.num_tokens / run.seconds


def decode_tok_s(run: Run, concurrency: int) -> float:
    return (run.num_tokens - concurrency) / run.decode_seconds if run.decode_seconds else float("nan")


def forwards_per_token(run: Run) -> float:
    return run.num_forwards / run.num_tokens


def summary_line(name: str, concurrency: int, plain: list[Run], predicted: list[Run]) -> str:
    def ratio(metric: Any) -> float:
        return statistics.median(metric(p) / metric(q) for p, q in zip(predicted, plain, strict=True))

    def median(runs: list[Run], metric: Any) -> float:
        return statistics.median(metric(run) for run in runs)

    def decode(run: Run) -> float:
        return decode_tok_s(run, concurrency)

    def stood(run: Run) -> str:
        return f"{run.num_drafts_stood}/{run.num_drafted}"

    identical = all(p.token_ids == q.token_ids for p, q in zip(predicted, plain, strict=True))
    last = predicted[-1]
    return (
        f"{name} C={concurrency} ({plain[-1].num_tokens // concurrency} tokens): "
        f"without {median(plain, tok_s):.1f} tok/s, decode {median(plain, decode):.1f} tok/s, "
        f"{median(plain, forwards_per_token):.3f} forwards/token | "
        f"with {median(predicted, tok_s):.1f} tok/s, decode {median(predicted, decode):.1f} tok/s, "
        f"{median(predicted, forwards_per_token):.3f} forwards/token | "
        f"with/without: tok/s {ratio(tok_s):.2f}x, decode tok/s {ratio(decode):.2f}x, "
        f"forwards/token {ratio(forwards_per_token):.2f}x | "
        f"drafts that stood: without {stood(plain[-1])}, with {stood(last)} | "
        f"prediction accepted {last.accepted // concurrency}, rejected {last.rejected // concurrency} | "
        f"outputs identical: {'yes' if identical else 'NO'}"
    )


async def bench(server: SchedulerProcess, args: argparse.Namespace) -> list[dict[str, Any]]:
    client = AsyncSchedulerClient(server.endpoint)
    results = []
    try:
        await client.wait_until_ready()
        for concurrency in args.concurrency:
            for workload in workloads():
                plain: list[Run] = []
                predicted: list[Run] = []
                with_prediction = {**workload.request, "prediction": workload.prediction}
                for round_index in range(args.rounds):
                    sides = [(plain, workload.request), (predicted, with_prediction)]
                    for runs, request in sides if round_index % 2 == 0 else sides[::-1]:
                        runs.append(await measure(client, request, concurrency))
                line = summary_line(workload.name, concurrency, plain, predicted)
                print(line, flush=True)
                results.append(
                    {
                        "workload": workload.name,
                        "concurrency": concurrency,
                        "line": line,
                        "without": [asdict(run) | {"token_ids": None} for run in plain],
                        "with": [asdict(run) | {"token_ids": None} for run in predicted],
                    }
                )
    finally:
        await client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="scheduler flags (last)")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    pressure = cpu_pressure()
    print(
        f"CPU {describe_cpu()}, {os.cpu_count()} cores; CPU pressure (some, avg60) "
        f"{'n/a' if pressure is None else f'{pressure:.2f}'}; scheduler flags {args.flags or 'defaults'}; "
        f"{args.rounds} rounds",
        flush=True,
    )
    server = SchedulerProcess(*args.flags)
    try:
        server.wait_until_ready()
        results = asyncio.run(bench(server, args))
    finally:
        server.stop()
        server.log_path.unlink(missing_ok=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"cpu": describe_cpu(), "cpu_pressure": pressure, "flags": args.flags, "results": results}
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
