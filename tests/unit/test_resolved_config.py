"""A converted folder's config is read back from ``resolved_config.json`` as a plain ``PretrainedConfig`` instead
of by ``AutoConfig`` (which imports the model type's config module: 0.9 s of CPU at every start). What the model
runner computes from it must not change: every attribute ``AutoConfig`` gives, the RoPE tables, the shard plan and
what ``check_supported`` says, for every supported model type and RoPE variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
)

from scheduler.model import architecture
from scheduler.model.llama import _rope_tables
from scheduler.model.loader import RESOLVED_CONFIG_FILE, check_supported, load_config, write_resolved_config
from scheduler.model.tensor_parallel import ShardPlan
from tests.helpers import LLAMA3_ROPE_PARAMETERS

SMALL = dict(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
CONFIGS = {
    "llama tied": LlamaConfig(**SMALL, tie_word_embeddings=True),
    "llama3 rope": LlamaConfig(
        **SMALL,
        rope_parameters=LLAMA3_ROPE_PARAMETERS,
    ),
    "linear rope": LlamaConfig(**SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "yarn rope": Qwen2Config(
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 1e6,
            "original_max_position_embeddings": 512,
        },
    ),
    "mistral": MistralConfig(**SMALL, sliding_window=None),
    "mistral with a window": MistralConfig(**SMALL, sliding_window=64),
    "qwen2 untied": Qwen2Config(**SMALL, tie_word_embeddings=False),
    "qwen3 head_dim 32": Qwen3Config(**SMALL, head_dim=32),
    "phi3 partial rope, window": Phi3Config(**SMALL, partial_rotary_factor=0.5, sliding_window=64),
    "smollm3": SmolLM3Config(**SMALL, pad_token_id=None),
    "gemma3 text": Gemma3TextConfig(**SMALL, head_dim=64, final_logit_softcapping=30.0),
}
GENERATION_ONLY = {"use_cache"}
"""What the plain ``PretrainedConfig`` keeps out of a model config (a generation parameter); the runner reads none."""


def supported(config: Any) -> str:
    try:
        check_supported(config, max_seq_len=256)
    except ValueError as e:
        return str(e)
    return "supported"


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_resolved_config_is_what_autoconfig_gives(config: Any, tmp_path: Path) -> None:
    config.save_pretrained(tmp_path)
    assert load_config(tmp_path).to_dict() == AutoConfig.from_pretrained(tmp_path).to_dict()  # no file: AutoConfig
    write_resolved_config(tmp_path)
    assert (tmp_path / RESOLVED_CONFIG_FILE).is_file()
    expected, resolved = AutoConfig.from_pretrained(tmp_path), load_config(tmp_path)
    assert type(resolved).__name__ == "PreTrainedConfig"
    for name, value in expected.to_dict().items():
        if name not in GENERATION_ONLY:
            assert getattr(resolved, name) == value, name
    assert supported(resolved) == supported(expected)
    for rank, size in ((0, 1), (1, 2)):
        assert ShardPlan.build(resolved, rank, size) == ShardPlan.build(expected, rank, size)
    assert architecture.of(resolved) == architecture.of(expected)
    head_dim = getattr(expected, "head_dim", None) or expected.hidden_size // expected.num_attention_heads
    for key in architecture.of(expected).rope_parameters:
        layer_type = None if key == "default" else key
        ours, theirs = (_rope_tables(c, head_dim, 256, layer_type) for c in (resolved, expected))
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
