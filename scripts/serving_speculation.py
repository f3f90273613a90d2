"""Speculation on against off in the serving benchmark (``--compare-speculation``): the schedulers' draft counters
(from their ``Pong``), and the lines that compare the two schedulers' rows."""

from __future__ import annotations

import statistics
from typing import Any

from scheduler.client import AsyncSchedulerClient
from scripts.serving_workload import KINDS

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
