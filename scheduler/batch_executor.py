"""One batch of the loop: forward, mask, sample, accept each token, decide who finished.

The executor owns the model runner: the scheduler asks it to admit requests into KV memory and to run prefill and
decode batches, and it calls the model; nothing calls back up. On several ranks every rank runs the same batch; rank 0's
sampled tokens and every rank's per-request failures are agreed through ``RankSync``.
"""

from __future__ import annotations

import logging

import torch

from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner import ModelRunner
from scheduler.rank_sync import RankSync
from scheduler.request import Req
from scheduler.sampler import sample
from scheduler.sampling_batch_info import SamplingBatchInfo
from sglang_constrained.errors import TokenRejectedError

logger = logging.getLogger(__name__)


class BatchExecutor:
    def __init__(
        self,
        model_runner: ModelRunner,
        sampling_info: SamplingBatchInfo,
        generator: torch.Generator,
        rank_sync: RankSync | None = None,
    ) -> None:
        self.model_runner = model_runner
        self.sampling_info = sampling_info
        self.generator = generator
        self.rank_sync = rank_sync
        self.num_batches = 0

    @property
    def num_free_kv_tokens(self) -> int:
        """KV rows a new request could still reserve (free, or held only by unlocked cached prefixes)."""
        return self.model_runner.kv.num_available

    @property
    def cache_hit_rate(self) -> float:
        return self.model_runner.kv.cache_hit_rate

    def check_fits(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """Raise ``ValueError`` for a request the KV cache could never hold."""
        self.model_runner.kv.check_fits(len(prompt_ids), self._output_budget(prompt_ids, max_new_tokens))

    def admit(self, req: Req) -> bool:
        """Reserve ``req``'s KV (from its longest cached prefix on); False when it does not fit yet."""
        budget = self._output_budget(req.prompt_ids, req.sampling_params.max_new_tokens)
        req.kv = self.model_runner.kv.admit(req.prompt_ids, budget)
        if req.kv is None:
            return False
        req.num_cached_tokens = req.kv.num_cached
        return True

    def release(self, req: Req) -> None:
        """``req`` is done: its KV rows go to the prefix cache (or back to the pool)."""
        if req.kv is not None:
            self.model_runner.kv.release(req.kv)
            req.kv = None

    def _output_budget(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        return max(1, min(max_new_tokens, self.model_runner.max_seq_len - len(prompt_ids)))

    def prefill(self, batch: list[Req]) -> None:
        """Run the prompts of newly scheduled requests and sample each one's first token."""
        self._run(batch, is_prefill=True)

    def decode(self, batch: list[Req]) -> None:
        """Advance every running request of ``batch`` by one token."""
        self._run(batch, is_prefill=False)

    def _run(self, batch: list[Req], is_prefill: bool) -> None:
        """A failure aborts its request only (on every rank)."""
        self.num_batches += 1
        tokens, failures = self._forward_and_sample(batch, is_prefill)
        if self.rank_sync is not None:
            tokens = self.rank_sync.leader_tokens(tokens)
        for req, token in zip(batch, tokens, strict=True):
            if req.rid in failures:
                continue
            failure = self._accept(req, token)
            if failure is not None:
                failures[req.rid] = failure
        if self.rank_sync is not None:
            failures = self.rank_sync.agree_batch_failures([req.rid for req in batch], failures)
        for req in batch:
            if req.rid in failures:
                req.abort(failures[req.rid])

    def _forward(self, batch: list[Req], is_prefill: bool) -> torch.Tensor:
        seqs = [_kv(req) for req in batch]
        if is_prefill:
            return self.model_runner.prefill(seqs, [req.prompt_ids for req in batch])
        return self.model_runner.decode(seqs, [req.output_ids[-1] for req in batch])

    def _forward_and_sample(self, batch: list[Req], is_prefill: bool) -> tuple[list[int | None], dict[str, str]]:
        info = self.sampling_info
        try:
            with torch.inference_mode():
                logits = self._forward(batch, is_prefill)
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


def _kv(req: Req) -> KVSequence:
    if req.kv is None:
        raise RuntimeError(f"request {req.rid} is scheduled without KV memory")
    return req.kv
