"""Time the model runner per weight format, side by side: decode steps, k-token extends, a prefill.

    python scripts/bench_model_runner.py [--context 100] [--prompt 40] [--batches 1 8 32] [--extends 1 2 4 8 16]
                                         [--rounds 10] [--llamacpp] [--kv-cache-dtypes float32 ...] [--output PATH]

One runner per ``--weight-dtype`` (and, with ``--kv-cache-dtypes``, one per further ``--kv-cache-dtype`` on the
default weights) (and with ``--llamacpp``, where the extra is installed, the llama.cpp runner on the
GGUF file's quantised weights) holds the same sequences; each round times every measurement once per runner,
alternating which goes first, so their ratio shares the machine's conditions (the median of per-round ratios is
printed). Each decode or extend is rolled back after it is timed. The memory-bandwidth bound is the bytes a
decode step streams (every weight once; for llama.cpp, the GGUF file) over the read bandwidth measured here by summing
a 512 MiB tensor.
Then, for the default format, decode steps and a k=8 extend on each thread count from 1 to the cores (interleaved):
what the runner's thread count is chosen by. Also prints the greedy tokens the formats choose after the benchmark's
prompts, and where they differ.
Writes JSON (default: results/bench_model_runner.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from cpu_kernels.cpu_info import describe_cpu
from scheduler.model import llamacpp_runner
from scheduler.model.runner import ModelRunner
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.prompt_encoder import PromptEncoder
from scheduler.server_args import KV_CACHE_DTYPES, WEIGHT_DTYPES, ModelArgs
from scheduler.testing.runner_greedy import admitted, greedy_tokens
from sglang_constrained.tokenizer.loading import embedded_model_path

GREEDY_PROMPTS = (
    "Invent a person as JSON.",
    "What is your phone number?",
    "Describe a cat in JSON: name, color and age only.",
    "Tell me a fun fact about octopuses.",
    "Write a JSON object for a book with a title, an author and a year.",
)
"""The demo's questions (and one more), as chats: greedy and unconstrained, where formats can part ways."""
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "bench_model_runner.json"
BASELINE = "float32"
DEFAULT_FORMAT = "auto"
LLAMACPP = "llamacpp"


def read_bandwidth_gb_s(rounds: int = 5) -> float:
    """Bytes per second summing a 512 MiB float32 tensor reads (best of ``rounds``): the streaming bound."""
    data = torch.ones(2**27)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * data.element_size() / best / 1e9


def weight_bytes(runner: BaseModelRunner) -> int:
    """What one decode step streams: every matmul weight and the lm_head (llama.cpp: its file)."""
    if not isinstance(runner, ModelRunner):
        return embedded_model_path().stat().st_size
    return runner.model.num_streamed_bytes


class Measurements:
    """Timed calls per (measurement, weight format), gathered round by round."""

    def __init__(self, runners: dict[str, BaseModelRunner]) -> None:
        self.runners = runners
        self.samples: dict[str, dict[str, list[float]]] = {}

    def time(self, name: str, run: Callable[[BaseModelRunner, str], Callable[[], object]], rounds: int) -> None:
        calls = {dtype: run(runner, dtype) for dtype, runner in self.runners.items()}
        for call in calls.values():
            call()  # warm-up
        samples = self.samples.setdefault(name, {dtype: [] for dtype in calls})
        order = list(calls)
        for round_index in range(rounds):
            for dtype in order if round_index % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                calls[dtype]()
                samples[dtype].append((time.perf_counter() - started) * 1e3)

    def summary(self, name: str) -> dict[str, float]:
        samples = self.samples[name]
        row = {f"{dtype}_ms": statistics.median(times) for dtype, times in samples.items()}
        for dtype, times in samples.items():
            if dtype != BASELINE and BASELINE in samples:
                row[f"{dtype}_over_{BASELINE}"] = statistics.median(
                    ours / base for ours, base in zip(times, samples[BASELINE], strict=True)
                )
        return row


