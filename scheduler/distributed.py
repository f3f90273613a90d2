"""Several scheduler ranks under ``torchrun``: the process group and the per-turn collectives.

Every rank runs the same loop on the same inputs in the same order. Rank 0 owns the sockets: each turn it
broadcasts the messages it received (one collective), and after each sampling step it broadcasts the tokens it
sampled, so every rank's grammars advance with the same token. Objects travel over a gloo (CPU) group, or, once
the scheduler is loaded and where every rank runs on this machine, pickled through a mapping the ranks share
(``SharedMemoryGather``: a gloo collective costs ~1 ms of socket wake-ups on a busy 2-core machine, and a turn
runs several). With ``--tp-size N`` the ranks also form a tensor-parallel group, a gloo group of its own, for the
model's collectives (through a mapping of its own likewise).
"""

from __future__ import annotations

import datetime
import logging
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from cpu_kernels import library
from scheduler.model.shm_gather import SharedMemoryGather
from scheduler.model.tensor_parallel import TensorParallelGroup

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a collective may wait for a peer; torchrun ends the group sooner when a rank dies."""


class RankFailureError(RuntimeError):
    """A peer rank is gone (a collective failed); the scheduler on this rank cannot go on."""


@dataclass
class DistributedContext:
    """This rank's place in the group; ``group`` is a gloo group for Python objects."""

    rank: int
    world_size: int
    group: Any
    shared: SharedMemoryGather | None = None

    @property
    def is_leader(self) -> bool:
        """Rank 0: receives from clients and sends their outputs."""
        return self.rank == 0

    def share_memory(self) -> None:
        """From now on, gather through a mapping the ranks share where they all run on this machine and have the
        kernels' library loaded (its gather is there). Collective: every rank calls it, once the scheduler is
        loaded."""
        self.shared = SharedMemoryGather.open(self.rank, self.world_size, self.group, ready=library.is_loaded())
        logger.info("rank %d: turn collectives through %s", self.rank, "shared memory" if self.shared else "gloo")

    def broadcast_from_leader(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (others pass None)."""
        if self.shared is not None:
            return self.all_gather(value if self.is_leader else None)[0]
        box = [value]
        self._collective(dist.broadcast_object_list, box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        gathered = self._gather_through_mapping(value) if self.shared is not None else None
        if gathered is None:
            gathered = [None] * self.world_size
            self._collective(dist.all_gather_object, gathered, value, group=self.group)
        return gathered

    def broadcast_tokens(self, tokens: list[int | None]) -> list[int | None]:
        """Rank 0's sampled tokens on every rank (-1 stands for "no token allowed")."""
        values = torch.tensor([-1 if t is None else t for t in tokens], dtype=torch.long)
        gathered = self._shared_gather(values) if self.shared is not None else None
        if gathered is not None:
            values = gathered[0]
        else:
            self._collective(dist.broadcast, values, src=0, group=self.group)
        return [None if t < 0 else t for t in values.tolist()]

    def _gather_through_mapping(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` pickled through the mapping: its length first, then the payloads padded to the
        longest; None, on every rank alike, where the longest is larger than a slot."""
        payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        lengths_gathered = self._shared_gather(torch.tensor([len(payload)], dtype=torch.long))
        assert lengths_gathered is not None  # eight bytes fit any slot
        lengths = lengths_gathered[:, 0].tolist()
        padded = torch.zeros(max(lengths), dtype=torch.uint8)
        padded.numpy()[: len(payload)] = memoryview(payload)
        gathered = self._shared_gather(padded)
        if gathered is None:
            return None
        rows = gathered.numpy()
        return [pickle.loads(rows[r, :length].tobytes()) for r, length in enumerate(lengths)]

    def _shared_gather(self, x: torch.Tensor) -> torch.Tensor | None:
        assert self.shared is not None
        gathered: torch.Tensor | None = self._collective(self.shared.all_gather, x)
        return gathered

    def _collective(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:  # gloo, and the shared mapping, report a vanished peer as a RuntimeError
            raise RankFailureError(f"rank {self.rank}: a peer rank stopped answering ({e})") from e


def init_distributed(world_size: int) -> DistributedContext | None:
    """Join the group torchrun set up (rank and rendezvous from its environment); None for a single process."""
    if world_size <= 1:
        return None
    dist.init_process_group(backend="gloo", init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    context = DistributedContext(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)
    logger.info("rank %d of %d joined the process group", context.rank, context.world_size)
    return context


def tensor_parallel_group(context: DistributedContext | None, tp_size: int) -> TensorParallelGroup:
    """The group whose ranks each hold a shard of the model: every rank, or none (a group of one) when ``tp_size``
    is 1. Every rank must call this (creating a group is itself collective)."""
    if tp_size == 1:
        return TensorParallelGroup()
    if context is None or context.world_size != tp_size:
        raise ValueError(f"--tp-size {tp_size} needs {tp_size} ranks")
    group = dist.new_group(ranks=list(range(tp_size)), backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TensorParallelGroup.joined(context.rank, tp_size, group)


def destroy_distributed(context: DistributedContext | None) -> None:
    if context is not None and dist.is_initialized():
        dist.destroy_process_group()
