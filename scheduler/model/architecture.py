"""What a model family's forward does beyond Llama's, read from its transformers config: one place that knows the
families, so that the forward (``llama.py``) and the loader's checks read the same answers.

Families: Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (an RMSNorm of each query and key head), Phi-3 (q/k/v and
gate/up projections stored fused; RoPE over part of each head), SmolLM3 (layers without RoPE), Gemma 3 text (GELU-tanh,
RMSNorms of weight ``1 + w``, norms of each block's output, an embedding scaled by the square root of the hidden size,
sliding-window layers with a RoPE base of their own, soft-capped logits where the config asks). Sliding windows are
served for every family whose config declares them (Mistral's, Phi-3's, Qwen2's ``max_window_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from cpu_kernels.ops import Activation

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma3_text")
ACTIVATIONS = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}
"""transformers' activation names the MLP kernels compute."""
GEMMA_TYPES = ("gemma3_text",)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's attention: its RoPE (the key of ``Architecture.rope_parameters``, None for no RoPE) and sliding
    window (None: every key)."""

    rope: str | None
    window: int | None


@dataclass(frozen=True)
class Architecture:
    """The forward's departures from Llama's for one config (``of``)."""

    model_type: str
    activation: Activation
    norm_offset: float
    """Added to every RMSNorm weight once, at load: Gemma's norms multiply by ``1 + w`` in float32."""
    embed_scale: float | None
    """The embedding's multiplier (Gemma: the hidden size's square root, rounded to float32), or None."""
    attention_scale: float
    block_out_norms: bool
    """Whether each block's output has an RMSNorm before its residual add (Gemma 3's four norms a layer)."""
    final_softcap: float | None
    """``cap * tanh(logits / cap)`` on the logits (Gemma's ``final_logit_softcapping``), or None."""
    layers: tuple[LayerPlan, ...]
    rope_parameters: dict[str, dict]
    """Each RoPE's parameters by key: ``"default"`` for the config's one, the layer type for Gemma 3's two."""


def of(config: PretrainedConfig) -> Architecture:
    """The architecture of ``config``; raises ValueError naming what the kernels do not compute."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({getattr(config, 'architectures', None)}); the model runner "
            f"serves these causal LM families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    activation_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if activation_name not in ACTIVATIONS:
        raise ValueError(
            f"unsupported activation {activation_name!r} in {model_type}; the MLP computes {', '.join(ACTIVATIONS)}"
        )
    for feature in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if getattr(config, feature, None):
            raise ValueError(f"unsupported {feature} in {model_type} (no Gemma 3 text checkpoint uses it)")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    is_gemma = model_type in GEMMA_TYPES
    return Architecture(
        model_type=model_type,
        activation=ACTIVATIONS[activation_name],
        norm_offset=1.0 if is_gemma else 0.0,
        embed_scale=config.hidden_size**0.5 if is_gemma else None,
        attention_scale=(config.query_pre_attn_scalar if is_gemma else head_dim) ** -0.5,
        block_out_norms=is_gemma,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        layers=tuple(_layer_plans(config)),
        rope_parameters=_rope_parameters(config),
    )


def _rope_parameters(config: PretrainedConfig) -> dict[str, dict]:
    parameters = config.rope_parameters
    if "rope_type" in parameters or "rope_theta" in parameters:
        return {"default": parameters}
    return dict(parameters)  # by layer type (Gemma 3)


def _layer_plans(config: PretrainedConfig) -> list[LayerPlan]:
    """Per layer: its RoPE's key and window. A window applies to a layer whose type is ``sliding_attention`` where
    the config lists layer types, else to every layer (Mistral, Phi-3)."""
    layer_types = getattr(config, "layer_types", None)
    uses_window = getattr(config, "use_sliding_window", True)  # Qwen2's and SmolLM3's switch
    window = (getattr(config, "sliding_window", None) or None) if uses_window else None
    nested = "rope_type" not in config.rope_parameters and "rope_theta" not in config.rope_parameters
    no_rope = getattr(config, "no_rope_layers", None)  # SmolLM3: 0 marks a layer without RoPE
    plans = []
    for i in range(config.num_hidden_layers):
        layer_type = layer_types[i] if layer_types is not None else None
        is_sliding = layer_type == "sliding_attention" if layer_types is not None else True
        rope = layer_type if nested else "default"
        plans.append(LayerPlan(rope=None if no_rope is not None and not no_rope[i] else rope,
                               window=window if is_sliding else None))  # fmt: skip
    return plans
