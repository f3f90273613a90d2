"""What a server process made while starting: its live objects kept out of the garbage collector's full collections,
and the memory it freed given back to the system.

A started scheduler holds 240,000-360,000 tracked objects (transformers, the tokenizer, the grammar backend, the
model's modules), and a full collection walks them all: 190-210 ms at 358,000 on the embedded model (AMD EPYC),
during which every running request waits. Python starts one whenever the objects that outlived two collections
grow by a quarter, so a long-running server pauses now and then for that long. Frozen, those objects are left out
of every collection (they are still freed when their last reference goes); what serving makes is collected as
before.

The imports themselves (torch, transformers, the engines: ~360,000 objects) ran full collections too, each walking
what the imports before it had made: importing ``scheduler.serve`` took 4.7-5.8 s of CPU, 0.7-1.2 s of it in the
collector (2026-12-02, Intel Xeon), paid again by every rank and every frontend a command starts.
``imports_kept_out_of_collections`` runs them with the collector off, then collects once and freezes.

Loading the model reads and converts every tensor before packing it; those copies are freed once the model runner
is built, but glibc's allocator keeps freed memory below a live allocation as its own: a model runner of the
embedded model grew its process's anonymous memory by 272 MiB for 121 MiB of weights, by 140 MiB once trimmed.
``return_freed_memory`` hands such pages back (``malloc_trim``): 86-89 MiB of a started scheduler's.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator
from pathlib import Path

_STATUS = Path("/proc/self/status")


@contextlib.contextmanager
def imports_kept_out_of_collections() -> Iterator[None]:
    """Run the block (a process's heavy imports) without the garbage collector, then collect its garbage once and
    freeze what it left alive; the collector is on again afterwards if it was before, so that whatever the process
    forks next (a fork server, a launch) collects as usual."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        freeze_startup_heap()
        if was_enabled:
            gc.enable()


def freeze_startup_heap() -> int:
    """Collect the start's garbage once, then freeze every object alive: how many the collector now leaves out."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def return_freed_memory() -> int:
    """Give the C heap's free pages back to the system: the bytes of anonymous memory the process no longer holds
    (0 where the C library has no ``malloc_trim`` or the system no ``/proc``)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc
        return 0
    before = anonymous_resident_bytes()
    trim(0)
    return max(0, before - anonymous_resident_bytes())


def anonymous_resident_bytes() -> int:
    """The process's resident anonymous memory (its heap and private mappings: not its files' pages, which the
    system may take back and read again), 0 where the system has no ``/proc``."""
    if not _STATUS.exists():
        return 0
    for line in _STATUS.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
