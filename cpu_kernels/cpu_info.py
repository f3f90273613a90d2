"""What CPU this is: its model and the instruction-set flags kernels and benchmarks depend on (Linux ``/proc/cpuinfo``;
elsewhere ``platform.processor()`` and no flags)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16")
"""The flags that decide which kernels a CPU runs (AMX flags are added when present)."""


@functools.cache
def _cpuinfo() -> dict[str, str]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def describe_cpu() -> str:
    """One line for benchmark output: the model and its SIMD flags, e.g. ``AMD EPYC (avx2 fma ... avx512f)``."""
    flags = cpu_flags()
    shown = [flag for flag in SIMD_FLAGS if flag in flags] + sorted(flag for flag in flags if flag.startswith("amx"))
    return f"{cpu_model()} ({' '.join(shown) or 'no SIMD flags read'})"
