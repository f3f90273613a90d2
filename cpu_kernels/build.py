"""Compiling the kernels: once per machine, with the C++ compiler at hand (``-O3 -march=native``, ~55 s of GCC 12 on
AMD EPYC Zen 3), into a build directory keyed by the sources, the compiler, the flags and the CPU; or for a narrower
instruction set, to show that every build computes the same bits (``TARGETS``)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from cpu_kernels.cpu_info import cpu_flags, cpu_model

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
TRANSLATION_UNIT = CSRC / "cpu_kernels.cpp"
"""The one file compiled: the extern "C" entry points, including every header of ``CSRC``."""
COMPILE_FLAGS = ("-march=native", "-std=c++17", "-pthread", "-ffp-contract=off", "-shared", "-fPIC")
"""``-ffp-contract=off``: the compiler may not fuse a multiply and an add the source keeps apart (nor split an fma)."""
NATIVE_OPTIMIZATION = "-O3"
NARROWER_OPTIMIZATION = "-O0"
"""The narrower builds exist to show their bits, which no optimisation level changes: without ``-ffast-math`` GCC and
Clang only make changes that keep floating-point values, and contraction is off (the cross-build test gives the same
bits from every narrower build at ``-O0`` as from the native one at ``-O3``, as it did at ``-O1``). The test suite
builds them on every new machine, four on a CPU with AVX-512 and VNNI, and only runs their small cases: the AVX2
build took 3.1 s of compiler at ``-O0`` and 8.4 s at ``-O1`` (GCC 12, AMD EPYC Zen 5), the scalar one 36 s at ``-O1``
and 116 s at ``-O3`` (Zen 3)."""


def sources() -> list[Path]:
    """Every C++ file of ``CSRC``, by name: the build's key reads them all, so that a file changed, added, removed or
    renamed gives a new build."""
    return sorted(path for path in CSRC.iterdir() if path.suffix in (".cpp", ".h"))


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError(
        "the batch-invariant CPU kernels need a C++ compiler (g++ or clang++, or $CXX) to build once per machine; "
        "install one (Debian: apt-get install g++)"
    )


TARGETS = {
    "native": (),
    "avx512": ("-mno-avx512vnni", "-mno-avxvnni"),
    "avx2-vnni": ("-mno-avx512f",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),
    "scalar": ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c"),
}
"""Builds: the CPU at hand, or a narrower instruction set (to show that every build computes the same bits): AVX-512
and AVX2 without their 8-bit dot products (VNNI), and AVX2 with AVX-VNNI's."""
TARGET_NEEDS = {"avx512": "avx512bw", "avx2-vnni": "avx_vnni", "avx2": "avx2"}
"""The CPU flag (as /proc/cpuinfo names it) each narrower build needs to run; the scalar build runs anywhere."""


def runs_here(target: str) -> bool:
    """Whether this CPU runs the ``target`` build (the native one always)."""
    needed = TARGET_NEEDS.get(target)
    return needed is None or needed in cpu_flags()


def narrows_here(target: str) -> bool:
    """Whether the ``target`` build runs on this CPU and differs from the native one: it turns off an instruction set
    this CPU has. On an AVX2 CPU without VNNI (AMD EPYC Zen 3) the ``avx2`` build turns off nothing: it would be the
    native build's instruction set compiled again."""
    turned_off = (flag.removeprefix("-mno-") for flag in TARGETS[target] if flag.startswith("-mno-"))
    return runs_here(target) and any(_CPUINFO_NAMES.get(name, name) in cpu_flags() for name in turned_off)


_CPUINFO_NAMES = {"avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni"}
"""/proc/cpuinfo's names of the instruction sets whose compiler flags are spelled otherwise."""


def target_flags(target: str) -> tuple[str, ...]:
    """The compiler flags of ``target``'s build."""
    optimization = NATIVE_OPTIMIZATION if target == "native" else NARROWER_OPTIMIZATION
    return (optimization, *COMPILE_FLAGS, *TARGETS[target])


def compile_library(translation_unit: Path, out: Path, target: str) -> None:
    """``translation_unit`` compiled into the shared library ``out`` with the compiler at hand and ``target``'s flags
    (``scripts/bench_kernel_ab.py`` compiles another checkout's sources so)."""
    compiler = _compiler()
    command = [compiler, *target_flags(target), str(translation_unit), "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building {translation_unit.name} with {compiler} failed:\n{result.stderr[-4000:]}")


def build(build_dir: Path, target: str) -> Path:
    """The compiled library for these sources, compiler, CPU and target, building it first if no process has yet."""
    compiler = _compiler()
    flags = target_flags(target)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode()
            for x in (
                *(f"{path.name}\0{path.read_text()}" for path in sources()),
                version,
                " ".join(flags),
                cpu_model(),
                *sorted(cpu_flags()),
            )
        )
    ).hexdigest()[:16]
    library = build_dir / f"cpu_kernels-{target}-{key}.so"
    if library.is_file():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / f"{library.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together build once
        if library.is_file():
            return library
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=build_dir) as staging:
            staged = Path(staging) / library.name
            compile_library(TRANSLATION_UNIT, staged, target)
            staged.rename(library)  # atomic: no process ever loads half a library
        logger.info("built the batch-invariant CPU kernels in %.1f s: %s", time.perf_counter() - started, library)
    return library
