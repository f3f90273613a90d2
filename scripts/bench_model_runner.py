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

from scheduler.model.kv_cache import KVSequence
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


def admitted(runner: ModelRunner, prompt: list[int]) -> KVSequence:
    seq = runner.kv.admit(prompt, max_new_tokens=16)
    assert seq is not None, "the KV pool is too small for the benchmark"
    return seq


def prefill_ms(runner: ModelRunner, prompt: list[int], steps: int) -> float:
    seq = admitted(runner, prompt)

    def prefill() -> None:
        runner.truncate(seq, 0)
        runner.prefill([seq], [prompt])

    ms = median_ms(prefill, steps)
    runner.kv.release(seq)
    runner.kv.flush()
    return ms


def decode_ms(runner: ModelRunner, contexts: list[list[int]], step_tokens: list[int], steps: int) -> float:
    """One decode step over sequences that hold ``contexts``, rolled back after every timed step."""
    seqs = [admitted(runner, context) for context in contexts]
    runner.prefill(seqs, contexts)

    def decode() -> None:
        runner.decode(seqs, step_tokens)
        for seq, context in zip(seqs, contexts, strict=True):
            runner.truncate(seq, len(context))

    ms = median_ms(decode, steps)
    for seq in seqs:
        runner.kv.release(seq)
    runner.kv.flush()
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
    runner = ModelRunner(ServerArgs(max_running_requests=max(args.batches), max_seq_len=512, disable_radix_cache=True))
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
