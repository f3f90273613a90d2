"""Forwards of the default runner, this checkout against another, side by side: a long new prompt's prefill, decode
steps at B = 1, 8, 32 and a k = 8 extend; the block-format matmuls' rates on the model's shapes; and one layer's
attention over a 1,550-token sequence (its prefill's rate, extends of 8 and 16 tokens at its end).

    python -m scripts.bench_forward --compare <other checkout> [--rounds 2] [--prompt 1550]

Each round runs one process per checkout, alternating which goes first, so that both share the machine's
conditions; per measurement it prints each checkout's median over rounds and this one's over the other's. Each
process loads the embedded model as the server would (``--weight-dtype auto``, the machine's threads) and prints
one JSON line: the fastest of 3 prefills of ``--prompt`` new tokens, and medians of decode steps and extends.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

from cpu_kernels.cpu_info import describe_cpu
from scripts.checkout_ab import figures_in, side_by_side

MEASURE = """
import json, statistics, sys, time, torch
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ModelArgs
from tests.unit.invariant_cases import random_weight
from cpu_kernels import ops

prompt_length = int(sys.argv[1])
runner = ModelRunner(ModelArgs(max_running_requests=40, disable_radix_cache=True))
prompt = lambda n, salt: [(i * 7919 + salt * 31) % 40000 + 100 for i in range(n)]
out = {}
times = []
for salt in range(3):
    tokens = prompt(prompt_length, salt)
    seq = runner.kv.admit(tokens, 1)
    started = time.perf_counter()
    runner.prefill([seq], [tokens])
    times.append(time.perf_counter() - started)
    runner.kv.release(seq)
out[f"prefill {prompt_length}"] = min(times)
for batch in (1, 8, 32):
    seqs = []
    for b in range(batch):
        tokens = prompt(100, 100 + b)
        seq = runner.kv.admit(tokens, 64)
        runner.prefill([seq], [tokens])
        seqs.append(seq)
    times = []
    for step in range(6):
        started = time.perf_counter()
        runner.decode(seqs, [5 + step] * batch)
        times.append(time.perf_counter() - started)
    out[f"decode B={batch}"] = statistics.median(times)
    if batch == 1:
        times = []
        for _ in range(4):
            started = time.perf_counter()
            runner.extend(seqs[0], [7] * 8, all_logits=True)
            times.append(time.perf_counter() - started)
        out["extend k=8"] = statistics.median(times)
    for seq in seqs:
        runner.kv.release(seq)
shapes = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # SmolLM2's qkv, o_proj, gate_up, down: (K, N)
for fmt in ("q4_1", "q8_0"):
    weights = [(random_weight(fmt, n, k)[0], torch.randn(512, k), k, n) for k, n in shapes]
    for rows in (8, 512):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for weight, x, _, _ in weights:
                ops.matmul(x[:rows], weight)
            best = min(best, time.perf_counter() - started)
        operations = sum(2 * rows * k * n for _, _, k, n in weights)
        out[f"{fmt} matmuls M={rows} (GOP/s)"] = operations / best / 1e9
# one layer's attention with SmolLM2's heads over a 1,550-token sequence: its causal prefill, and extends at its end
context = 1550
q, k_pool, v_pool = torch.randn(context, 9, 64), torch.randn(context, 3, 64), torch.randn(context, 3, 64)
rows, scale = torch.arange(context), 64**-0.5
for tokens in (context, 8, 16):
    positions = torch.arange(context - tokens, context)
    queries, starts, keys = q[positions].contiguous(), torch.zeros(tokens, dtype=torch.long), positions + 1
    times = []
    for _ in range(3 if tokens == context else 30):
        started = time.perf_counter()
        ops.attention(queries, k_pool, v_pool, rows, starts, keys, scale)
        times.append(time.perf_counter() - started)
    pairs = int((positions + 1).sum())
    if tokens == context:
        out[f"attention, prefill {context} (GOP/s)"] = 4 * pairs * 9 * 64 / min(times) / 1e9
    else:
        out[f"attention, {tokens} at {context}"] = statistics.median(times)
print(json.dumps(out))
"""


def measure_code(checkout: Path) -> str:
    """``checkout``'s own ``MEASURE``: each checkout is measured through its own names (modules move between
    commits), with the same figures."""
    tree = ast.parse((checkout / "scripts" / "bench_forward.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MEASURE" for t in node.targets):
            return str(ast.literal_eval(node.value))
    raise ValueError(f"{checkout} has no scripts/bench_forward.py MEASURE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", type=Path, required=True, help="another checkout of this repository")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=1550, help="new tokens of the prefill")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    medians = side_by_side(
        here, args.compare, args.rounds, lambda checkout: figures_in(checkout, measure_code(checkout), str(args.prompt))
    )
    print(f"CPU {describe_cpu()}; this checkout against {args.compare}, {args.rounds} rounds")
    for name, (ours, theirs) in medians.items():
        unit = "" if "GOP/s" in name else " ms"
        scale = 1 if "GOP/s" in name else 1e3
        sides = f"this {ours * scale:8.1f}{unit}  other {theirs * scale:8.1f}{unit}"
        print(f"{name:>28}  {sides}  this/other {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
