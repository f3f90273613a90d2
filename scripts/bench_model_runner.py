"""Time the model runner on this machine: prefill of one prompt, and one decode step at several batch sizes.

    python scripts/bench_model_runner.py [--context 100] [--prompt 40] [--batches 1 8 32] [--steps 10] [--threads N]

Each decode sequence first holds ``--context`` cached tokens; every figure is the median over ``--steps`` calls.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from scheduler.model.runner import ModelRunner
from scheduler.server_args import ServerArgs


def median_ms(run: Callable[[], object], steps: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def prefill_ms(runner: ModelRunner, prompt: list[int], steps: int) -> float:
    slot = runner.allocate_slot()

    def prefill() -> None:
        runner.truncate(slot, 0)
        runner.prefill([slot], [prompt])

    ms = median_ms(prefill, steps)
    runner.free_slot(slot)
    return ms


def decode_ms(runner: ModelRunner, contexts: list[list[int]], step_tokens: list[int], steps: int) -> float:
    """One decode step over sequences that hold ``contexts``, rolled back after every timed step."""
    slots = [runner.allocate_slot() for _ in contexts]
    runner.prefill(slots, contexts)

    def decode() -> None:
        runner.decode(slots, step_tokens)
        for slot, context in zip(slots, contexts, strict=True):
            runner.truncate(slot, len(context))

    ms = median_ms(decode, steps)
    for slot in slots:
        runner.free_slot(slot)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--prompt", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(ServerArgs(max_running_requests=max(args.batches), max_seq_len=512))
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 20000, (n,), generator=generator).tolist()

    print(f"torch threads: {torch.get_num_threads()}")
    print(f"prefill {args.prompt} tokens: {prefill_ms(runner, tokens(args.prompt), args.steps):.1f} ms")
    for batch in args.batches:
        contexts = [tokens(args.context) for _ in range(batch)]
        ms = decode_ms(runner, contexts, tokens(batch), args.steps)
        print(f"decode batch {batch:3d} at context {args.context}: {ms:.1f} ms/step, {1000 * batch / ms:.0f} tok/s")


if __name__ == "__main__":
    main()
