"""The model runner: the embedded (or a local) Llama-style model in torch, batched prefill/decode over a token KV
pool (the contract it fulfils: ``scheduler.model.runner_contract``).

With a tensor-parallel group of several ranks each rank's runner loads and runs one shard of the model (see
``scheduler.model.tensor_parallel``); its KV pool holds only that shard's KV heads, and every forward is a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from cpu_kernels import library
from scheduler.model.kv_cache import KVCacheManager, KVSequence
from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.llama import ForwardBatch, LlamaModel, one_torch_thread
from scheduler.model.loader import load_model
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.model.tensor_parallel import TensorParallelGroup
from scheduler.server_args import ModelArgs

logger = logging.getLogger(__name__)

BLOCK_TOKENS_PER_FORWARD = 48
"""The tokens a decode forward takes (pending and drafts over the batch) when its weights are GGUF blocks. Their rows
cost compute, not weight reads (a k = 8 extend ~2x a decode step), so no row is free (``row_multiple`` 1: a second row
of Q8_0 or Q4_1 costs ~1.09x since it streams with the first, but taking it free, with a one-token guess where no
source drafts, measured no faster at C = 1, docs/benchmarks.md); but the
grammar's drafts, right 0.96-1.00 of the time in batches, pay for their rows at any batch size measured. Chosen with
``BLOCK_LOOKUP_MAX_BATCH`` by ``bench_serving.py --concurrency 1 8 32 --temperature 0`` over budgets of 8, 24, 32
and 48 (docs/benchmarks.md)."""
BLOCK_LOOKUP_MAX_BATCH = 4
"""On block weights a batch of this many requests takes no lookup drafts: right 0.3-0.45 of the time, at 8 requests
they made free text 0.96x and JSON 0.95x as fast as no speculation (docs/benchmarks.md)."""


class ModelRunner(BaseModelRunner):
    """Loads the model named by ``model_args`` onto the CPU (float32 activations, ``--weight-dtype`` matmul
    weights, on the batch-invariant kernels of ``cpu_kernels``) with a KV pool of
    ``--max-total-tokens`` rows and, unless ``--disable-radix-cache``, prefix reuse.

    Sequences (``KVSequence``) come from ``kv.admit``; each forward appends tokens to them. Logits are float32
    ``[rows, vocab_size]`` on ``device``; ``vocab_size`` is the model's embedding width, which may exceed
    ``len(tokenizer)``.
    """

    def __init__(self, model_args: ModelArgs, tp: TensorParallelGroup | None = None) -> None:
        tp = tp or TensorParallelGroup()
        library.load(model_args.kernel_build_path)
        matmul_dtype = torch.bfloat16 if model_args.weight_dtype == "bfloat16" else torch.float32
        with one_torch_thread():  # reading and packing the weights are copies
            loaded = load_model(model_args, tp.rank, tp.size)
            self.model = LlamaModel(
                loaded.config, loaded.weights, model_args.max_seq_len, matmul_dtype, loaded.shard, tp
            )
        config = loaded.config
        self.device = torch.device("cpu")
        self.tokenizer = loaded.tokenizer
        self.vocab_size: int = config.vocab_size
        self.eos_token_ids: list[int] = loaded.eos_token_ids
        self.max_seq_len = model_args.max_seq_len
        if self.model.has_block_weights:
            self.row_multiple, self.tokens_per_forward = 1, BLOCK_TOKENS_PER_FORWARD
            self.lookup_max_batch = BLOCK_LOOKUP_MAX_BATCH
            self.lookup_row_tile = self.model.row_tile
        else:
            self.row_multiple = library.row_tile()
        pool = TokenKVPool(
            num_layers=self.model.num_layers,
            capacity=model_args.max_total_tokens,
            num_kv_heads=self.model.num_kv_heads,
            head_dim=self.model.head_dim,
            dtype=kv_cache_dtype(model_args.kv_cache_dtype, self.model.has_block_weights),
            device=self.device,
        )
        self.kv = KVCacheManager(pool, use_radix_cache=not model_args.disable_radix_cache)
        logger.info(
            "model runner on the CPU (batch-invariant %s kernels, matmul weights: %s; tensor-parallel rank %d of %d: "
            "weight_bytes=%d, %d of %d KV heads): KV pool of %d tokens of %s (%.0f KiB each, %.0f MiB in all, taken "
            "as used), prefix cache %s",
            library.isa(),
            self.model.weight_formats,
            tp.rank,
            tp.size,
            self.model.num_weight_bytes,
            self.model.num_kv_heads,
            config.num_key_value_heads,
            pool.capacity,
            str(pool.k.dtype).removeprefix("torch."),
            pool.bytes_per_token / 2**10,
            pool.capacity * pool.bytes_per_token / 2**20,
            "on" if self.kv.radix is not None else "off",
        )

    def _warm(self, num_tokens: int) -> None:
        """A decode step's Python leaves the memory idle: its first weights stream meanwhile
        (``LlamaModel.warm_weights``)."""
        self.model.warm_weights(num_tokens)

    def _run(
        self,
        seqs: Sequence[KVSequence],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        num_logits: Sequence[int],
        vocab_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch = ForwardBatch.build([seq.row_tensor() for seq in seqs], starts, token_lists, num_logits)
        return self.model.forward(batch, self.kv.pool, vocab_mask)


def kv_cache_dtype(setting: str, has_block_weights: bool) -> torch.dtype:
    """``--kv-cache-dtype`` as a torch dtype: ``auto`` rounds K and V to float16 where the matmul weights are quantised
    blocks (whose rounding is far coarser: docs/benchmarks.md compares the three) and keeps float32 beside float
    weights, which reproduce transformers' logits."""
    if setting == "auto":
        return torch.float16 if has_block_weights else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[setting]
