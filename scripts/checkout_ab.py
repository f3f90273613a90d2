"""This checkout against another, side by side: per round one process per checkout, alternating which goes first, so
that both share the machine's conditions; each process prints one JSON line of named figures, and each figure's
median over rounds is kept per checkout (``bench_forward``, ``bench_block_matmuls``)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def figures_in(checkout: Path, code: str, *args: str) -> dict[str, float]:
    """The figures ``code`` (a Python program run with ``args``) prints as its last line, run from ``checkout``."""
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        check=True,
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def side_by_side(
    here: Path, other: Path, rounds: int, measure: Callable[[Path], dict[str, float]]
) -> dict[str, tuple[float, float]]:
    """Each figure's median over ``rounds`` from ``here`` and from ``other`` (``measure`` runs one checkout's process),
    in the order ``here``'s process printed them."""
    checkouts = (here, other)
    runs: tuple[list[dict[str, float]], list[dict[str, float]]] = ([], [])
    for round_index in range(rounds):
        for side in (0, 1) if round_index % 2 == 0 else (1, 0):
            runs[side].append(measure(checkouts[side]))
    return {
        name: (statistics.median(run[name] for run in runs[0]), statistics.median(run[name] for run in runs[1]))
        for name in runs[0][0]
    }
