"""What the scheduler asks of a model runner, whatever engine runs the forward.

A sequence is admitted by ``kv.admit`` (starting from its longest cached prefix) and released by ``kv.release``;
``prefill`` runs the rest of its prompt, ``decode`` appends one token to each of several sequences, ``extend``
appends several to one (jump-forward, verifying drafts), ``truncate`` rolls back. Any mix of sequences may be
batched: each attends only to its own tokens. Every check on a forward's arguments happens here, before the KV
bookkeeping or the engine is touched; an engine only implements ``_run``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from scheduler.model.kv_cache import KVCacheManager, KVSequence

TOKENS_PER_FORWARD = 40
"""Tokens a decode forward may take before its cost rises with them, for a runner bound by its weight reads: measured
on the exact runner's dense float32 weights, a forward's cost rises little up to ~40 tokens, then with the token
count. (Its block weights: ``scheduler.model.runner.BLOCK_TOKENS_PER_FORWARD``.)"""
LOOKUP_MAX_BATCH = 16
"""From this many requests on, a batch takes no lookup drafts (prompt lookup, the n-gram cache), only the grammar's.
At 32 requests on dense weights a forward's extra token cost more than a lookup draft saved (lookup drafts are
accepted far less often than the grammar's; figures in docs/benchmarks.md). (Block weights:
``scheduler.model.runner.BLOCK_LOOKUP_MAX_BATCH``.)"""


class BaseModelRunner(ABC):
    """The contract: ``tokenizer``, ``vocab_size`` (the logits' width, which may exceed ``len(tokenizer)``),
    ``eos_token_ids``, ``max_seq_len``, ``device`` and ``kv`` (the KV bookkeeping, prefix cache included), set by
    the engine's constructor; and what the loop plans forwards by: ``row_multiple`` (a forward of up to that many
    more tokens costs about as much: rows draft budgets may fill for free), ``tokens_per_forward`` (the tokens a
    decode forward may take: what a batch's pending tokens and drafts share), ``lookup_max_batch`` (the batch size
    from which lookup drafts, right less often than the grammar's, no longer pay) and ``lookup_row_tile`` (where set,
    lookup drafts fill a forward's rows up to a multiple of it and no further: a row past it costs another tile's
    compute, more than a lookup draft saves). Logits are float32 ``[rows, vocab_size]`` on ``device``."""

    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]
    max_seq_len: int
    device: torch.device
    kv: KVCacheManager
    row_multiple: int = 1
    tokens_per_forward: int = TOKENS_PER_FORWARD
    lookup_max_batch: int = LOOKUP_MAX_BATCH
    lookup_row_tile: int | None = None

    def prefill(
        self, seqs: list[KVSequence], prompts: list[list[int]], vocab_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Run each prompt past its cached prefix; logits ``[len(seqs), vocab_size]`` after each prompt
        (``vocab_mask``: ``forward``'s, a row per prompt)."""
        if len(seqs) != len(prompts):
            raise ValueError(f"prefill got {len(seqs)} sequences but {len(prompts)} prompts")
        for seq, prompt in zip(seqs, prompts, strict=True):
            if seq.token_ids != list(prompt[: len(seq)]) or len(seq) >= len(prompt):
                raise ValueError("prefill needs a sequence that holds a strict prefix of its prompt")
        tails = [prompt[len(seq) :] for seq, prompt in zip(seqs, prompts, strict=True)]
        return self.forward(seqs, tails, vocab_mask=vocab_mask)

    def decode(self, seqs: list[KVSequence], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each running sequence in one forward; logits ``[len(seqs), vocab_size]``."""
        if len(seqs) != len(token_ids):
            raise ValueError(f"decode got {len(seqs)} sequences but {len(token_ids)} tokens")
        return self.forward(seqs, [[token] for token in token_ids])

    def extend(self, seq: KVSequence, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Append several tokens to one sequence: logits ``[vocab_size]`` after the last one, or with
        ``all_logits`` ``[len(token_ids), vocab_size]`` after each."""
        logits = self.forward([seq], [token_ids], [len(token_ids)] if all_logits else None)
        return logits if all_logits else logits[0]

    def truncate(self, seq: KVSequence, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``seq`` (rollback); the next token goes at ``length``."""
        self.kv.truncate(seq, length)

    def forward(
        self,
        seqs: Sequence[KVSequence],
        token_lists: Sequence[Sequence[int]],
        num_logits: Sequence[int] | None = None,
        vocab_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append each sequence's tokens in one forward: logits after the last ``num_logits[i]`` tokens of sequence
        ``i`` (default: its last one), packed in order. Everything is validated before the pool is touched.
        ``vocab_mask``: the logits rows' grammar masks (int32 bit words, a row each), where the caller masks the
        logits by them afterwards: an engine may then leave what they disallow uncomputed (-inf); the allowed
        logits are the same either way."""
        if not seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
        self._warm(sum(len(tokens) for tokens in token_lists))
        if len({id(seq) for seq in seqs}) != len(seqs):
            raise ValueError("a batch may hold each sequence once")
        for seq, tokens in zip(seqs, token_lists, strict=True):
            if not tokens:
                raise ValueError("appending to a sequence needs at least one token")
            if min(tokens) < 0 or max(tokens) >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {min(tokens)}..{max(tokens)}")
            if len(seq) + len(tokens) > self.max_seq_len:
                raise ValueError(
                    f"the sequence holds {len(seq)} tokens; {len(tokens)} more would exceed --max-seq-len "
                    f"{self.max_seq_len}: finish the request (finish_reason 'length') or raise --max-seq-len"
                )
            if len(tokens) > seq.reserved:
                raise ValueError(f"{len(tokens)} new tokens exceed the {seq.reserved} the request reserved")
        if num_logits is None:
            num_logits = [1] * len(seqs)
        elif not all(1 <= count <= len(tokens) for count, tokens in zip(num_logits, token_lists, strict=True)):
            raise ValueError("each sequence returns logits after 1 to all of its new tokens")
        starts = [len(seq) for seq in seqs]
        for seq, tokens in zip(seqs, token_lists, strict=True):
            self.kv.append(seq, list(tokens))
        return self._run(seqs, starts, token_lists, num_logits, vocab_mask)

    def _warm(self, num_tokens: int) -> None:
        """Called by each forward of ``num_tokens`` new tokens before it checks and prepares them: an engine may
        start reading its weights meanwhile. Nothing by default."""

    @abstractmethod
    def _run(
        self,
        seqs: Sequence[KVSequence],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        num_logits: Sequence[int],
        vocab_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The engine's forward over tokens already appended to ``kv`` (sequence ``i``'s new tokens sit at positions
        ``starts[i]`` on): the logits after the last ``num_logits[i]`` new tokens of each sequence, packed in order
        (``vocab_mask``: ``forward``'s)."""
