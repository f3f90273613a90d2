"""All-gathers between the ranks of one machine through a mapping they share (``cpu_kernels/csrc/shm_gather.h``),
instead of gloo over loopback: a tensor-parallel group's (``TensorParallelGroup.joined``) and the scheduler's turn
collectives (``DistributedContext.share_memory``).

A tensor-parallel forward gathers twice a layer. Over gloo each gather wakes the peer through a socket, ~1 ms on a
busy 2-core machine: two ranks decoded ~11x slower per token than one (docs/benchmarks.md). Through the mapping a
rank copies its tensor into its slot and reads the others' once they are published. The bytes gathered are the
same either way, so every sum built on them is too.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from cpu_kernels import library

logger = logging.getLogger(__name__)

SLOT_BYTES = 4 * 2**20
"""The largest tensor a rank puts in one gather (a 1,800-token prefill's hidden states at SmolLM2's width, or the
logits' slices of 40 rows); a larger one goes over gloo. The mapping holds two buffers of a slot per rank."""
LINE_BYTES = 64
"""A rank's published sequence number has a cache line of its own (``shm_gather.h``)."""
SHARED_MEMORY_DIR = "/dev/shm"


def machine_identity() -> str:
    """The same string on every process of this machine (its boot, and its host name for a container's own)."""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as boot:
        return f"{socket.gethostname()}/{boot.read().strip()}"
    return socket.gethostname()


class SharedMemoryGather:
    """The gathers of one group's ranks through a shared mapping (see module doc); ``open`` makes one."""

    def __init__(self, rank: int, size: int, mapping: mmap.mmap, pids: list[int], slot_bytes: int) -> None:
        self.rank = rank
        self.size = size
        self.slot_bytes = slot_bytes
        self._mapping = mapping
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self._pids = pids
        self._pid_array = (ctypes.c_int32 * size)(*pids)
        self._sequence = 0

    @classmethod
    def open(
        cls, rank: int, size: int, group: Any, slot_bytes: int = SLOT_BYTES, ready: bool = True
    ) -> SharedMemoryGather | None:
        """The group's mapping, or None where its ranks are not all on this machine, it cannot be made, or a rank
        is not ``ready`` (gloo then). Collective: every rank of ``group`` calls it. Rank 0 creates the file and
        removes its name once every rank has mapped it, so that nothing is left behind however the ranks end."""
        identities: list[Any] = [None] * size
        dist.all_gather_object(identities, machine_identity(), group=group)
        if len(set(identities)) != 1:
            logger.info("ranks on %d machines: their gathers go over gloo", len(set(identities)))
            return None
        num_bytes = size * LINE_BYTES + 2 * size * slot_bytes
        path: list[str | None] = [_create_zeroed(num_bytes) if rank == 0 else None]
        dist.broadcast_object_list(path, src=0, group=group)
        mapping = _map(path[0], num_bytes)
        mapped: list[Any] = [None] * size
        dist.all_gather_object(mapped, (mapping is not None and ready, os.getpid()), group=group)
        if rank == 0 and path[0] is not None:
            os.unlink(path[0])
        if mapping is None or not all(ok for ok, _ in mapped):
            logger.info("no shared mapping for the ranks: their gathers go over gloo")
            return None
        return cls(rank, size, mapping, [pid for _, pid in mapped], slot_bytes)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """``[size, *x.shape]``: every rank's ``x`` (the same shape and dtype on each) in rank order; None, on every
        rank alike, where ``x`` is larger than a slot. Raises RuntimeError if a peer's process is gone."""
        num_bytes = x.numel() * x.element_size()
        if num_bytes > self.slot_bytes:
            return None
        x = x.contiguous()
        out = torch.empty((self.size, *x.shape), dtype=x.dtype)
        self._sequence += 1
        gone = library.loaded().invariant_shm_all_gather(
            self._address,
            self.rank,
            self.size,
            self.slot_bytes,
            self._sequence,
            x.data_ptr(),
            num_bytes,
            out.data_ptr(),
            self._pid_array,
        )
        if gone:
            raise RuntimeError(f"rank {gone - 1} is gone (process {self._pids[gone - 1]} ended)")
        return out


def _create_zeroed(num_bytes: int) -> str | None:
    """A new file of ``num_bytes`` zeros in shared memory (a sequence number of 0 is "nothing published")."""
    try:
        fd, path = tempfile.mkstemp(prefix="sglang-constrained-ranks-", dir=SHARED_MEMORY_DIR)
    except OSError as e:
        logger.info("cannot create a file in %s (%s)", SHARED_MEMORY_DIR, e)
        return None
    try:
        os.ftruncate(fd, num_bytes)
    except OSError as e:
        logger.info("cannot size %s to %d bytes (%s)", path, num_bytes, e)
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _map(path: str | None, num_bytes: int) -> mmap.mmap | None:
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        logger.info("cannot open %s (%s)", path, e)
        return None
    try:
        return mmap.mmap(fd, num_bytes)
    except OSError as e:
        logger.info("cannot map %s (%s)", path, e)
        return None
    finally:
        os.close(fd)
