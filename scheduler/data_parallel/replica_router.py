"""Rank 0's routing of client messages to data-parallel replicas (``--dp-size``), and of their answers back.

A new request goes to the replica holding the fewest requests (waiting for a grammar or for KV memory, or running),
ties to the lowest rank. The router counts them itself: routed to a replica and not yet answered with a final
output. Requests rather than tokens: a request's output length is unknown when it is routed, and each decode step
of a replica costs about one row per running request. Everything about a held request (its abort, a repeated rid)
goes to the replica holding it; a ping goes to rank 0, which answers for the group; a cache flush goes to every
replica, and their answers are combined into one.
"""

from __future__ import annotations

import msgspec

from scheduler.io_struct import (
    AbortCause,
    AbortReq,
    FlushCacheDone,
    FlushCacheReq,
    GenerateOutput,
    GenerateReq,
    decode_client_message,
    error_output,
)
from scheduler.turn_transport import Messages, Outbox
from sglang_constrained.constraint_spec import GrammarKey


class ReplicaRouter:
    """Which replica holds which request, for ``num_replicas`` replicas (replica ``r`` is rank ``r``)."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        # Per replica: rid -> (client_id, requests with that rid it holds; a repeated rid is answered, not run).
        self._held: list[dict[str, tuple[bytes, int]]] = [{} for _ in range(num_replicas)]
        self._num_held = [0] * num_replicas
        self._flushes: dict[tuple[bytes, str], list[FlushCacheDone]] = {}

    def num_held(self, replica: int) -> int:
        """Requests routed to ``replica`` and not answered with a final output yet."""
        return self._num_held[replica]

    def holder(self, rid: str) -> int | None:
        return next((replica for replica, held in enumerate(self._held) if rid in held), None)

    def route(self, messages: Messages) -> tuple[list[Messages], list[GrammarKey]]:
        """Each replica's messages in arrival order, and the grammar keys of the new requests (to compile them at
        once). A message that does not decode goes to rank 0, whose scheduler answers it as malformed."""
        routed: list[Messages] = [[] for _ in range(self.num_replicas)]
        keys: list[GrammarKey] = []
        for client_id, payload in messages:
            try:
                message = decode_client_message(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                routed[0].append((client_id, payload))
                continue
            if isinstance(message, GenerateReq):
                replica = self.holder(message.rid)
                replica = self._least_loaded() if replica is None else replica
                self._hold(replica, message.rid, client_id)
                routed[replica].append((client_id, payload))
                keys.extend(_grammar_key(message))
            elif isinstance(message, AbortReq):
                replica = self.holder(message.rid)
                if replica is not None:  # else it has finished already: nothing to abort
                    routed[replica].append((client_id, payload))
            elif isinstance(message, FlushCacheReq):
                self._flushes[client_id, message.request_id] = []
                for replica_messages in routed:
                    replica_messages.append((client_id, payload))
            else:
                routed[0].append((client_id, payload))
        return routed, keys

    def answers(self, replica: int, outbox: Outbox) -> Outbox:
        """What of ``replica``'s outbox goes to clients now: all of it, in order, except cache-flush answers, which
        become one once every replica has answered. Final outputs release their requests."""
        sending: Outbox = []
        for client_id, message in outbox:
            if isinstance(message, FlushCacheDone):
                sending.extend(self._combine_flush(client_id, message))
                continue
            if isinstance(message, GenerateOutput) and message.finished:
                self._release(replica, message.rid)
            sending.append((client_id, message))
        return sending

    def abort_held(self, replicas: range, message: str) -> Outbox:
        """An abort for every request the ``replicas`` hold (when they can no longer answer: the server is shutting
        down), releasing them."""
        aborts: Outbox = []
        for replica in replicas:
            for rid, (client_id, count) in self._held[replica].items():
                aborts.extend((client_id, error_output(rid, AbortCause.SHUTDOWN, message)) for _ in range(count))
            self._held[replica].clear()
            self._num_held[replica] = 0
        return aborts

    def _least_loaded(self) -> int:
        return min(range(self.num_replicas), key=lambda replica: (self._num_held[replica], replica))

    def _hold(self, replica: int, rid: str, client_id: bytes) -> None:
        held = self._held[replica]
        held[rid] = (client_id, held[rid][1] + 1 if rid in held else 1)
        self._num_held[replica] += 1

    def _release(self, replica: int, rid: str) -> None:
        held = self._held[replica]
        if rid not in held:
            return
        client_id, count = held[rid]
        if count > 1:
            held[rid] = (client_id, count - 1)
        else:
            del held[rid]
        self._num_held[replica] -= 1

    def _combine_flush(self, client_id: bytes, answer: FlushCacheDone) -> Outbox:
        answers = self._flushes.get((client_id, answer.request_id))
        if answers is None:
            return [(client_id, answer)]
        answers.append(answer)
        if len(answers) < self.num_replicas:
            return []
        del self._flushes[client_id, answer.request_id]
        combined = FlushCacheDone(
            request_id=answer.request_id,
            success=all(a.success for a in answers),
            message="; ".join(a.message for a in answers),
        )
        return [(client_id, combined)]


def _grammar_key(message: GenerateReq) -> list[GrammarKey]:
    """The request's grammar key, if it has a well-formed one (a malformed one is its replica's to answer)."""
    try:
        key = message.sampling_params.grammar_key()
    except ValueError:
        return []
    return [] if key is None else [key]
