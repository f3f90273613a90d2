"""Cross-rank agreement, in one place: grammar verdicts, sampled tokens, and per-request failures of a batch.

Every rank runs the same loop on the same messages; what each rank decides on its own (a compile finished or
timed out, a grammar failed on a token) is agreed here so that every rank takes the same decision.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from scheduler.distributed import DistributedContext, RankFailureError
from scheduler.request import Abort
from scheduler.speculative import Drafts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarFailure:
    """Why a queued request failed; ``is_compile_error`` failures are cached, timeouts are not."""

    abort: Abort
    is_compile_error: bool


class RankSync:
    """Agreement over the ranks of a ``DistributedContext``: failed on any rank, ready on every rank.

    Each rank judges its own deadlines with its own clock; taking the union of failures means a slow rank
    (or a slow clock) can only make every rank fail a request together, never split the decision. A failure's
    cause and message are the lowest failing rank's.
    """

    def __init__(self, context: DistributedContext) -> None:
        self.context = context

    def agree_grammars(
        self, ready: set[str], failures: dict[str, GrammarFailure]
    ) -> tuple[set[str], dict[str, GrammarFailure]]:
        """Requests whose grammar is ready on every rank, and those failed on any rank.

        A compile error is cached only when every rank saw one (so caches stay identical); anything else (a
        timeout, a failure on only some ranks) is not cached.
        """
        gathered: list[tuple[list[str], dict[str, GrammarFailure]]] = self.context.all_gather((sorted(ready), failures))
        all_ready = set.intersection(*(set(rank_ready) for rank_ready, _ in gathered))
        agreed: dict[str, GrammarFailure] = {}
        for rid in sorted({rid for _, rank_failures in gathered for rid in rank_failures}):
            verdicts = [rank_failures.get(rid) for _, rank_failures in gathered]
            first = next(v for v in verdicts if v is not None)
            agreed[rid] = GrammarFailure(first.abort, all(v is not None and v.is_compile_error for v in verdicts))
        return all_ready - agreed.keys(), agreed

    def leader_tokens(self, tokens: list[int | None]) -> list[int | None]:
        """Rank 0's sampled tokens on every rank, so that every rank's grammars advance with the same token."""
        return self.context.broadcast_tokens(tokens)

    def leader_drafts(self, drafts: list[Drafts]) -> list[Drafts]:
        """Rank 0's drafts on every rank, so that every rank verifies the same tokens."""
        leader: list[Drafts] = self.context.broadcast_from_leader(drafts)
        return leader

    def agree_batch_failures(self, rids: list[str], failures: dict[str, Abort]) -> dict[str, Abort]:
        """Failures of any rank for a batch of ``rids``; raises ``RankFailureError`` if ranks ran other batches."""
        gathered = self.context.all_gather((rids, failures))
        if any(rank_rids != rids for rank_rids, _ in gathered):
            raise RankFailureError(
                f"rank {self.context.rank}: the ranks ran different batches: {[g[0] for g in gathered]}"
            )
        agreed: dict[str, Abort] = {}
        for _, rank_failures in gathered:
            for rid, abort in rank_failures.items():
                agreed.setdefault(rid, abort)
        if agreed.keys() != failures.keys():
            logger.info(
                "rank %d: requests failed on another rank: %s",
                self.context.rank,
                sorted(agreed.keys() - failures.keys()),
            )
        return agreed
