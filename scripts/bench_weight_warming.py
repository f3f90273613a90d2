"""Decode steps with the kernels' weight warming on and off, alternating step by step in one process.

    python scripts/bench_weight_warming.py [--model-path FILE.gguf ...] [--batch 1 8 32] [--steps 256] [--no-flush]
                                           [--warm-bytes N]

Between a decode step's matmuls one thread runs the small steps with the memory idle, and so it is while the host
prepares the step; the kernels' idle thread asks the caches for the next weights meanwhile
(``cpu_kernels/csrc/weight_warming.h``). Warming asks for bytes ahead and computes nothing: this prints what it is
worth, per model file and batch size: the median step with warming off and on (``library.set_cache_warm_bytes``),
their ratio, and whether the two gave the same logits. By default a 268 MB float32 weight streams through the
caches before each step, as ``scripts/quantize_model.py --measure`` does, so that no step finds the last one's
weights cached (a served step finds them pushed out by its own stream when the model is larger than the last-level
cache, as here); ``--no-flush`` leaves them. Files: the embedded model and the ``scripts/quantize_model.py`` files
this machine has, unless given.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from cpu_kernels import library, ops, packed_weights
from cpu_kernels.cpu_info import describe_cpu
from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ModelArgs
from sglang_constrained.tokenizer.loading import embedded_model_path

QUANTIZED = Path.home() / ".cache" / "sglang_constrained" / "quantized"
PROMPT = [(i * 7919) % 40000 + 100 for i in range(100)]


def admitted(runner: ModelRunner, prompt: list[int], budget: int) -> KVSequence:
    seq = runner.kv.admit(prompt, budget)
    if seq is None:
        raise RuntimeError("the KV pool has no room for the batch")
    return seq


def measure(path: Path, batch: int, steps: int, flush: bool, warm_bytes: int) -> tuple[float, float, bool]:
    """Median step ms with warming off and on (up to ``warm_bytes``), and whether every pair of steps gave the same
    logits."""
    runner = ModelRunner(ModelArgs(model_path=str(path), max_running_requests=batch * 2, disable_radix_cache=True))
    kept = library.cache_warm_bytes()
    flusher = packed_weights.pack_dense(torch.randn(16384, 4096) * 0.01)
    x = torch.randn(1, 4096)
    times: dict[bool, list[float]] = {False: [], True: []}
    same = True
    for round_start in range(0, steps, 16):
        logits: dict[bool, torch.Tensor] = {}
        for warm in (round_start // 16 % 2 == 0, round_start // 16 % 2 == 1):
            seqs = [admitted(runner, PROMPT[b:], 24) for b in range(batch)]
            runner.prefill(seqs, [PROMPT[b:] for b in range(batch)])
            library.set_cache_warm_bytes(warm_bytes if warm else 0)
            for step in range(8):
                if flush:
                    ops.matmul(x, flusher)
                started = time.perf_counter()
                out = runner.decode(seqs, [30 + step + b for b in range(batch)])
                times[warm].append(time.perf_counter() - started)
            logits[warm] = out
            for seq in seqs:
                runner.kv.release(seq)
        same = same and torch.equal(logits[False], logits[True])
    library.set_cache_warm_bytes(kept)
    return statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", nargs="*", type=Path)
    parser.add_argument("--batch", nargs="*", type=int, default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=256, help="steps each way per file and batch size")
    parser.add_argument("--no-flush", action="store_true", help="leave the caches as the last step left them")
    parser.add_argument("--warm-bytes", type=int, help="the most bytes a warm asks for (default: the kernels' own)")
    args = parser.parse_args()
    paths = args.model_path or [Path(embedded_model_path()), *sorted(QUANTIZED.glob("*.gguf"))]
    library.load(ModelArgs().kernel_build_path)
    warm_bytes = library.cache_warm_bytes() if args.warm_bytes is None else args.warm_bytes
    print(
        f"CPU {describe_cpu()}; {library.kernel_threads()} kernel threads; warming asks for up to "
        f"{warm_bytes / 2**20:.1f} MiB; caches {'left' if args.no_flush else 'flushed'} before each step"
    )
    for path in paths:
        for batch in args.batch:
            off, on, same = measure(path, batch, args.steps, not args.no_flush, warm_bytes)
            print(
                f"{path.name} B={batch}: off {off:.3f} ms, on {on:.3f} ms, off/on {off / on:.3f}; "
                f"logits {'the same' if same else 'DIFFER'}"
            )


if __name__ == "__main__":
    main()