def time_thread_counts(
    runner: BaseModelRunner, tokens: Callable[[int], list[int]], context: int, rounds: int
) -> dict[str, dict[int, float]]:
    """Median ms of decode steps (B = 1, 8) and a k = 8 extend per thread count, the counts interleaved."""
    counts = list(range(1, (os.cpu_count() or 1) + 1))
    contexts = [tokens(context) for _ in range(8)]
    seqs = [admitted(runner, ctx, 16) for ctx in contexts]
    runner.prefill(seqs, contexts)
    cases: dict[str, Callable[[], object]] = {
        "decode B=1": lambda: runner.decode(seqs[:1], [5]),
        "decode B=8": lambda: runner.decode(seqs, [5] * 8),
        "extend k=8": lambda: runner.extend(seqs[0], [5] * 8, all_logits=True),
    }
    threads = torch.get_num_threads()
    results: dict[str, dict[int, float]] = {}
    try:
        for name, call in cases.items():
            samples: dict[int, list[float]] = {count: [] for count in counts}
            for round_index in range(rounds + 1):
                for count in counts if round_index % 2 else counts[::-1]:
                    torch.set_num_threads(count)
                    started = time.perf_counter()
                    call()
                    if round_index:  # the first round warms up
                        samples[count].append((time.perf_counter() - started) * 1e3)
                    for seq, ctx in zip(seqs, contexts, strict=True):
                        runner.truncate(seq, len(ctx))
            results[name] = {count: statistics.median(times) for count, times in samples.items()}
            row = results[name]
            cells = "  ".join(f"{count} threads {ms:6.1f} ms" for count, ms in row.items())
            print(f"{DEFAULT_FORMAT}, {name:<11} {cells}  ({counts[-1]} over 1: {row[counts[-1]] / row[1]:.2f})")
    finally:
        torch.set_num_threads(threads)
        for seq in seqs:
            runner.kv.release(seq)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=100, help="cached tokens each sequence holds")
    parser.add_argument("--prompt", type=int, default=40, help="prefill length")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--extends", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--greedy-steps", type=int, default=32)
    parser.add_argument("--llamacpp", action="store_true", help="also the llama.cpp runner (the llamacpp extra)")
    parser.add_argument(
        "--kv-cache-dtypes", nargs="*", default=[], choices=KV_CACHE_DTYPES, help="more runners on the default weights"
    )
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    base = ModelArgs(
        max_running_requests=max(*args.batches, 8), max_seq_len=max(512, args.context + 32), disable_radix_cache=True
    )
    runners: dict[str, BaseModelRunner] = {
        dtype: ModelRunner(replace(base, weight_dtype=dtype)) for dtype in (BASELINE, *WEIGHT_DTYPES)
    }
    for kv in args.kv_cache_dtypes:
        runners[f"KV {kv}"] = ModelRunner(replace(base, weight_dtype=DEFAULT_FORMAT, kv_cache_dtype=kv))
    if args.llamacpp:
        if not llamacpp_runner.is_available():
            parser.error("--llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'")
        # The benchmark keeps every sequence it admits: one llama.cpp sequence id each.
        num_sequences = 2 + sum(args.batches) + len(args.extends)
        llamacpp_args = replace(base, model_runner=LLAMACPP, max_running_requests=num_sequences, max_total_tokens=8192)
        runners[LLAMACPP] = llamacpp_runner.LlamaCppModelRunner(llamacpp_args)
    bandwidth = read_bandwidth_gb_s()
    print(f"CPU {describe_cpu()}; torch threads {torch.get_num_threads()}; read bandwidth {bandwidth:.1f} GB/s")
    bounds = {}
    for dtype, runner in runners.items():
        streamed = weight_bytes(runner)
        bounds[dtype] = streamed / bandwidth / 1e6
        print(f"{dtype:>9}: a decode step streams {streamed / 2**20:.0f} MiB of weights: bound {bounds[dtype]:.1f} ms")

    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 20000, (n,), generator=generator).tolist()

    measurements = Measurements(runners)
    prompt = tokens(args.prompt)

    def prefill(runner: BaseModelRunner, _: str) -> Callable[[], object]:
        seq = admitted(runner, prompt, 1)

        def call() -> None:
            runner.truncate(seq, 0)
            runner.prefill([seq], [prompt])

        return call

    measurements.time(f"prefill {args.prompt}", prefill, args.rounds)
    for batch in args.batches:
        contexts = [tokens(args.context) for _ in range(batch)]
        step = tokens(batch)

        def decode(
            runner: BaseModelRunner, _: str, contexts: list[list[int]] = contexts, step: list[int] = step
        ) -> Callable[[], object]:
            seqs = [admitted(runner, context, 16) for context in contexts]
            runner.prefill(seqs, contexts)

            def call() -> None:
                runner.decode(seqs, step)
                for seq, context in zip(seqs, contexts, strict=True):
                    runner.truncate(seq, len(context))

            return call

        measurements.time(f"decode B={batch}", decode, args.rounds)
    context = tokens(args.context)
    for k in args.extends:
        drafts = tokens(k)

        def extend(runner: BaseModelRunner, _: str, drafts: list[int] = drafts) -> Callable[[], object]:
            seq = admitted(runner, context, 16)
            runner.prefill([seq], [context])

            def call() -> None:
                runner.extend(seq, drafts, all_logits=True)
                runner.truncate(seq, len(context))

            return call

        measurements.time(f"extend k={k}", extend, args.rounds)

    rows = {}
    for name in measurements.samples:
        rows[name] = row = measurements.summary(name)
        cells = "  ".join(f"{dtype} {row[f'{dtype}_ms']:7.1f} ms" for dtype in runners)
        ratios = "  ".join(f"{key} {value:.2f}" for key, value in row.items() if "_over_" in key)
        print(f"{name:<14} {cells}  {ratios}")

    thread_rows = time_thread_counts(runners[DEFAULT_FORMAT], tokens, args.context, args.rounds)

    greedy_report = []
    encoder = PromptEncoder(runners[BASELINE].tokenizer, runners[BASELINE].vocab_size, base.max_seq_len)
    for question in GREEDY_PROMPTS:
        prompt = encoder.encode(messages=[{"role": "user", "content": question}])
        chosen = {dtype: greedy_tokens(runner, prompt, args.greedy_steps) for dtype, runner in runners.items()}
        first_difference = next(
            (i for i, pair in enumerate(zip(*chosen.values(), strict=True)) if len(set(pair)) > 1), None
        )
        greedy_report.append({"prompt": question, "first_difference": first_difference, "tokens": chosen})
        where = "all" if first_difference is None else f"the first {first_difference}"
        print(f"greedy, {question!r}: the formats choose the same token in {where} of {args.greedy_steps} steps")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "cpu": describe_cpu(),
        "bandwidth_gb_s": bandwidth,
        "bound_ms": bounds,
        "rows": rows,
        "threads": thread_rows,
        "greedy": greedy_report,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
