"""Which waiting requests enter KV memory this turn, and what of their prompts the prefix cache keeps for the next."""

from __future__ import annotations

import itertools
from collections import deque

from scheduler.model.kv_cache import KVCacheManager
from scheduler.request import Req
from sglang_constrained.backends.base import common_prefix_length

SHARED_PREFIX_MIN_TOKENS = 32
"""A prompt's start worth waiting a turn for, to take it from the prefix cache rather than compute it twice."""


class PrefillAdmission:
    """Admits waiting requests in arrival order into ``kv``, at most ``max_running_requests`` running at once."""

    def __init__(self, kv: KVCacheManager, max_running_requests: int, max_seq_len: int) -> None:
        self.kv = kv
        self.max_running_requests = max_running_requests
        self.max_seq_len = max_seq_len

    def output_budget(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """The output tokens a request reserves KV for: ``max_new_tokens``, within the context."""
        return max(1, min(max_new_tokens, self.max_seq_len - len(prompt_ids)))

    def schedule(self, waiting: deque[Req], num_running: int) -> list[Req]:
        """Requests taken from ``waiting`` into KV memory this turn, in arrival order (the first that does not fit
        waits, and those behind it with it, so that a long prompt is never starved by short ones). One whose prompt
        begins with ``SHARED_PREFIX_MIN_TOKENS`` or more tokens that a request admitted before it computes this turn
        waits too: the next turn takes them from the prefix cache (``share_prefixes``) instead of computing them
        again."""
        batch: list[Req] = []
        room = self.max_running_requests - num_running
        while waiting and len(batch) < room:
            req = waiting[0]
            if self._computes_again(req, batch) or not self._reserve_kv(req):
                break
            batch.append(waiting.popleft())
        return batch

    def share_prefixes(self, batch: list[Req], waiting: deque[Req]) -> None:
        """Cache, right after their prefill, what waiting requests share of the prompts of ``batch``: a prompt they
        repeat (``n`` samples admitted while the first runs), or its first ``SHARED_PREFIX_MIN_TOKENS`` or more
        tokens (the requests ``schedule`` held back for them, such as a system prompt or tools). Only the waiting
        requests the next turn can admit are compared."""
        next_turn = list(itertools.islice(waiting, self.max_running_requests))
        if self.kv.radix is None or not next_turn:
            return
        for req in batch:
            if req.kv is None:
                continue
            worth = min(len(req.prompt_ids), req.kv.num_cached + SHARED_PREFIX_MIN_TOKENS)
            sharing = [other for other in next_turn if _share_start(req.prompt_ids, other.prompt_ids, worth)]
            if sharing:
                self.kv.share_prefix(req.kv, max(common_prefix_length(req.prompt_ids, o.prompt_ids) for o in sharing))

    def _computes_again(self, req: Req, batch: list[Req]) -> bool:
        """Whether ``req`` would compute a prefix that a request of ``batch`` computes, and could take from the prefix
        cache a turn later (a repeated prompt is not: the prefill shares it within the batch)."""
        if self.kv.radix is None:
            return False
        for leader in batch:
            assert leader.kv is not None
            if req.prompt_ids != leader.prompt_ids and _share_start(
                req.prompt_ids, leader.prompt_ids, leader.kv.num_cached + SHARED_PREFIX_MIN_TOKENS
            ):
                return True
        return False

    def _reserve_kv(self, req: Req) -> bool:
        """Reserve ``req``'s KV (from its longest cached prefix on); False when it does not fit yet."""
        req.kv = self.kv.admit(req.prompt_ids, self.output_budget(req.prompt_ids, req.sampling_params.max_new_tokens))
        if req.kv is None:
            return False
        req.num_cached_tokens = req.kv.num_cached
        return True


def _share_start(a: list[int], b: list[int], length: int) -> bool:
    """Whether ``a`` and ``b`` both begin with the same ``length`` tokens (slices compare in C, far faster than a
    walk over the tokens for every pair of a batch after a long shared prompt)."""
    return len(a) >= length and len(b) >= length and a[:length] == b[:length]
