"""Tiny random-weight models of every family, for tests that compare the runner with transformers without a download:
a small byte-level BPE tokenizer, random norms, and a model written as a GGUF file the way llama.cpp's converter lays
its family out (with ``gguf``'s writer, without llama.cpp)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

ARCHITECTURES = {"llama": "llama", "phi3": "phi3", "smollm3": "smollm3", "gemma3_text": "gemma3"}
"""Model type -> llama.cpp's architecture name."""


def write_gguf(model: Any, tokenizer: Any, path: Path, chat_template: str | list[dict[str, str]] | None = None) -> None:
    """``model`` (a transformers causal LM) and ``tokenizer`` (a BPE fast tokenizer) as a float32 GGUF at ``path``:
    q and k rows interleaved where llama.cpp's Llama converter does (Llama, SmolLM3), Gemma's norms stored as
    ``1 + w``, Phi-3's projections fused as they are; ``chat_template`` as its ``tokenizer.chat_template`` (named
    templates, ``{"name", "template"}``, as llama.cpp's converter writes them)."""
    config = model.config
    arch = ARCHITECTURES[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "longrope":
        _add_longrope(writer, config, rope)
    _add_tokenizer(writer, tokenizer)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), 99)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        data = tensor.detach().float()
        if arch == "gemma3" and stem.endswith("norm"):
            data = data + 1
        if arch in ("llama", "smollm3") and stem.endswith(("q_proj", "k_proj")):
            heads = config.num_attention_heads if stem.endswith("q_proj") else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, -1).transpose(1, 2).reshape(data.shape)
        writer.add_tensor(f"{table.get_name(stem)}.{suffix}", data.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_longrope(writer: gguf.GGUFWriter, config: Any, rope: dict[str, Any]) -> None:
    """Phi-3's longrope as llama.cpp's converter writes it: the original context and the attention factor as keys, the
    short and long factors as tensors."""
    original = rope["original_max_position_embeddings"]
    scale = config.max_position_embeddings / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any) -> None:
    """A byte-level BPE tokenizer's vocabulary, merges and special tokens as llama.cpp's "gpt2" tokenizer."""
    backend = tokenizer.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in _model_json(backend)["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.eos_token_id)  # else a family's default pad id may lie past a tiny vocab


def _model_json(backend: Any) -> dict[str, Any]:
    return dict(json.loads(backend.to_str())["model"])


def random_norms(model: Any, generator: torch.Generator) -> None:
    """Every RMSNorm weight of ``model`` random around its neutral value (transformers initialises them to it: 1, or
    0 for Gemma's ``1 + w``), and Qwen2-style biases random: so that a forward that skipped one would show."""
    neutral = 0.0 if model.config.model_type == "gemma3_text" else 1.0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(neutral + 0.5 * torch.randn(parameter.shape, generator=generator))
            elif name.endswith(".bias"):
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))


TOKENIZER_TEXT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)  # the quick brown fox jumps over the dog"


def tiny_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (``<|endoftext|>`` first, the 256 bytes, merges learnt
    from a line of text): one that transformers converts from a GGUF file in milliseconds, where SmolLM2's 49,152
    tokens take seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    backend.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
