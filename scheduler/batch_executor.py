"""One batch of the loop: mask, forward, sample, accept tokens (verified drafts, forced tokens), and who finished
(``FinishPolicy`` decides). The masks are filled before the forward, which takes them: the model runner may leave
uncomputed the logits they disallow (on the exact runner, the lm_head's panels a sparse row never reads).

The executor runs batches on the model runner: the scheduler admits requests into KV memory (the runner's ``kv``)
and asks the executor to run prefill and decode batches of them; nothing calls back up. A decode forward takes each
request's pending tokens and its drafts (``scheduler.speculative``) and returns logits after the last pending token
and after each draft; one mask row and one sample per position decide how many drafts stand. On several ranks every
rank runs the same batch; rank 0's drafts and sampled tokens and every rank's per-request failures are agreed through
``RankSync``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from scheduler.budget_steering import BudgetSteering
from scheduler.finish_policy import FinishPolicy
from scheduler.grammar_steps import accept_token
from scheduler.io_struct import AbortCause, TokenLogprob
from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.rank_sync import RankSync
from scheduler.request import Abort, Req
from scheduler.sampler import row_logprobs, sample
from scheduler.sampling_batch_info import SamplingBatchInfo
from scheduler.speculative import NO_DRAFTS, DraftProposer, Drafts
from sglang_constrained.backends.base import common_prefix_length

logger = logging.getLogger(__name__)

NO_TOKEN_ALLOWED = Abort(
    AbortCause.UNSATISFIABLE, "the grammar allows no token here: the constraint cannot be completed"
)


@dataclass
class SpeculationStats:
    """What speculation saved: forwards per output token, forced tokens, and per draft source the tokens proposed
    and accepted and the runs (request-forwards it proposed in)."""

    num_forwards: int = 0
    num_output_tokens: int = 0
    num_forced_tokens: int = 0
    drafts_proposed: dict[str, int] = field(default_factory=dict)
    drafts_accepted: dict[str, int] = field(default_factory=dict)
    draft_runs: dict[str, int] = field(default_factory=dict)

    def record_drafts(self, drafts: Drafts, num_accepted: int) -> None:
        for source in set(drafts.sources):
            self.draft_runs[source] = self.draft_runs.get(source, 0) + 1
        for i, source in enumerate(drafts.sources):
            self.drafts_proposed[source] = self.drafts_proposed.get(source, 0) + 1
            self.drafts_accepted[source] = self.drafts_accepted.get(source, 0) + (i < num_accepted)


class BatchExecutor:
    def __init__(
        self,
        model_runner: BaseModelRunner,
        sampling_info: SamplingBatchInfo,
        proposer: DraftProposer,
        finish_policy: FinishPolicy,
        rank_sync: RankSync | None = None,
        budget: BudgetSteering | None = None,
    ) -> None:
        """``budget``: steers constrained rows near their token budget (None: budget-aware constraints off)."""
        self.model_runner = model_runner
        self.budget = budget
        self.sampling_info = sampling_info
        self.proposer = proposer
        self.finish_policy = finish_policy
        self.rank_sync = rank_sync
        self.num_batches = 0
        self.stats = SpeculationStats()

    def prefill(self, batch: list[Req]) -> None:
        """Run the prompts of newly scheduled requests and sample each one's first token. A request repeating the
        prompt of one before it in ``batch`` (``n`` samples) runs no forward of its own where the prefix cache lets it
        take that request's prompt KV and first logits: every sample then starts from the same bits (those logits are
        computed for the union of the sharing requests' masks)."""
        leaders, sharing = self._prompt_leaders(batch)
        computing = sorted(set(leaders))
        seqs = [_kv(batch[i]) for i in computing]
        logit_rows = [computing.index(lead) for lead in leaders]
        kv = self.model_runner.kv

        def forward(mask: torch.Tensor | None) -> torch.Tensor:
            prompts = [batch[i].prompt_ids for i in computing]
            logits = self.model_runner.prefill(seqs, prompts, _union_of_rows(mask, logit_rows, len(computing)))
            for lead in sharing:  # in the order their sharing was checked
                kv.share_prefix(_kv(batch[lead]), len(batch[lead].prompt_ids))
            for req, lead in zip(batch, leaders, strict=True):
                if req is not batch[lead]:
                    kv.share_prompt(_kv(batch[lead]), _kv(req), len(req.prompt_ids))
                    req.num_cached_tokens = len(req.prompt_ids)
            return logits[logit_rows]

        self._run(batch, [NO_DRAFTS] * len(batch), forward)

    def _prompt_leaders(self, batch: list[Req]) -> tuple[list[int], list[int]]:
        """Per request, the index of the request whose forward computes its prompt: the first of ``batch`` with the
        same prompt where its KV can be shared, else its own; and the sharing requests, in order. A prompt is shared
        through the prefix cache, so it cannot be where the cache (or a prompt shared before it in this batch) will
        hold more of it than its first request reused: those rows would not be the ones that request computed."""
        kv = self.model_runner.kv
        first: dict[tuple[int, ...], int] = {}
        leaders: list[int] = []
        sharing: list[int] = []
        for i, req in enumerate(batch):
            lead = first.setdefault(tuple(req.prompt_ids), i)
            if lead != i and lead not in sharing:
                reused = _kv(batch[lead]).num_cached
                overlaps = (common_prefix_length(req.prompt_ids, batch[j].prompt_ids) > reused for j in sharing)
                if kv.can_share_prompt(_kv(batch[lead]), req.prompt_ids) and not any(overlaps):
                    sharing.append(lead)
            leaders.append(lead if lead in sharing else i)
        return leaders, sharing

    def decode(self, batch: list[Req]) -> None:
        """Advance every running request of ``batch``: its pending tokens and drafts in one forward, then as many
        tokens as its verified drafts allow (at least one)."""
        pending = [req.pending_ids for req in batch]
        room = [self._draft_room(req) - len(tokens) for req, tokens in zip(batch, pending, strict=True)]
        drafts = self.proposer.propose(batch, pending, room)
        if self.rank_sync is not None:
            drafts = self.rank_sync.leader_drafts(drafts)
        seqs = [_kv(req) for req in batch]
        token_lists = [tokens + d.token_ids for tokens, d in zip(pending, drafts, strict=True)]
        num_logits = [len(d.token_ids) + 1 for d in drafts]
        self._run(batch, drafts, lambda mask: self.model_runner.forward(seqs, token_lists, num_logits, mask))

    def _draft_room(self, req: Req) -> int:
        """Tokens ``req`` may take in one forward (pending and drafts): its ``_room``, and no draft near its budget."""
        room = self._room(req)
        drafts = self.budget.draft_room(req) if self.budget is not None else None
        return room if drafts is None else min(room, len(req.pending_ids) + drafts)

    def _room(self, req: Req) -> int:
        """Tokens ``req``'s KV may still take in one forward (its reservation and the context)."""
        seq = _kv(req)
        return min(seq.reserved, self.model_runner.max_seq_len - len(seq))

    def _run(
        self, batch: list[Req], drafts: list[Drafts], forward: Callable[[torch.Tensor | None], torch.Tensor]
    ) -> None:
        """Forward, sample every row, then walk each request's rows; a failure aborts its request only (on every
        rank). ``forward(mask)``: the batch's logits, given the rows' grammar masks (None: no row is masked)."""
        self.num_batches += 1
        self.stats.num_forwards += 1
        row_tokens, logprobs, failures = self._forward_and_sample(batch, drafts, forward)
        if self.rank_sync is not None:
            row_tokens = self.rank_sync.leader_tokens(row_tokens)
        first_row = 0
        for req, req_drafts in zip(batch, drafts, strict=True):
            num_rows = len(req_drafts.token_ids) + 1
            rows = row_tokens[first_row : first_row + num_rows]
            req_logprobs = [logprobs.get(row) for row in range(first_row, first_row + num_rows)]
            first_row += num_rows
            if req.rid not in failures:
                failure = self._walk(req, req_drafts, rows, req_logprobs)
                if failure is not None:
                    failures[req.rid] = failure
        if self.rank_sync is not None:
            failures = self.rank_sync.agree_batch_failures([req.rid for req in batch], failures)
        for req in batch:
            if req.rid in failures:
                req.abort(failures[req.rid])

    def _walk(
        self, req: Req, drafts: Drafts, row_tokens: list[int | None], logprobs: list[torch.Tensor | None]
    ) -> Abort | None:
        """Accept row 0's token, and row ``j + 1``'s while row ``j``'s token is draft ``j`` (its logits then follow
        the right tokens); stop at a finish. Roll the KV back to what stood, then append forced tokens.
        ``logprobs[j]``: row ``j``'s log-probabilities, where the request asked for them."""
        num_accepted = 0
        failure = None
        for j, token in enumerate(row_tokens):
            if j > 0 and self.budget is not None and token is not None and not self.budget.may_take(req, token):
                break  # a choice after the drafts whose ending would not fit: steered as the next step's first row
            failure = self._accept(req, token, logprobs[j])
            if failure is not None or req.finished:
                break
            if j == len(drafts.token_ids) or token != drafts.token_ids[j]:
                break
            num_accepted += 1
        self.stats.record_drafts(drafts, num_accepted)
        self.proposer.record(req, drafts, num_accepted)
        if req.kv is not None:
            self.model_runner.truncate(req.kv, min(len(req.kv), len(req.prompt_ids) + len(req.output_ids) - 1))
        if failure is None and not req.finished:
            failure = self._append_forced_tokens(req)
        return failure

    def _append_forced_tokens(self, req: Req) -> Abort | None:
        """Jump-forward: while the grammar allows exactly one token, append it (no sampling could pick another)."""
        grammar = req.ready_grammar
        if not self.proposer.enabled or grammar is None:
            return None
        while not grammar.finished and not grammar.is_terminated() and len(req.pending_ids) < self._room(req):
            token = self.proposer.forced_token(grammar)
            if token is None:
                return None
            failure = self._accept(req, token, None)
            self.stats.num_forced_tokens += 1
            if failure is not None or req.finished:
                return failure
        return None

    def _forward_and_sample(
        self, batch: list[Req], drafts: list[Drafts], forward: Callable[[torch.Tensor | None], torch.Tensor]
    ) -> tuple[list[int | None], dict[int, torch.Tensor], dict[str, Abort]]:
        """Every row's token, the log-probabilities of rows whose request asked for them, and failures by rid. The
        masks are filled before the forward (they follow the tokens accepted so far and the drafts), so that the
        engine may skip what they disallow."""
        info = self.sampling_info
        try:
            with torch.inference_mode():
                info.prepare(batch, [d.token_ids for d in drafts])
                info.update_regex_vocab_mask()
                logits = forward(info.vocab_mask)
                info.apply_logits_bias(logits)
                greedy = [req.sampling_params.temperature == 0 for req in batch]
                request_rows = info.request_rows()
                watched: list[int] = []
                if self.budget is not None:
                    self.budget.steer(batch, request_rows, logits, greedy)
                    watched = self.budget.watched_rows(batch, request_rows, greedy)
                logprobs = row_logprobs(logits, info.rows)
                tokens = sample(logits, info.rows)  # reads the logits: the refused rows are steered from them
                if watched:
                    self._sample_refused_again(batch, request_rows, watched, logits, tokens, logprobs)
        except Exception as e:  # an internal failure aborts this batch, not the server
            logger.exception("a batch of %d requests failed", len(batch))
            failure = Abort(AbortCause.INTERNAL, f"internal error while generating: {type(e).__name__}: {e}")
            return [None] * sum(len(d.token_ids) + 1 for d in drafts), {}, {req.rid: failure for req in batch}
        failures = {
            batch[i].rid: Abort(AbortCause.GRAMMAR_ENGINE, f"the grammar failed to compute the next-token mask: {e}")
            for i, e in info.fill_errors.items()
        }
        return tokens, logprobs, failures

    def _sample_refused_again(
        self,
        batch: list[Req],
        request_rows: list[range],
        watched: list[int],
        logits: torch.Tensor,
        tokens: list[int | None],
        logprobs: dict[int, torch.Tensor],
    ) -> None:
        """Sample again the ``watched`` rows whose token budget steering refused, from their steered logits (their
        log-probabilities too)."""
        assert self.budget is not None
        refused = self.budget.refused_samples(batch, request_rows, watched, logits, tokens)
        if not refused:
            return
        rows = self.sampling_info.rows.select(refused)
        again = logits[refused]
        for row, row_logprob in row_logprobs(again, rows).items():
            logprobs[refused[row]] = row_logprob
        for row, token in zip(refused, sample(again, rows), strict=True):
            tokens[row] = token

    def _accept(self, req: Req, token: int | None, logprobs: torch.Tensor | None) -> Abort | None:
        """Append ``token`` (and its logprob, from ``logprobs``; None for a forced token, which had probability 1),
        feed it to the grammar, and see whether the request has finished; returns why it must fail, if it must."""
        if token is None:
            return NO_TOKEN_ALLOWED
        req.output_ids.append(token)
        if req.top_logprobs_num is not None:
            req.output_logprobs.append(_token_logprob(token, logprobs, req.top_logprobs_num))
        self.stats.num_output_tokens += 1
        failure = accept_token(req, token, self.model_runner.tokenizer)
        if failure is None:
            if self.budget is not None:
                self.budget.record(req, token)
            self.finish_policy.check(req, token)
        return failure


