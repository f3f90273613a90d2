"""Does a row's product depend on how many rows share the matmul? The probe of the exactness issue, on this CPU.

For each of the embedded model's matmul shapes (K, N), each thread count and M = 1..``--max-rows``, it multiplies
M rows of real-scale activations and compares each row with that row multiplied alone, bit for bit, through:
- ``torch F.linear``: torch's BLAS as it is (MKL or oneDNN picks a kernel per shape and CPU);
- ``F.linear, rows padded to 4``: the exact runner before the invariant kernels (MATMUL_ROW_MULTIPLE);
- ``invariant float32`` and ``invariant Q8_0`` / ``Q4_1``: the runner's kernels (``cpu_kernels``).
Prints, per way and thread count, the row counts M at which some row differed, and the CPU it ran on.

    python scripts/probe_batch_invariance.py [--max-rows 64]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cpu_kernels import library, ops, packed_weights
from cpu_kernels.cpu_info import describe_cpu
from scheduler.server_args import ModelArgs

SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 49152))
"""(K, N) of SmolLM2-135M's q/o projections, gate/up, down and lm_head."""
PADDED_ROWS = 4


def _padded(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = x.shape[0]
    padding = -rows % PADDED_ROWS
    return F.linear(F.pad(x, (0, 0, 0, padding)), weight)[:rows]


def _q8_0(weight: torch.Tensor) -> packed_weights.PackedWeight:
    blocks = weight.reshape(weight.shape[0], -1, 32)
    scales = blocks.abs().amax(dim=2) / 127
    quants = torch.round(blocks / scales.clamp_min(1e-12).unsqueeze(2)).to(torch.int8)
    return packed_weights.pack_q8_0(scales.half(), quants.reshape(weight.shape[0], -1))


def _q4_1(weight: torch.Tensor) -> packed_weights.PackedWeight:
    blocks = weight.reshape(weight.shape[0], -1, 32)
    low, high = blocks.amin(dim=2), blocks.amax(dim=2)
    scales = (high - low) / 15
    quants = torch.round((blocks - low.unsqueeze(2)) / scales.clamp_min(1e-12).unsqueeze(2)).clamp(0, 15)
    return packed_weights.pack_q4_1(scales.half(), low.half(), quants.to(torch.uint8).reshape(weight.shape[0], -1))


def differing_row_counts(compute: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, threads: int) -> list[int]:
    """The M at which some row of ``compute(x[:M])`` differs from that row computed alone."""
    torch.set_num_threads(threads)
    alone = torch.cat([compute(x[i : i + 1]) for i in range(x.shape[0])])
    return [m for m in range(1, x.shape[0] + 1) if not torch.equal(compute(x[:m]), alone[:m])]


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    parts, start = [], values[0]
    for previous, value in zip(values, [*values[1:], None], strict=True):
        if value != previous + 1:
            parts.append(str(start) if start == previous else f"{start}-{previous}")
            start = value if value is not None else start
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-rows", type=int, default=64)
    options = parser.parse_args()
    library.load(ModelArgs().kernel_build_path)
    print(f"CPU: {describe_cpu()}; kernels: {library.isa()} build; torch {torch.__version__}")
    generator = torch.Generator().manual_seed(0)
    thread_counts = sorted({1, torch.get_num_threads()})
    print(
        f"{'(K, N)':>13} {'way':>28} "
        + " ".join(f"{f'{t} thread(s): M with a differing row':>44}" for t in thread_counts)
    )
    for k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator) * 0.05
        x = torch.randn(options.max_rows, k, generator=generator)
        ways: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "torch F.linear": functools.partial(F.linear, weight=weight),
            f"F.linear, rows padded to {PADDED_ROWS}": functools.partial(_padded, weight=weight),
            "invariant float32": functools.partial(ops.matmul, weight=packed_weights.pack_dense(weight)),
            "invariant Q8_0": functools.partial(ops.matmul, weight=_q8_0(weight)),
            "invariant Q4_1": functools.partial(ops.matmul, weight=_q4_1(weight)),
        }
        for name, compute in ways.items():
            cells = [_ranges(differing_row_counts(compute, x, threads)) for threads in thread_counts]
            print(f"{f'({k}, {n})':>13} {name:>28} " + " ".join(f"{cell:>44}" for cell in cells))


if __name__ == "__main__":
    main()
