"""The model part of the settings: which model, on which engine, with how much room for requests and tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scheduler.server_args.environment import cache_path
from scheduler.server_args.options import cache_dir_option, option
from sglang_constrained.tokenizer.chat_template import read_chat_template

WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
MODEL_RUNNERS = ("exact", "llamacpp")
"""Engines behind the model-runner contract: exact (the default: our batch-invariant CPU kernels, ``cpu_kernels``;
outputs exact whatever the batch, prefix reuse) or llama.cpp (the ``llamacpp`` extra: the GGUF's quantised weights,
faster on CPU, no prefix reuse, and a multi-token forward's logits differ from one-token steps)."""
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
TOOL_CALL_PARSERS = (
    "hermes",
    "qwen25",
    "qwen3_coder",
    "llama3",
    "mistral",
    "deepseekv3",
    "kimi_k2",
    "pythonic",
    "gpt-oss",
)
"""``--tool-call-parser`` names: the syntaxes of ``scheduler.http.tool_syntaxes``."""


@dataclass(frozen=True)
class ModelArgs:
    """The model, its engine and chat format, and its capacity. ``model_path=None``: the embedded
    SmolLM2-135M-Instruct."""

    model_path: str | None = option(None, "GGUF file or HF model folder (default: embedded SmolLM2-135M-Instruct)")
    tool_call_parser: str | None = option(
        None,
        "the syntax tool calls are written in (SGLang's names); left out, the one the chat template's markers name "
        "unambiguously, else hermes",
        choices=TOOL_CALL_PARSERS,
    )
    chat_template: str | None = option(
        None,
        "the chat template for chat messages instead of the model's (a GGUF file's tokenizer.chat_template, a "
        "folder's tokenizer_config.json, chat_template.jinja or chat_template.json): a file (Jinja, or JSON with a "
        "chat_template string) or the Jinja text itself",
    )
    max_running_requests: int = option(32)
    max_seq_len: int = option(2048, "prompt plus output tokens per request")
    max_total_tokens: int = option(
        65536,
        "tokens the KV cache holds in all (running requests and cached prefixes); memory grows to it as used",
    )
    disable_radix_cache: bool = option(False, "do not reuse the KV of prefixes requests share")
    weight_dtype: str = option(
        "auto",
        "the matmul weights: auto keeps a GGUF file's own Q8_0/Q4_1 blocks, multiplied by activations quantised to "
        "int8 per 32-block as llama.cpp does (a model folder's weights stay float32); float32 de-quantises them "
        "once, to exactly the weights transformers computes with, and keeps float32 activations; bfloat16 halves "
        "float32's bytes but rounds the weights",
        choices=WEIGHT_DTYPES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "the KV cache's elements (the exact runner): float32 keeps K and V as computed; bfloat16 or float16 round "
        "them once as written, halving the cache's memory and what a decode step's attention reads; auto: "
        "float16 where the matmul weights are quantised blocks (their rounding is far coarser), float32 otherwise",
        choices=KV_CACHE_DTYPES,
    )
    model_runner: str = option(
        "exact",
        "the engine that computes logits: exact (our batch-invariant CPU kernels: outputs exact whatever the batch, "
        "prefix reuse) or llamacpp (needs the llamacpp extra: the GGUF's quantised weights on llama.cpp's CPU "
        "kernels, several times faster per token; no prefix reuse, and a multi-token forward's logits differ "
        "slightly from one-token steps, so speculation is off there by default)",
        choices=MODEL_RUNNERS,
    )
    cache_dir: str | None = cache_dir_option()

    @property
    def model_name(self) -> str:
        """The name clients see: the model file or folder name."""
        return Path(self.model_path).name if self.model_path else EMBEDDED_MODEL_NAME

    @property
    def cache_path(self) -> Path:
        """Where converted tokenizers and de-quantised weights are kept."""
        return cache_path(self.cache_dir)

    @property
    def kernel_build_path(self) -> Path:
        """Where the model's CPU kernels are compiled, once per machine (``cpu_kernels.build``)."""
        return self.cache_path / "kernels"

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {TOOL_CALL_PARSERS}")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # a template that does not parse stops the start-up here
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"--weight-dtype must be one of {WEIGHT_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}")
        if self.model_runner not in MODEL_RUNNERS:
            raise ValueError(f"--model-runner must be one of {MODEL_RUNNERS}")
        for name in ("max_running_requests", "max_seq_len", "max_total_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
