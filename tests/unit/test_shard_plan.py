"""The tensor-parallel shard plan: which heads, MLP columns and vocabulary rows each rank holds, and what it refuses.

No model is loaded: the plans are built from configs shaped like the embedded SmolLM2-135M (9 query heads in 3 KV
groups of 64 dimensions, 1536 MLP columns, 49,152 tokens).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from transformers import LlamaConfig

from scheduler.model.tensor_parallel import ShardPlan, TensorParallelGroup, split_evenly
from scheduler.server_args import ParallelArgs, parse_server_args

SMOLLM2: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
}


def smollm2_shaped(**changes: int) -> LlamaConfig:
    return LlamaConfig(**{**SMOLLM2, **changes})


@pytest.mark.parametrize(
    ("total", "parts", "spans"),
    [
        (3, 1, [(0, 3)]),
        (3, 2, [(0, 2), (2, 3)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
        (1536, 2, [(0, 768), (768, 1536)]),
        (1537, 2, [(0, 769), (769, 1537)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
    ],
)
def test_split_evenly_gives_contiguous_spans_that_differ_by_at_most_one(
    total: int, parts: int, spans: list[tuple[int, int]]
) -> None:
    assert split_evenly(total, parts) == spans


def test_two_ranks_split_smollm2s_three_kv_groups_two_and_one() -> None:
    first, second = (ShardPlan.build(smollm2_shaped(), rank, 2) for rank in (0, 1))
    assert (first.kv_heads, first.heads) == ((0, 2), (0, 6)), "rank 0 holds 2 KV groups and their 6 query heads"
    assert (second.kv_heads, second.heads) == ((2, 3), (6, 9)), "rank 1 holds the last group and its 3 query heads"
    assert (first.intermediate, second.intermediate) == ((0, 768), (768, 1536))
    assert (first.vocab, second.vocab) == ((0, 24576), (24576, 49152))
    assert first.vocab_widths == second.vocab_widths == [24576, 24576]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_ranks_of_a_plan_cover_every_head_column_and_token_once(size: int) -> None:
    config = smollm2_shaped(intermediate_size=1537, vocab_size=49153)
    plans = [ShardPlan.build(config, rank, size) for rank in range(size)]
    for field, total in (("kv_heads", 3), ("heads", 9), ("intermediate", 1537), ("vocab", 49153)):
        spans = [getattr(plan, field) for plan in plans]
        assert spans[0][0] == 0 and spans[-1][1] == total
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans)), f"{field} spans leave a gap"
    assert all(plan.num_heads == 3 * plan.num_kv_heads for plan in plans), "query heads follow their KV group"


def test_weight_slices_are_rows_for_column_parallel_weights_and_columns_for_row_parallel_ones() -> None:
    plan = ShardPlan.build(smollm2_shaped(), 1, 2)
    p = "model.layers.7."
    assert plan.weight_slice(f"{p}self_attn.q_proj.weight") == (0, (384, 576))
    assert plan.weight_slice(f"{p}self_attn.q_proj.bias") == (0, (384, 576))
    assert plan.weight_slice(f"{p}self_attn.k_proj.weight") == (0, (128, 192))
    assert plan.weight_slice(f"{p}self_attn.v_proj.bias") == (0, (128, 192))
    assert plan.weight_slice(f"{p}self_attn.o_proj.weight") == (1, (384, 576))
    assert plan.weight_slice(f"{p}mlp.gate_proj.weight") == (0, (768, 1536))
    assert plan.weight_slice(f"{p}mlp.up_proj.weight") == (0, (768, 1536))
    assert plan.weight_slice(f"{p}mlp.down_proj.weight") == (1, (768, 1536))
    assert plan.weight_slice("model.embed_tokens.weight") == (0, (24576, 49152))
    assert plan.weight_slice("lm_head.weight") == (0, (24576, 49152))
    for replicated in (f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight", "model.norm.weight"):
        assert plan.weight_slice(replicated) is None


def test_a_single_rank_reads_every_tensor_whole() -> None:
    plan = ShardPlan.build(smollm2_shaped())
    assert plan.weight_slice("model.layers.0.self_attn.o_proj.weight") is None
    assert (plan.num_heads, plan.num_kv_heads, plan.vocab) == (9, 3, (0, 49152))


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({}, 4, "--tp-size 4 exceeds the model's 3 KV heads"),
        ({"num_key_value_heads": 1, "num_attention_heads": 9}, 2, "--tp-size 2 exceeds the model's 1 KV heads"),
        ({"num_attention_heads": 8}, 2, "8 query heads do not group evenly over 3 KV heads"),
    ],
)
def test_splits_the_model_cannot_take_are_refused(changes: dict[str, int], size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShardPlan.build(smollm2_shaped(**changes), 0, size)


def test_a_group_of_several_ranks_needs_a_process_group() -> None:
    with pytest.raises(ValueError, match="needs a process group"):
        TensorParallelGroup(0, 2)


@pytest.mark.parametrize(("tp_size", "world_size"), [(2, 1), (2, 3), (3, 2)])
def test_a_tp_size_other_than_the_ranks_launched_is_refused(tp_size: int, world_size: int) -> None:
    with pytest.raises(ValueError, match=f"--tp-size {tp_size} needs {tp_size} ranks, but {world_size} were"):
        ParallelArgs(tp_size=tp_size).check_world_size(world_size)


@pytest.mark.parametrize(("tp_size", "world_size"), [(1, 1), (1, 2), (2, 2), (3, 3)])
def test_tp_size_one_runs_on_any_ranks_and_n_on_n(tp_size: int, world_size: int) -> None:
    ParallelArgs(tp_size=tp_size).check_world_size(world_size)


def test_the_flag_reaches_the_server_args() -> None:
    assert parse_server_args(["--tp-size", "2"]).parallel.tp_size == 2
    with pytest.raises(ValueError, match="tp_size must be positive"):
        parse_server_args(["--tp-size", "0"])


def test_tensor_and_data_parallel_together_are_refused_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match="tensor and data parallelism do not combine yet"):
        ParallelArgs(tp_size=2, dp_size=2).check_world_size(4)
    with pytest.raises(ValueError, match="--dp-size 2 needs exactly 2 ranks"):
        ParallelArgs(dp_size=2).check_world_size(3)
