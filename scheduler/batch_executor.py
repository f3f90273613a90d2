"""One batch of the loop: forward, mask, sample, accept each token, decide who finished.

On several ranks every rank runs the same batch; rank 0's sampled tokens are broadcast so that every rank's
grammars advance with the same token, and per-request failures are agreed (failed on any rank, failed on all)
together with a check that every rank ran the same batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from scheduler.distributed import DistributedContext, RankFailureError
from scheduler.model_runner import ModelRunner
from scheduler.request import Req
from scheduler.sampler import sample
from scheduler.sampling_batch_info import SamplingBatchInfo
from sglang_constrained.base_grammar_backend import TokenRejectedError

logger = logging.getLogger(__name__)

Forward = Callable[[list[Req]], torch.Tensor]


class BatchExecutor:
    def __init__(
        self,
        model_runner: ModelRunner,
        sampling_info: SamplingBatchInfo,
        generator: torch.Generator,
        dist: DistributedContext | None = None,
    ) -> None:
        self.model_runner = model_runner
        self.sampling_info = sampling_info
        self.generator = generator
        self.dist = dist
        self.num_batches = 0

    def run(self, batch: list[Req], forward: Forward) -> None:
        """Advance every request of ``batch`` by one token; a failure aborts its request only (on every rank)."""
        self.num_batches += 1
        tokens, failures = self._forward_and_sample(batch, forward)
        if self.dist is not None:
            tokens = self.dist.broadcast_tokens(tokens)
        for req, token in zip(batch, tokens, strict=True):
            if req.rid in failures:
                continue
            failure = self._accept(req, token)
            if failure is not None:
                failures[req.rid] = failure
        if self.dist is not None:
            failures = self._agree(batch, failures)
        for req in batch:
            if req.rid in failures:
                req.abort(failures[req.rid])

    def _forward_and_sample(self, batch: list[Req], forward: Forward) -> tuple[list[int | None], dict[str, str]]:
        info = self.sampling_info
        try:
            with torch.inference_mode():
                logits = forward(batch)
                info.prepare(batch)
                info.update_regex_vocab_mask()
                info.apply_logits_bias(logits)
                tokens = sample(logits, info, self.generator)
        except Exception as e:  # an internal failure aborts this batch, not the server
            logger.exception("a batch of %d requests failed", len(batch))
            message = f"internal error while generating: {type(e).__name__}: {e}"
            return [None] * len(batch), {req.rid: message for req in batch}
        failures = {
            batch[row].rid: f"the grammar failed to compute the next-token mask: {e}"
            for row, e in info.fill_errors.items()
        }
        return tokens, failures

    def _accept(self, req: Req, token: int | None) -> str | None:
        """Append ``token`` and feed it to the grammar; returns why the request must fail, if it must."""
        if token is None:
            return "the grammar allows no token here: the constraint cannot be completed"
        req.output_ids.append(token)
        grammar = req.ready_grammar
        if grammar is not None and not grammar.is_terminated():
            kind = req.grammar_key[0] if req.grammar_key else "request's"
            try:
                grammar.accept_token(token)
            except TokenRejectedError as e:
                piece = self.model_runner.tokenizer.decode([token])
                return f"token {token} ({piece!r}) was rejected by the {kind} grammar: {e}"
            except Exception as e:  # an engine failure must not take the other requests down
                logger.exception("request %s: the %s grammar failed on token %d", req.rid, kind, token)
                return f"the {kind} grammar failed on token {token}: {e}"
        self._check_finished(req, token)
        return None

    def _check_finished(self, req: Req, token: int) -> None:
        assert req.text is not None
        req.text.update(req.output_ids)
        grammar = req.ready_grammar
        max_seq_len = self.model_runner.max_seq_len
        if token in self.model_runner.eos_token_ids or (grammar is not None and grammar.is_terminated()):
            req.finish("stop", matched=token)
        elif req.text.matched_stop is not None:
            req.finish("stop", matched=req.text.matched_stop)
        elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finish("length")
        elif len(req.prompt_ids) + len(req.output_ids) >= max_seq_len:
            req.finish("length", message=f"reached the context limit of {max_seq_len} tokens")

    def _agree(self, batch: list[Req], failures: dict[str, str]) -> dict[str, str]:
        """Failures of any rank, with the lowest rank's message; raises if the ranks ran different batches."""
        assert self.dist is not None
        rids = [req.rid for req in batch]
        gathered = self.dist.all_gather((rids, failures))
        if any(rank_rids != rids for rank_rids, _ in gathered):
            raise RankFailureError(
                f"rank {self.dist.rank}: the ranks ran different batches: {[g[0] for g in gathered]}"
            )
        agreed: dict[str, str] = {}
        for _, rank_failures in gathered:
            for rid, message in rank_failures.items():
                agreed.setdefault(rid, message)
        if agreed.keys() != failures.keys():
            logger.info(
                "rank %d: requests failed on another rank: %s", self.dist.rank, sorted(agreed.keys() - failures.keys())
            )
        return agreed
