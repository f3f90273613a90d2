"""The model runner: the embedded (or a local) Llama-style model, batched prefill/decode over a slot KV cache.

The scheduler owns the batching decisions; this class turns them into forwards. A sequence lives in one
KV-cache slot from ``allocate_slot`` to ``free_slot``; ``prefill`` fills empty slots, ``decode`` appends one
token to each of several running slots, ``extend`` appends several to one (jump-forward), ``truncate``
rolls back. Any mix of slots may be batched: each sequence attends only to its own cached prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from scheduler.model.kv_cache import KVCache
from scheduler.model.llama import ForwardBatch, LlamaModel
from scheduler.model.loader import load_model
from scheduler.server_args import ServerArgs

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the model named by ``server_args`` onto ``device`` (float32 on CPU, bfloat16 elsewhere).

    Logits are always float32 ``[num_sequences, vocab_size]`` on ``device``; ``vocab_size`` is the model's
    embedding width, which may exceed ``len(tokenizer)``.
    """

    def __init__(self, server_args: ServerArgs, device: str = "cpu") -> None:
        loaded = load_model(server_args)
        config = loaded.config
        self.device = torch.device(device)
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.tokenizer = loaded.tokenizer
        self.vocab_size: int = config.vocab_size
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.max_seq_len = server_args.max_seq_len
        self.model = LlamaModel(config, loaded.weights, self.max_seq_len, self.device, dtype)
        self.kv_cache = KVCache(
            num_layers=self.model.num_layers,
            num_slots=server_args.max_running_requests,
            max_seq_len=self.max_seq_len,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=dtype,
            device=self.device,
        )
        cache_mib = 2 * self.kv_cache.k.numel() * self.kv_cache.k.element_size() / 2**20
        logger.info(
            "model runner on %s (%s): %d slots x %d positions, KV cache %.0f MiB",
            self.device,
            dtype,
            self.kv_cache.num_slots,
            self.max_seq_len,
            cache_mib,
        )

    @property
    def num_free_slots(self) -> int:
        return self.kv_cache.num_free_slots

    def allocate_slot(self) -> int:
        """An empty KV-cache slot for a new sequence; RuntimeError when all are in use (check num_free_slots)."""
        return self.kv_cache.allocate()

    def free_slot(self, slot: int) -> None:
        self.kv_cache.free(slot)

    def seq_len(self, slot: int) -> int:
        """Tokens cached for the sequence in ``slot``."""
        return self.kv_cache.length(slot)

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Fill empty ``slots`` with ``prompts`` in one packed forward; logits ``[len(slots), vocab_size]``."""
        if len(slots) != len(prompts):
            raise ValueError(f"prefill got {len(slots)} slots but {len(prompts)} prompts")
        for slot in slots:
            if self.kv_cache.length(slot) != 0:
                raise ValueError(
                    f"prefill needs an empty slot; slot {slot} already holds {self.kv_cache.length(slot)} "
                    "tokens (append with extend, or free it and allocate a new one)"
                )
        return self._forward(slots, prompts)

    def decode(self, slots: list[int], token_ids: list[int]) -> torch.Tensor:
        """Append one token to each running sequence in one forward; logits ``[len(slots), vocab_size]``."""
        if len(slots) != len(token_ids):
            raise ValueError(f"decode got {len(slots)} slots but {len(token_ids)} tokens")
        return self._forward(slots, [[token] for token in token_ids])

    def extend(self, slot: int, token_ids: list[int]) -> torch.Tensor:
        """Append several tokens to one sequence (jump-forward); logits ``[vocab_size]`` after the last one."""
        return self._forward([slot], [token_ids])[0]

    def truncate(self, slot: int, length: int) -> None:
        """Keep only the first ``length`` cached tokens of ``slot`` (rollback); the next token goes at ``length``."""
        self.kv_cache.truncate(slot, length)

    def _forward(self, slots: Sequence[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Validate everything before touching the cache, run one forward, then record the new lengths."""
        if not slots:
            return torch.empty(0, self.vocab_size, device=self.device)
        if len(set(slots)) != len(slots):
            raise ValueError(f"a batch may hold each slot once; got {list(slots)}")
        starts = [
            self.kv_cache.check_append(slot, len(tokens)) for slot, tokens in zip(slots, token_lists, strict=True)
        ]
        for tokens in token_lists:
            if min(tokens) < 0 or max(tokens) >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}); got {min(tokens)}..{max(tokens)}")
        batch = ForwardBatch.build(slots, starts, token_lists, self.device)
        logits = self.model.forward(batch, self.kv_cache)
        for slot, tokens in zip(slots, token_lists, strict=True):
            self.kv_cache.append(slot, len(tokens))
        return logits
