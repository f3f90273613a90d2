"""The model runner: the embedded (or a local) Llama-style model, batched prefill/decode over a token KV pool.

The scheduler owns the batching decisions; this class turns them into forwards. A sequence is admitted by
``kv.admit`` (starting from its longest cached prefix) and released by ``kv.release``; ``prefill`` runs the rest
of its prompt, ``decode`` appends one token to each of several sequences, ``extend`` appends several to one
(jump-forward, verifying drafts), ``truncate`` rolls back. Any mix of sequences may be batched: each attends only
to its own rows.

With a tensor-parallel group of several ranks each rank's runner loads and runs one shard of the model (see
``scheduler.model.tensor_parallel``); its KV pool holds only that shard's KV heads, and every forward is a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from scheduler.model.kv_cache import KVCacheManager, KVSequence
from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.llama import ForwardBatch, LlamaModel
from scheduler.model.loader import load_model
from scheduler.model.tensor_parallel import TensorParallelGroup
from scheduler.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model named by ``server_args`` onto ``device`` (float32 on CPU with ``--weight-dtype`` matmul
    weights, bfloat16 elsewhere) with a KV pool of ``--max-total-tokens`` rows and, unless
    ``--disable-radix-cache``, prefix reuse.

    Sequences (``KVSequence``) come from ``kv.admit``; each forward appends tokens to them. Logits are float32
    ``[rows, vocab_size]`` on ``device``; ``vocab_size`` is the model's embedding width, which may exceed
    ``len(tokenizer)``.
    """

    def __init__(self, server_args: ServerArgs, device: str = "cpu", tp: TensorParallelGroup | None = None) -> None:
        tp = tp or TensorParallelGroup()
        loaded = load_model(server_args, tp.rank, tp.size)
        config = loaded.config
        self.device = torch.device(device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        matmul_dtype = getattr(torch, server_args.weight_dtype) if self.device.type == "cpu" else dtype
        self.tokenizer = loaded.tokenizer
        self.vocab_size: int = config.vocab_size
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.max_seq_len = server_args.max_seq_len
        self.model = LlamaModel(
            config, loaded.weights, self.max_seq_len, self.device, dtype, matmul_dtype, loaded.shard, tp
        )
        pool = TokenKVPool(
            num_layers=self.model.num_layers,
            capacity=server_args.max_total_tokens,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=dtype,
            device=self.device,
        )
        self.kv = KVCacheManager(pool, use_radix_cache=not server_args.disable_radix_cache)
        logger.info(
            "model runner on %s (%s, %s matmul weights, tensor-parallel rank %d of %d: weight_bytes=%d, %d of %d "
            "KV heads): KV pool of %d tokens (%.0f KiB each, %.0f MiB in all, taken as used), prefix cache %s",
            self.device,
            dtype,
            matmul_dtype,
            tp.rank,
            tp.size,
            self.model.num_weight_bytes,
            self.model.num_kv_heads,
            config.num_key_value_heads,
            pool.capacity,
            pool.bytes_per_token / 2**10,
            pool.capacity * pool.bytes_per_token / 2**20,
            "on" if self.kv.radix is not None else "off",
        )

    def prefill(self, seqs: list[KVSequence], prompts: list[list[int]]) -> torch.Tensor:
        """Run each prompt past its cached prefix; logits ``[len(seqs), vocab_size]`` after each prompt."""
        if len(seqs) != len(prompts):
            raise ValueError(f"prefill got {len(seqs)} sequences but {len(prompts)} prompts")
        for seq, prompt in zip(seqs, prompts, strict=True):
            if seq.token_ids != list(prompt[: len(seq)]) or len(seq) >= len(prompt):
                raise ValueError("prefill needs a sequence that holds a strict prefix of its prompt")
        return self.forward(seqs, [prompt[len(seq) :] for seq, prompt in zip(seqs, prompts, strict=True)])

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
    ) -> torch.Tensor:
        """Append each sequence's tokens in one forward: logits after the last ``num_logits[i]`` tokens of sequence
        ``i`` (default: its last one), packed in order. Everything is validated before the pool is touched."""
        if not seqs:
            return torch.empty(0, self.vocab_size, device=self.device)
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
        if num_logits is not None and not all(
            1 <= count <= len(tokens) for count, tokens in zip(num_logits, token_lists, strict=True)
        ):
            raise ValueError("each sequence returns logits after 1 to all of its new tokens")
        starts = [len(seq) for seq in seqs]
        for seq, tokens in zip(seqs, token_lists, strict=True):
            self.kv.append(seq, list(tokens))
        batch = ForwardBatch.build([seq.rows for seq in seqs], starts, token_lists, self.device, num_logits)
        return self.model.forward(batch, self.kv.pool)
