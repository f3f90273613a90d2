"""Time applying token bitmasks on CPU: our paths against the torch reference and xgrammar's CPU kernel.

For every batch size, vocab size and mask kind, the implementations run interleaved (order rotated each
round) on the same logits and masks, so their ratios share the machine's conditions. Logits are restored
between calls, outside the timed region. Prints a table and writes JSON (default:
results/bench_apply_mask.json).

    python scripts/bench_apply_mask.py [--rounds 15] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xgrammar

from triton_ops import (
    apply_token_bitmask_inplace_cpu,
    apply_token_bitmask_inplace_cpu_eager,
    apply_token_bitmask_inplace_reference,
    warm_up_cpu_bitmask_kernel,
)

BATCH_SIZES = (1, 8, 64)
VOCAB_SIZES = (49_152, 248_320)
MASK_KINDS = ("random", "sparse_1pct")
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "bench_apply_mask.json"


def apply_xgrammar_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    xgrammar.apply_token_bitmask_inplace(logits, bitmask)


IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "ours_compiled": apply_token_bitmask_inplace_cpu,
    "ours_eager": apply_token_bitmask_inplace_cpu_eager,
    "torch_reference": apply_token_bitmask_inplace_reference,
    "xgrammar_cpu": apply_xgrammar_cpu,
}


def make_bitmask(batch: int, vocab: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """``random``: every bit a coin flip. ``sparse_1pct``: each token allowed with probability 1%, as in JSON."""
    num_words = (vocab + 31) // 32
    if kind == "random":
        return torch.randint(-(2**31), 2**31, (batch, num_words), dtype=torch.int32, generator=generator)
    allowed = torch.rand(batch, num_words, 32, generator=generator) < 0.01
    words = (allowed.long() << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def time_config(batch: int, vocab: int, kind: str, rounds: int) -> dict[str, float]:
    """Median milliseconds per implementation; checks first that all of them produce the same logits."""
    generator = torch.Generator().manual_seed(batch * vocab)
    source = torch.randn(batch, vocab, generator=generator)
    bitmask = make_bitmask(batch, vocab, kind, generator)
    expected = source.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask)
    logits = source.clone()
    for name, apply in IMPLEMENTATIONS.items():
        logits.copy_(source)
        apply(logits, bitmask)
        if not torch.equal(logits, expected):
            raise AssertionError(f"{name} disagrees with the reference at batch={batch} vocab={vocab} {kind}")
    names = list(IMPLEMENTATIONS)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            logits.copy_(source)
            start = time.perf_counter()
            IMPLEMENTATIONS[name](logits, bitmask)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per implementation and configuration")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    warm_up_start = time.perf_counter()
    is_compiled = warm_up_cpu_bitmask_kernel(VOCAB_SIZES[0], torch.float32)
    warm_up_seconds = time.perf_counter() - warm_up_start
    print(
        f"warm-up {warm_up_seconds:.1f} s (compiled kernel in use: {is_compiled}); "
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    header = f"{'batch':>5} {'vocab':>7} {'mask':>11} " + " ".join(f"{name:>15}" for name in IMPLEMENTATIONS)
    print(header + f" {'ref/ours':>9} {'xgr/ours':>9}   (median ms)")
    results = []
    for vocab in VOCAB_SIZES:
        for batch in BATCH_SIZES:
            for kind in MASK_KINDS:
                medians = time_config(batch, vocab, kind, args.rounds)
                ours = medians["ours_compiled"]
                ratios = {
                    "reference_over_ours": medians["torch_reference"] / ours,
                    "xgrammar_over_ours": medians["xgrammar_cpu"] / ours,
                    "eager_over_reference": medians["ours_eager"] / medians["torch_reference"],
                }
                results.append({"batch": batch, "vocab": vocab, "mask": kind, "median_ms": medians, **ratios})
                cells = " ".join(f"{medians[name]:>15.3f}" for name in IMPLEMENTATIONS)
                print(
                    f"{batch:>5} {vocab:>7} {kind:>11} {cells} "
                    f"{ratios['reference_over_ours']:>9.1f} {ratios['xgrammar_over_ours']:>9.1f}"
                )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "rounds": args.rounds,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "warm_up_seconds": warm_up_seconds,
        "compiled_kernel_in_use": is_compiled,
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
