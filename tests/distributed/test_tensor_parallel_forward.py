"""The sharded Llama forward over real gloo ranks (torch.multiprocessing), against one rank's forward of the same
weights: small random-weight models, so no model download and seconds per case.

Each rank reads only its shard from a safetensors folder, as the server does, and runs a prefill (a long prompt and a
short one) and a decode step with several logit rows per sequence. One rank group per group size runs every family.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from cpu_kernels import library
from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.llama import ForwardBatch, LlamaModel
from scheduler.model.loader import read_weights
from scheduler.model.tensor_parallel import ShardPlan, TensorParallelGroup
from scheduler.server_args import ModelArgs
from scheduler.testing.process import free_port
from tests.helpers import write_random_model
from tests.tiny_models import random_norms

pytestmark = pytest.mark.multirank

MAX_POSITIONS = 128
# SmolLM2's head layout (9 query heads in 3 KV groups), with MLP and vocabulary sizes two ranks split unevenly.
SHAPE: dict[str, Any] = {
    "vocab_size": 101,
    "hidden_size": 144,
    "intermediate_size": 99,
    "num_hidden_layers": 2,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": MAX_POSITIONS,
}
CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen2-biases": lambda: Qwen2Config(**SHAPE, tie_word_embeddings=False, use_sliding_window=False),
    "qwen3-head-norms": lambda: Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=False),
    "phi3-fused": lambda: Phi3Config(**SHAPE, pad_token_id=None, sliding_window=10, partial_rotary_factor=0.5),
    "gemma3-block-norms": lambda: Gemma3TextConfig(
        **SHAPE, pad_token_id=None, head_dim=16, sliding_window=8, sliding_window_pattern=2
    ),
}
WRITTEN_BY_TRANSFORMERS = ("phi3", "gemma3_text")
"""Families whose random checkpoints transformers writes (``write_random_model`` knows Llama's names only)."""
LOGITS_TOLERANCE = 1e-6
"""Largest difference from one rank's logits, relative to the largest logit: partial sums of o_proj and down reduce
in another order than one matmul, which moves logits by a few float32 ulps of the largest (measured: up to 3e-7)."""


def load_shard(folder: Path, rank: int, size: int, tp: TensorParallelGroup) -> LlamaModel:
    config = AutoConfig.from_pretrained(folder)
    shard = ShardPlan.build(config, rank, size)
    weights = read_weights(folder, shard)
    return LlamaModel(config, weights, MAX_POSITIONS, shard=shard, tp=tp)


PROMPTS = [[(7 * j + 3) % 101 for j in range(40)], [100, 0, 50, 51, 99]]


def run_batches(model: LlamaModel) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill of a 40-token prompt and a 5-token one, then two new tokens for each: the logits after several
    tokens of each forward, stacked. Then the same prefill asking every token's logits (its last layer run for every
    token, not for the 8 rows asked alone): those 8 rows of it."""
    pool = TokenKVPool(model.num_layers, 64, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    rows = [pool.allocate(len(prompt)) for prompt in PROMPTS]
    prefill = ForwardBatch.build(rows, [0, 0], PROMPTS, num_logits=[3, 5])
    prefill_logits = model.forward(prefill, pool)
    new_tokens = [[1, 2], [60, 49]]
    for seq_rows, tokens in zip(rows, new_tokens, strict=True):
        seq_rows += pool.allocate(len(tokens))
    decode = ForwardBatch.build(rows, [40, 5], new_tokens, num_logits=[2, 2])
    logits = torch.cat([prefill_logits, model.forward(decode, pool)])
    pool = TokenKVPool(model.num_layers, 64, model.num_kv_heads, model.head_dim, torch.float32, "cpu")
    rows = [pool.allocate(len(prompt)) for prompt in PROMPTS]
    every_row = model.forward(ForwardBatch.build(rows, [0, 0], PROMPTS, num_logits=[40, 5]), pool)
    return logits, every_row[37:45]


def run_rank(rank: int, size: int, folders: list[Path], port: int) -> None:
    """One rank of the group (a torch.multiprocessing child): for each folder, the logits of its shard and what the
    shard holds, saved in the folder as ``rank-<rank>``."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    torch.set_num_threads(1)
    library.load(ModelArgs().kernel_build_path)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        tp = TensorParallelGroup.joined(rank, size, dist.group.WORLD)
        for folder in folders:
            model = load_shard(folder, rank, size, tp)
            logits, every_row = run_batches(model)
            saved = {"logits": logits, "every_row": every_row, "bytes": model.num_weight_bytes,
                     "kv_heads": model.num_kv_heads}  # fmt: skip
            torch.save(saved, folder / f"rank-{rank}")
    finally:
        dist.destroy_process_group()


