"""Several scheduler ranks under ``torchrun``: the process group and the per-turn collectives.

Every rank runs the same loop on the same inputs in the same order. Rank 0 owns the sockets: each turn it
broadcasts the messages it received (one collective), and after each sampling step it broadcasts the tokens it
sampled, so every rank's grammars advance with the same token. Objects travel over a gloo (CPU) group. With
``--tp-size N`` the ranks also form a tensor-parallel group, a gloo group of its own, for the model's collectives.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

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

    @property
    def is_leader(self) -> bool:
        """Rank 0: receives from clients and sends their outputs."""
        return self.rank == 0

    def broadcast_from_leader(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (others pass None)."""
        box = [value]
        self._collective(dist.broadcast_object_list, box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        gathered: list[Any] = [None] * self.world_size
        self._collective(dist.all_gather_object, gathered, value, group=self.group)
        return gathered

    def broadcast_tokens(self, tokens: list[int | None]) -> list[int | None]:
        """Rank 0's sampled tokens on every rank (-1 stands for "no token allowed")."""
        values = torch.tensor([-1 if t is None else t for t in tokens], dtype=torch.long)
        self._collective(dist.broadcast, values, src=0, group=self.group)
        return [None if t < 0 else t for t in values.tolist()]

    def _collective(self, op: Any, *args: Any, **kwargs: Any) -> None:
        try:
            op(*args, **kwargs)
        except RuntimeError as e:  # gloo reports a vanished peer as a RuntimeError
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
