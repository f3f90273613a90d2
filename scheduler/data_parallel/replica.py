"""Data-parallel replicas under ``torchrun`` (``--dp-size N``): each rank a whole model running its own batches.

Rank 0 owns the sockets. Each loop turn every rank takes part in one ``all_gather_object`` over gloo (a ``Turn``
each): rank 0 puts in the messages it received, routed per replica (``ReplicaRouter``), and the grammars compiled
since the last turn (``GrammarStore``); every rank puts in the outputs of its last step, the grammar keys it started
waiting for, its status and whether it was asked to stop. Rank 0 sends every replica's outputs as they come, so a
request's outputs reach its client in the order its replica made them (another replica's one turn after they were
made). No replica runs another's forward and no sampled token crosses ranks: each replica is its own leader for its
batches. A rank that dies fails the collective on the others (``RankFailureError``); rank 0 then answers every
request the other replicas held with an abort.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec

from scheduler.data_parallel.replica_router import ReplicaRouter
from scheduler.distributed import DistributedContext
from scheduler.io_struct import Pong, ReplicaStatus
from scheduler.ipc import SchedulerIPC
from scheduler.server_args import GrammarArgs
from scheduler.shared_grammars import GrammarStore, SharedGrammar, SharedGrammars
from scheduler.turn_transport import Messages, Outbox, TurnTransport
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import GrammarKey

logger = logging.getLogger(__name__)


@dataclass
class Turn:
    """One rank's part of a turn's exchange. ``wait_s``: how long this rank would let the loop sleep (None: until
    a message comes); ``routed`` (each replica's messages) and ``published`` are rank 0's only."""

    status: ReplicaStatus
    wait_s: float | None
    outputs: Outbox
    asks: list[GrammarKey]
    is_stopping: bool
    routed: list[Messages] = field(default_factory=list)
    published: list[SharedGrammar] = field(default_factory=list)


class DataParallelReplica(TurnTransport):
    """This rank's replica: the per-turn exchange, and on rank 0 the router and the grammar store."""

    def __init__(
        self,
        dist: DistributedContext,
        grammar_backend: GrammarPipeline | None,
        grammar_args: GrammarArgs,
        poll_interval_s: float,
    ) -> None:
        """``grammar_args``: rank 0's grammar store compiles by them; ``poll_interval_s``: the idle wait."""
        super().__init__()
        self.dist = dist
        self.rank = dist.rank
        self.poll_interval_s = poll_interval_s
        self.router = ReplicaRouter(dist.world_size) if dist.is_leader else None
        self.shared_grammars: SharedGrammars | None = None
        self.store: GrammarStore | None = None
        if grammar_backend is not None and grammar_backend.can_share_grammars:
            self.shared_grammars = SharedGrammars(grammar_backend)
            self.store = GrammarStore(grammar_backend, grammar_args) if dist.is_leader else None
        elif grammar_backend is not None:
            logger.warning(
                "the %s grammar backend cannot share compiled grammars: every replica compiles its own",
                grammar_backend.name,
            )
        self.statuses: list[ReplicaStatus] = []
        self._held_outputs: Outbox = []
        self._other_waits: list[float | None] = []
        self._has_news_for_others = False

    def exchange(
        self, ipc: SchedulerIPC | None, wait_s: float | None, status: ReplicaStatus, is_stopping: bool
    ) -> tuple[Messages, bool]:
        """This replica's messages for the turn, and whether any rank was asked to stop. Rank 0 receives (waiting
        at most as long as every replica allows) and sends the other replicas' outputs of their last step."""
        asks = self.shared_grammars.take_asks() if self.shared_grammars is not None else []
        turn = Turn(status, wait_s, self._held_outputs, asks, is_stopping)
        self._held_outputs = []
        if self.router is not None:
            assert ipc is not None
            turn.routed, keys = self.router.route(ipc.receive(self._group_wait(wait_s)))
            if self.store is not None:
                for key in keys:
                    self.store.prefetch(key)
                for key in asks:
                    self.store.ask(key)
                turn.published = self.store.take_published()
        started = time.perf_counter()
        gathered: list[Turn] = self.dist.all_gather(turn)
        self._synced(started)
        leader = gathered[0]
        if self.router is not None:
            assert ipc is not None
            published_now = {shared.key for shared in leader.published}
            for replica, other in enumerate(gathered[1:], start=1):
                self._send(ipc, replica, other.outputs)
                if self.store is not None:
                    for key in other.asks:
                        if key not in published_now:  # else it reaches that replica in this very turn
                            self.store.ask(key)
            self._other_waits = [other.wait_s for other in gathered[1:]]
            self._has_news_for_others = any(leader.routed[1:]) or bool(leader.published)
        self.statuses = [t.status for t in gathered]
        if self.shared_grammars is not None:
            self.shared_grammars.receive(leader.published)
        return leader.routed[self.dist.rank], any(t.is_stopping for t in gathered)

    def send(self, ipc: SchedulerIPC | None, outbox: Outbox) -> None:
        """Rank 0 sends its own outputs now; the others hold theirs for the next exchange."""
        if self.router is None:
            self._held_outputs.extend(outbox)
        else:
            assert ipc is not None
            self._send(ipc, 0, outbox)

    def group_pong(self, pong: Pong, status: ReplicaStatus) -> Pong:
        """Rank 0's ``pong`` for the group: queue and KV counts, forwards and output tokens summed over the
        replicas (``status`` is rank 0's current one, the others' are from the last exchange), each replica's
        status, and the shared compiles' metrics. Draft and cache-hit counters stay rank 0's."""
        replicas = [status, *self.statuses[1:]]
        summed = {
            "num_running_requests": sum(r.num_running_requests for r in replicas),
            "num_waiting_requests": sum(r.num_waiting_requests for r in replicas),
            "num_compiling_requests": sum(r.num_compiling_requests for r in replicas),
            "num_free_kv_tokens": sum(r.num_free_kv_tokens for r in replicas),
            "num_forwards": sum(r.num_forwards for r in replicas),
            "num_output_tokens": sum(r.num_output_tokens for r in replicas),
        }
        metrics_text = pong.metrics_text + (self.store.render_metrics() if self.store is not None else "")
        return msgspec.structs.replace(pong, **summed, replicas=replicas, metrics_text=metrics_text)

    def shutdown(self, ipc: SchedulerIPC | None, message: str) -> None:
        """Rank 0 answers the requests the other replicas held with an abort (``message``); compiles and waits for
        grammars are cancelled."""
        super().shutdown(ipc, message)
        if self.shared_grammars is not None:
            self.shared_grammars.cancel()
        if self.store is not None:
            self.store.shutdown()
        if self.router is not None and ipc is not None:
            for client_id, abort in self.router.abort_held(range(1, self.dist.world_size), message):
                ipc.send(client_id, abort)

    def _send(self, ipc: SchedulerIPC, replica: int, outbox: Outbox) -> None:
        assert self.router is not None
        for client_id, message in self.router.answers(replica, outbox):
            ipc.send(client_id, message)

    def _group_wait(self, own_wait_s: float | None) -> float | None:
        """Rank 0's receive may block only as long as every replica allows: not at all once a replica has news
        (messages or grammars) to act on, while a shared compile runs no longer than the poll interval."""
        if self._has_news_for_others:
            return 0.0
        waits = [wait for wait in (own_wait_s, *self._other_waits) if wait is not None]
        if self.store is not None and self.store.is_compiling:
            waits.append(self.poll_interval_s)
        return min(waits, default=None)