CASES = [
    ("llama-tied", 2),
    ("qwen2-biases", 2),
    ("qwen3-head-norms", 2),
    ("llama-tied", 3),
    ("phi3-fused", 2),
    ("gemma3-block-norms", 2),
]


def write_checkpoint(name: str, folder: Path) -> None:
    config = CONFIGS[name]()
    if config.model_type in WRITTEN_BY_TRANSFORMERS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        random_norms(model, torch.Generator().manual_seed(1))
        model.save_pretrained(folder)
    else:
        write_random_model(config, folder)


@pytest.fixture(scope="module")
def sharded_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Path]:
    """Each case's checkpoint folder, holding what every rank of its group saved. One rank group per group size
    runs every family of that size: starting a group (forked ranks, gloo, the shared mapping) costs more than a
    case's forwards."""
    folders = {case: tmp_path_factory.mktemp(f"{case[0]}-{case[1]}") for case in CASES}
    for (name, _), folder in folders.items():
        write_checkpoint(name, folder)
    for size in sorted({size for _, size in CASES}):
        of_size = [folder for (_, case_size), folder in folders.items() if case_size == size]
        # Forked from the fork server, which has torch imported already (compile processes come from it too); a
        # spawned rank would import torch afresh: about 3.5 s of CPU more per rank.
        mp.start_processes(run_rank, args=(size, of_size, free_port()), nprocs=size, start_method="forkserver")
    return folders


@pytest.mark.parametrize(("name", "size"), CASES)
def test_sharded_ranks_give_one_ranks_logits_within_rounding(
    name: str, size: int, sharded_cases: dict[tuple[str, int], Path]
) -> None:
    """Phi-3's fused projections are split into each rank's rows; Gemma 3's norms of a block's output apply to the
    ranks' sum. A prefill's logits asked of a few rows (its last layer run for those rows alone) are the bits of the
    same rows of a prefill asking every row's, on the ranks and on one."""
    folder = sharded_cases[name, size]
    config = CONFIGS[name]()
    library.load(ModelArgs().kernel_build_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        single = load_shard(folder, 0, 1, TensorParallelGroup())
        expected, every_row = run_batches(single)
    finally:
        torch.set_num_threads(threads)
    ranks = [torch.load(folder / f"rank-{rank}") for rank in range(size)]

    assert torch.equal(expected[:8], every_row)
    assert all(torch.equal(rank["logits"][:8], rank["every_row"]) for rank in ranks)

    assert expected.shape == (12, config.vocab_size)
    for rank in ranks[1:]:
        assert torch.equal(rank["logits"], ranks[0]["logits"]), "every rank must hold the same logits"
    scale = expected.abs().max().item()
    torch.testing.assert_close(ranks[0]["logits"], expected, rtol=0, atol=LOGITS_TOLERANCE * scale)
    assert (ranks[0]["logits"].argmax(-1) == expected.argmax(-1)).all()
    assert [rank["kv_heads"] for rank in ranks] == ([2, 1] if size == 2 else [1, 1, 1])
    norms = [(layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.attention_out_norm,
              layer.mlp_out_norm) for layer in single.layers]  # fmt: skip
    replicated = config.hidden_size + sum(norm.numel() for layer in norms for norm in layer if norm is not None)
    assert sum(rank["bytes"] for rank in ranks) == single.num_weight_bytes + (size - 1) * replicated * 4
