"""Cross-rank agreement on grammar verdicts: ready on every rank, failed on any rank."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.distributed import DistributedContext


@dataclass(frozen=True)
class GrammarFailure:
    """Why a queued request failed; ``is_compile_error`` failures are cached, timeouts are not."""

    message: str
    is_compile_error: bool


class RankSync:
    """Ready on every rank, failed on any rank; a failure's message is the lowest failing rank's.

    Each rank judges its own deadlines with its own clock; taking the union of failures means a slow rank
    (or a slow clock) can only make every rank fail the request together, never split the decision.
    A compile error is cached only when every rank saw one (so caches stay identical); anything else
    (a timeout, a failure on only some ranks) is not cached.
    """

    def __init__(self, context: DistributedContext) -> None:
        self.context = context

    def agree(self, ready: set[str], failures: dict[str, GrammarFailure]) -> tuple[set[str], dict[str, GrammarFailure]]:
        local = (sorted(ready), {rid: (f.message, f.is_compile_error) for rid, f in failures.items()})
        gathered = self.context.all_gather(local)
        all_ready = set.intersection(*(set(rank_ready) for rank_ready, _ in gathered))
        agreed: dict[str, GrammarFailure] = {}
        for rid in sorted({rid for _, rank_failures in gathered for rid in rank_failures}):
            verdicts = [rank_failures.get(rid) for _, rank_failures in gathered]
            message = next(v[0] for v in verdicts if v is not None)
            agreed[rid] = GrammarFailure(message, all(v is not None and v[1] for v in verdicts))
        return all_ready - agreed.keys(), agreed
