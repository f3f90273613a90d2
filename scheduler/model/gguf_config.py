"""A GGUF file's model config: as transformers reads it, with what its reading drops for our families put back, and
SmolLM3's, which transformers does not read at all.

- Phi-3: llama.cpp's converter writes the sliding window and the RoPE dimension count, which transformers' GGUF
  mapping skips (a Phi-3-mini-4k file would lose its 2047-token window, a partial-rotary file its partial RoPE), and
  longrope (Phi-3.5, Phi-4-mini) as two tensors of factors, ``ROPE_FACTOR_TENSORS``, with its original context and
  attention factor as keys, which it does not read at all (the file would be served without its RoPE scaling).
- SmolLM3: the Llama keys under ``smollm3.``; every fourth layer has no RoPE, as llama.cpp fixes it (no key says so).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from transformers import AutoConfig, PretrainedConfig

from scheduler.model.gguf_file import GgufFile

SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4
"""llama.cpp's ``n_no_rope_layer_step`` for SmolLM3, set in its source rather than read from the file."""
ROPE_FACTOR_TENSORS = {"short_factor": "rope_factors_short.weight", "long_factor": "rope_factors_long.weight"}
"""Phi-3's longrope factors (one per rotated pair) as llama.cpp's converter stores them: config, not weights."""


def read_gguf_config(gguf_file: Path, contents: GgufFile) -> PretrainedConfig:
    """The model config of ``gguf_file`` (``contents`` as ``read_gguf_file`` read it), without a quantization
    config."""
    architecture = contents.metadata.get("general.architecture")
    if architecture == "smollm3":
        return _smollm3_config(contents)
    config = _mapped_config(contents)
    if architecture == "phi3":
        restore_phi3_fields(config, contents)
    return config


def _mapped_config(contents: GgufFile) -> PretrainedConfig:
    """The config transformers' GGUF reader (``load_gguf_checkpoint``, behind ``AutoConfig``'s ``gguf_file``) maps
    these keys to, by its own tables, for the families served here. It reads them through ``gguf.GGUFReader``, whose
    parse of the vocabulary was ~3.5 s of the embedded model's first start (docs/benchmarks.md): the same mapping
    on ``read_gguf_file``'s values gives the same config (``test_a_gguf_files_config_is_the_one_transformers_reads``).
    Of its cases by architecture, ours meet two: Llama's named exactly "mistral" is Mistral's, Gemma 3's text model
    is ``gemma3_text``."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    metadata = contents.metadata
    architecture = metadata["general.architecture"]
    model_type = "mistral" if architecture == "llama" and metadata.get("general.name") == "mistral" else architecture
    config: dict[str, Any] = dict(
        GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    )
    config["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in contents.tensors)
    for key, value in metadata.items():
        prefix, _, name = key.replace(architecture, model_type).partition(".")
        renamed = cast(dict[str, Any], GGUF_CONFIG_MAPPING.get(prefix, {})).get(name)
        if renamed is None or renamed == -1:
            continue
        if isinstance(value, list) and len(value) == 1:  # as transformers' reader: a one-element array is its element
            value = value[0]
        config[renamed] = value.replace(architecture, model_type) if isinstance(value, str) else value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the vocabulary's length (``read_gguf_file``)
    return AutoConfig.for_model(**config)


def restore_phi3_fields(config: PretrainedConfig, contents: GgufFile) -> None:
    """Put the sliding window, the partial RoPE and longrope of a Phi-3 file back into ``config`` (see module doc)."""
    metadata = contents.metadata
    window = metadata.get("phi3.attention.sliding_window")
    if window:
        config.sliding_window = int(window)
    rope_dim = metadata.get("phi3.rope.dimension_count")
    head_dim = config.hidden_size // config.num_attention_heads
    if rope_dim is not None and int(rope_dim) != head_dim:
        config.rope_parameters["partial_rotary_factor"] = int(rope_dim) / head_dim
    factors = {tensor.name: tensor for tensor in contents.tensors if tensor.name in ROPE_FACTOR_TENSORS.values()}
    if factors:
        if len(factors) != len(ROPE_FACTOR_TENSORS):
            raise ValueError(f"a Phi-3 GGUF file with longrope needs both {sorted(ROPE_FACTOR_TENSORS.values())}")
        original = int(metadata["phi3.rope.scaling.original_context_length"])
        config.original_max_position_embeddings = original
        config.rope_parameters |= {
            "rope_type": "longrope",
            "original_max_position_embeddings": original,
            **{key: [float(f) for f in factors[name].data] for key, name in ROPE_FACTOR_TENSORS.items()},
        }
        attention_factor = metadata.get("phi3.rope.scaling.attn_factor")
        if attention_factor is not None:
            config.rope_parameters["attention_factor"] = float(attention_factor)


def _smollm3_config(contents: GgufFile) -> PretrainedConfig:
    from transformers import SmolLM3Config

    metadata = contents.metadata

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"smollm3.{name}", default)

    if key("rope.scaling.type", "none") != "none":
        raise ValueError(f"unsupported RoPE scaling {key('rope.scaling.type')!r} in a SmolLM3 GGUF file")
    tensors = {tensor.name: tensor for tensor in contents.tensors}
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    return SmolLM3Config(
        vocab_size=int(key("vocab_size", tensors["token_embd.weight"].data.shape[0])),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        max_position_embeddings=int(key("context_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        no_rope_layer_interval=SMOLLM3_NO_ROPE_LAYER_INTERVAL,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )
