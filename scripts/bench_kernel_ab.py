"""Two builds of the kernels side by side in one process: this checkout's and another checkout's, the library swapped
between calls, their order alternating call by call.

    python -m scripts.bench_kernel_ab --other <checkout> [--formats q4_1 q8_0 q5_0] [--rows 1 4 8 32 512]
                                      [--model-path FILE.gguf] [--reps 20]

Why in one process: on a shared machine two processes measured minutes apart see different machines (the same build's
decode step moved from 3.0 to 4.9 ms within ten minutes on AMD EPYC Zen 3); calls alternating within one process see
the same. Both builds run on this checkout's packed weights and Python wrappers, so the other checkout's C entry
points must take the same arguments (compare builds of the kernels, not of the wrappers).

It prints, per block format and row count, each build's best and median rate on SmolLM2's four matmul shapes (for
the k-quants, whose super-blocks are 256 wide, their widths rounded up to whole super-blocks: 576 to 768) and
whether the outputs are the same bits; then the model runner's forwards on ``--model-path`` (default: the embedded
model): a 1,550-token prefill, decode steps at B = 1, 8, 32 after 100-token prompts, one at B = 1 after 1,550
tokens, and extends of 4 and 8 tokens (best and median ms, this build over the other's).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from cpu_kernels import build, library, ops
from cpu_kernels.cpu_info import describe_cpu
from cpu_kernels.packed_weights import PackedWeight
from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ModelArgs

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))
"""SmolLM2's qkv, o_proj, gate_up and down matmuls: (in_features, out_features)."""


def other_build(checkout: Path, out_dir: Path) -> ctypes.CDLL:
    """The other checkout's kernels, compiled as this checkout compiles its own."""
    out = out_dir / "other.so"
    build.compile_library(checkout / "cpu_kernels" / "csrc" / "cpu_kernels.cpp", out, "native")
    other = ctypes.CDLL(str(out))
    library._declare(other)
    if other.invariant_group_panels() != library.loaded().invariant_group_panels():
        raise SystemExit("the two builds pack block weights in different groups of panels: not comparable here")
    return other


def alternate(builds: dict[str, ctypes.CDLL], call: Callable[[], object], reps: int) -> dict[str, list[float]]:
    """Each build's times of ``call``, the builds taking turns, who goes first alternating."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    names = list(builds)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else names[::-1]:
            library._library = builds[name]
            started = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - started)
    library._library = builds["this"]
    return times


def run_matmuls(weights: list[tuple[PackedWeight, torch.Tensor]], rows: int) -> list[torch.Tensor]:
    return [ops.matmul(x[:rows], weight) for weight, x in weights]


def prompt(length: int, salt: int) -> list[int]:
    """A prompt of ``length`` tokens, one per ``salt``."""
    return [(i * 7919 + salt * 31) % 40000 + 100 for i in range(length)]


def admitted(runner: ModelRunner, tokens: list[int], max_new_tokens: int) -> KVSequence:
    """A sequence for ``tokens``, prefilled."""
    seq = runner.kv.admit(tokens, max_new_tokens)
    if seq is None:
        raise SystemExit("the KV pool is too small for the measured sequences")
    runner.prefill([seq], [tokens])
    return seq


def matmul_rates(builds: dict[str, ctypes.CDLL], formats: list[str], rows: list[int], reps: int) -> None:
    from tests.unit.invariant_cases import fitted_width, random_weight

    for fmt in formats:
        shapes = [(fitted_width(fmt, k), n) for k, n in SHAPES]
        weights = [(random_weight(fmt, n, k)[0], torch.randn(max(rows), k)) for k, n in shapes]
        for m in rows:
            digests = {}
            for name, lib in builds.items():
                library._library = lib
                outputs = run_matmuls(weights, m)
                digests[name] = hashlib.sha256(b"".join(y.numpy().tobytes() for y in outputs)).hexdigest()
            times = alternate(builds, partial(run_matmuls, weights, m), reps)
            operations = sum(2 * m * k * n for k, n in shapes)
            best = {name: operations / min(t) / 1e9 for name, t in times.items()}
            median = {name: operations / statistics.median(t) / 1e9 for name, t in times.items()}
            print(
                f"{fmt:5s} M={m:<4d} GOP/s best {best['this']:6.1f} / {best['other']:6.1f} = "
                f"{best['this'] / best['other']:.2f}, median {median['this']:6.1f} / {median['other']:6.1f} = "
                f"{median['this'] / median['other']:.2f}; same bits: {digests['this'] == digests['other']}"
            )


def forwards(builds: dict[str, ctypes.CDLL], model_path: str | None, reps: int) -> None:
    runner = ModelRunner(ModelArgs(model_path=model_path, max_running_requests=40, disable_radix_cache=True))

    def prefill(n: int) -> None:
        runner.kv.release(admitted(runner, prompt(n, 1), 1))

    def report(name: str, times: dict[str, list[float]]) -> None:
        this, other = times["this"], times["other"]
        print(
            f"{name:16s} ms best {min(this) * 1e3:8.2f} / {min(other) * 1e3:8.2f} = {min(this) / min(other):.2f}, "
            f"median {statistics.median(this) * 1e3:8.2f} / {statistics.median(other) * 1e3:8.2f} = "
            f"{statistics.median(this) / statistics.median(other):.2f}"
        )

    report("prefill 1550", alternate(builds, lambda: prefill(1550), 3))
    for batch, context in ((1, 100), (8, 100), (32, 100), (1, 1550)):
        seqs = [admitted(runner, prompt(context, 100 + b), 2 * reps + 16) for b in range(batch)]
        report(f"decode B={batch} @{context}", alternate(builds, partial(runner.decode, seqs, [5] * batch), reps))
        if batch == 1 and context == 100:
            for k in (4, 8):

                def extend(seq=seqs[0], k=k) -> None:
                    runner.extend(seq, [7] * k, all_logits=True)
                    runner.kv.truncate(seq, len(seq) - k)

                report(f"extend k={k}", alternate(builds, extend, reps))
        for seq in seqs:
            runner.kv.release(seq)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, required=True, help="another checkout of this repository")
    parser.add_argument("--formats", nargs="+", default=["q4_1", "q8_0", "q5_0"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 32, 512])
    parser.add_argument("--model-path", default=None, help="a GGUF file (default: the embedded model)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-forwards", action="store_true", help="the matmuls alone")
    args = parser.parse_args()
    library.load(ModelArgs().kernel_build_path)  # which also packs block weights for its build's groups of panels
    with tempfile.TemporaryDirectory() as scratch:
        builds = {"this": library.loaded(), "other": other_build(args.other, Path(scratch))}
        print(f"CPU {describe_cpu()}; this checkout's kernels / {args.other}'s, in one process, alternating")
        matmul_rates(builds, args.formats, args.rows, args.reps)
        if not args.no_forwards:
            forwards(builds, args.model_path, args.reps)


if __name__ == "__main__":
    main()