def _token_logprob(token: int, logprobs: torch.Tensor | None, num_top: int) -> TokenLogprob:
    """``token``'s logprob and the ``num_top`` most likely tokens' (never a disallowed one, whose logprob is -inf).
    ``logprobs`` None: a token the grammar forced, whose row would have allowed it alone (logprob exactly 0)."""
    if logprobs is None:
        return TokenLogprob(token, 0.0, [(token, 0.0)] if num_top else [])
    top: list[tuple[int, float]] = []
    if num_top:
        values, ids = logprobs.topk(min(num_top, logprobs.shape[0]))
        top = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != float("-inf")]
    return TokenLogprob(token, float(logprobs[token]), top)


def _union_of_rows(mask: torch.Tensor | None, owners: list[int], count: int) -> torch.Tensor | None:
    """``count`` mask rows, row ``r`` allowing what any row ``i`` of ``mask`` with ``owners[i] == r`` allows: the
    logits a shared prompt computes serve each request sharing it. None without a mask."""
    if mask is None:
        return None
    union = torch.zeros(count, mask.shape[1], dtype=mask.dtype, device=mask.device)
    for row, owner in enumerate(owners):
        union[owner] |= mask[row]
    return union


def _kv(req: Req) -> KVSequence:
    if req.kv is None:
        raise RuntimeError(f"request {req.rid} is scheduled without KV memory")
    return req.kv
