"""How a loop turn's messages come in and its outputs go out, chosen once at start by the rank layout: one rank
(``OneRank``), ranks in lockstep (``LockstepRanks``: every rank runs rank 0's messages, its batches and its tokens),
or data-parallel replicas (``scheduler.data_parallel.DataParallelReplica``: each rank runs the requests rank 0 routed
to it). The loop calls the same four methods whichever it is; only rank 0 has a socket (``ipc``, None elsewhere).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod

import msgspec

from scheduler.distributed import DistributedContext
from scheduler.io_struct import Pong, ReplicaStatus, ServerMessage
from scheduler.ipc import SchedulerIPC
from scheduler.rank_sync import RankSync
from scheduler.server_args import GrammarArgs
from scheduler.shared_grammars import GrammarStore, SharedGrammars
from sglang_constrained.backends.auto import AutoGrammarBackend
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import GrammarKey

logger = logging.getLogger(__name__)

Messages = list[tuple[bytes, bytes]]
"""``(client_id, payload)`` as the socket received them."""
Outbox = list[tuple[bytes, ServerMessage]]
"""``(client_id, message)`` to send."""


class TurnTransport(ABC):
    """This rank's way in and out. ``rank_sync``: agreement with ranks that run the same batches (lockstep ranks
    only); ``rank``: this rank's number (0 alone)."""

    rank_sync: RankSync | None = None
    rank: int = 0

    def __init__(self) -> None:
        self.num_synced_turns = 0
        self.sync_seconds = 0.0

    @abstractmethod
    def exchange(
        self, ipc: SchedulerIPC | None, wait_s: float | None, status: ReplicaStatus, is_stopping: bool
    ) -> tuple[Messages, bool]:
        """This rank's messages for the turn, waiting at most ``wait_s`` for one (None: until one comes), and whether
        any rank was asked to stop. ``status``: this rank's load, for whoever routes requests."""

    def send(self, ipc: SchedulerIPC | None, outbox: Outbox) -> None:
        """Send a step's outputs; a rank without a socket made the same ones as rank 0 and drops them."""
        if ipc is not None:
            for client_id, message in outbox:
                ipc.send(client_id, message)

    def group_pong(self, pong: Pong, status: ReplicaStatus) -> Pong:
        """The answer to a ping for the whole group (``status``: this rank's current load)."""
        return pong

    def shutdown(self, ipc: SchedulerIPC | None, message: str) -> None:
        """The loop has stopped: log what the turns' syncs cost (and answer what only this transport holds with an
        abort, ``message``)."""
        if self.num_synced_turns:
            mean_us = 1e6 * self.sync_seconds / self.num_synced_turns
            logger.info("per-turn rank sync: %d turns, %.0f us per turn on average", self.num_synced_turns, mean_us)

    def _synced(self, started: float) -> None:
        """Count one turn's rank sync, begun at ``started`` (``time.perf_counter()``)."""
        self.sync_seconds += time.perf_counter() - started
        self.num_synced_turns += 1


class OneRank(TurnTransport):
    """A single process: the socket's messages, as they come."""

    def exchange(
        self, ipc: SchedulerIPC | None, wait_s: float | None, status: ReplicaStatus, is_stopping: bool
    ) -> tuple[Messages, bool]:
        return (ipc.receive(wait_s) if ipc is not None else []), is_stopping


class LockstepRanks(TurnTransport):
    """Ranks that each run every request (tensor-parallel shards, or whole models kept in step): rank 0's messages
    on every rank, in its order, through one collective per turn; rank 0 sends. Rank 0 compiles the grammars of
    every rank and publishes them in that collective (``scheduler.shared_grammars``), unless the backend cannot
    export its grammars: then each rank compiles its own, ``RankSync`` agrees their verdicts, and ``auto`` chooses
    in order (``AutoGrammarBackend.choose_in_order``: no choice by one rank's timing)."""

    def __init__(
        self, dist: DistributedContext, grammar_backend: GrammarPipeline | None, grammar_args: GrammarArgs
    ) -> None:
        super().__init__()
        self.dist = dist
        self.rank = dist.rank
        self.rank_sync = RankSync(dist)
        self.shared_grammars: SharedGrammars | None = None
        self.store: GrammarStore | None = None
        if grammar_backend is not None and grammar_backend.can_share_grammars:
            self.store = GrammarStore(grammar_backend, grammar_args) if dist.is_leader else None
            self.shared_grammars = SharedGrammars(grammar_backend, self.store.ask if self.store else _rank_0_asks)
        elif grammar_backend is not None and isinstance(grammar_backend.backend, AutoGrammarBackend):
            grammar_backend.backend.choose_in_order()

    def exchange(
        self, ipc: SchedulerIPC | None, wait_s: float | None, status: ReplicaStatus, is_stopping: bool
    ) -> tuple[Messages, bool]:
        messages = ipc.receive(wait_s) if ipc is not None else []
        published = self.store.take_published() if self.store is not None else []
        started = time.perf_counter()
        gathered = self.dist.all_gather((messages, published, is_stopping))
        self._synced(started)
        if self.shared_grammars is not None:
            self.shared_grammars.receive(gathered[0][1])
        return gathered[0][0], any(stopping for _, _, stopping in gathered)

    def group_pong(self, pong: Pong, status: ReplicaStatus) -> Pong:
        """Rank 0's ``pong``, with its shared compiles' metrics."""
        if self.store is None:
            return pong
        return msgspec.structs.replace(pong, metrics_text=pong.metrics_text + self.store.render_metrics())

    def shutdown(self, ipc: SchedulerIPC | None, message: str) -> None:
        """Also cancel the waits for rank 0's grammars and its compiles."""
        super().shutdown(ipc, message)
        if self.shared_grammars is not None:
            self.shared_grammars.cancel()
        if self.store is not None:
            self.store.shutdown()


def _rank_0_asks(key: GrammarKey) -> None:
    """A lockstep rank's miss: rank 0 misses the same key in the same turn and asks its store."""
