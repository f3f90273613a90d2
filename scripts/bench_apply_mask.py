"""Time applying token bitmasks on CPU: our paths against llguidance's, the torch reference and xgrammar's.

Synthetic masks of the two kinds real decoding produces, at the padded vocabularies of the two tokenizer setups:
``sparse`` (each token allowed with probability 1%, like a JSON structure state) and ``dense`` (99%, like free
text inside a string). For every configuration the implementations run interleaved (order rotated each round)
on the same logits and masks, so their ratios share the machine's conditions; a ratio is the median of the
per-round ratios. Logits are restored between calls, outside the timed region. ``--busy-core`` keeps a busy
loop running in another process meanwhile, as a grammar compiling on a background thread does when serving.
Prints a table and writes JSON (default: results/bench_apply_mask.json).

    python scripts/bench_apply_mask.py [--rounds 30] [--busy-core] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import llguidance.torch
import torch
import xgrammar

from cpu_kernels.cpu_info import describe_cpu
from scheduler.server_args import ModelArgs
from sglang_constrained.testing.benchmarking import cpu_pressure
from triton_ops import (
    apply_token_bitmask_inplace_cpu,
    apply_token_bitmask_inplace_cpu_eager,
    apply_token_bitmask_inplace_reference,
    load_cpu_bitmask_kernel,
)
from triton_ops.bitmask_format import pack_bool_mask

BATCH_SIZES = (1, 8, 32, 128)
VOCAB_SIZES = (49_280, 248_192)  # SmolLM2 and Qwen3.5, padded as their models' logits are
ALLOWED_SHARE = {"sparse": 0.01, "dense": 0.99}
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "bench_apply_mask.json"

IMPLEMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "ours": apply_token_bitmask_inplace_cpu,
    "ours_eager": apply_token_bitmask_inplace_cpu_eager,
    "llguidance": llguidance.torch.apply_token_bitmask_inplace,
    "reference": apply_token_bitmask_inplace_reference,
    "xgrammar_cpu": xgrammar.apply_token_bitmask_inplace,
}
RATIOS_TO = ("llguidance", "reference", "xgrammar_cpu")


def make_bitmask(batch: int, vocab: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """A ``[batch, words]`` mask allowing each token independently with the kind's probability."""
    return pack_bool_mask(torch.rand(batch, vocab, generator=generator) < ALLOWED_SHARE[kind])


def time_config(batch: int, vocab: int, kind: str, rounds: int) -> dict[str, float]:
    """Median ms per implementation and ours over each of ``RATIOS_TO``, after checking every result."""
    generator = torch.Generator().manual_seed(batch * vocab)
    source = torch.randn(batch, vocab, generator=generator)
    bitmask = make_bitmask(batch, vocab, kind, generator)
    expected = source.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask)
    logits = source.clone()
    for name, apply in IMPLEMENTATIONS.items():  # also compiles llguidance's kernel before timing it
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
            samples[name].append((time.perf_counter() - start) * 1e3)
    timing = {f"{name}_ms": statistics.median(times) for name, times in samples.items()}
    for other in RATIOS_TO:
        timing[f"ours_over_{other}"] = statistics.median(
            ours / theirs for ours, theirs in zip(samples["ours"], samples[other], strict=True)
        )
    return timing


@contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """A pure-Python busy loop in another process while the block runs (nothing if not ``enabled``)."""
    if not enabled:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed calls per implementation and configuration")
    parser.add_argument("--busy-core", action="store_true", help="keep a busy loop running on another core")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args(argv)

    load_start = time.perf_counter()
    is_loaded = load_cpu_bitmask_kernel(ModelArgs().kernel_build_path)
    load_seconds = time.perf_counter() - load_start
    print(
        f"{describe_cpu()}\n"
        f"loading the kernel library {load_seconds:.2f} s (in use: {is_loaded}); torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, CPU pressure {cpu_pressure()}"
    )
    header = f"{'vocab':>7} {'batch':>5} {'mask':>6} " + " ".join(f"{name:>12}" for name in IMPLEMENTATIONS)
    print(header + "   ours/" + " ours/".join(RATIOS_TO) + "   (median ms)")
    results = []
    with busy_core(args.busy_core):
        for vocab in VOCAB_SIZES:
            for batch in BATCH_SIZES:
                for kind in ALLOWED_SHARE:
                    timing = time_config(batch, vocab, kind, args.rounds)
                    results.append({"vocab": vocab, "batch": batch, "mask": kind} | timing)
                    cells = " ".join(f"{timing[f'{name}_ms']:>12.3f}" for name in IMPLEMENTATIONS)
                    ratios = " ".join(f"{timing[f'ours_over_{other}']:>6.3f}" for other in RATIOS_TO)
                    print(f"{vocab:>7} {batch:>5} {kind:>6} {cells}   {ratios}", flush=True)
    pressure = cpu_pressure()
    print(f"CPU pressure after the run {pressure}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "rounds": args.rounds,
        "busy_core": args.busy_core,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],
        "cpu_pressure_avg60_after": pressure,
        "cpu": describe_cpu(),
        "library_load_seconds": load_seconds,
        "library_in_use": is_loaded,
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
