"""The block-format matmuls' rates at every row count a forward meets, this checkout against another, side by side:
Q4_1 and Q8_0 weights of SmolLM2's four decoder shapes, at M = 1 to 512 rows, from memory (30 layers' weights,
more than the L3 holds, as a forward streams them) and from cache (one layer's).

    python -m scripts.bench_block_matmuls --compare <other checkout> [--rounds 2] [--threads N]

A small matmul is tens of µs, so a figure is the best of many short trials (a busy machine's other processes take
whole time slices; the best trials are the ones they left alone). Each round runs one process per checkout,
alternating which goes first; it prints each checkout's median over rounds and this one's over the other's. Both
sides run this file's measurement through the checkout's own ``ops.matmul``, so a figure includes a Python call's
~4 µs per matmul (an 8-row matmul of o_proj is ~5 µs on two threads: the small-M figures understate the kernels').
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu
from scripts.checkout_ab import figures_in, side_by_side

MEASURE = """
import dataclasses, json, sys, time, torch
from cpu_kernels import library, ops
from scheduler.server_args import ModelArgs
from tests.unit.invariant_cases import random_weight

library.load(ModelArgs().kernel_build_path)
threads = int(sys.argv[1]) or library.kernel_threads()
shapes = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2's qkv, o_proj, gate_up, down: (K, N)
x = {k: torch.randn(512, k, generator=torch.Generator().manual_seed(k)) for k, _ in shapes}
out = {}
for fmt in ("q4_1", "q8_0"):
    layer = [random_weight(fmt, n, k)[0] for k, n in shapes]
    layers = [[dataclasses.replace(w, data=w.data.clone()) for w in layer] for _ in range(30)]
    for where, weights in (("memory", layers), ("cache", [layer])):
        for rows in (1, 2, 4, 8, 16, 32, 64, 512):
            if where == "memory" and rows == 512:
                continue  # seconds a trial, and no different from cache: 512 rows reuse each weight block 512 times
            xs = {k: v[:rows].contiguous() for k, v in x.items()}
            operations = len(weights) * sum(2 * rows * k * n for k, n in shapes)
            repeats = max(1, int(2e8 // operations))  # a trial: ~0.2-1 ms of work
            best = float("inf")
            for _ in range(30 if rows < 512 else 5):
                started = time.perf_counter()
                for _ in range(repeats):
                    for layer_weights in weights:
                        for w in layer_weights:
                            ops.matmul(xs[w.in_features], w, threads)
                best = min(best, (time.perf_counter() - started) / repeats)
            out[f"{fmt} M={rows} from {where}"] = operations / best / 1e9
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", type=Path, required=True, help="another checkout of this repository")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="kernel threads (0: the machine's)")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    medians = side_by_side(
        here, args.compare, args.rounds, lambda checkout: figures_in(checkout, MEASURE, str(args.threads))
    )
    threads = args.threads or os.cpu_count()
    print(f"CPU {describe_cpu()}; {threads} threads; this checkout against {args.compare}, {args.rounds} rounds, GOP/s")
    for name, (ours, theirs) in medians.items():
        print(f"{name:>24}  this {ours:7.1f}  other {theirs:7.1f}  this/other {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
