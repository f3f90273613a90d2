"""A tiny random-weight Qwen3 model with the real Qwen3.5 tokenizer (248k tokens, ``<think>`` and ``</think>`` single
tokens) and a Qwen3.5-style chat template, written once for the package; a scheduler loads it in a second.

Its untied lm_head is small, so its logits are nearly even: a request's ``logit_bias`` on ``</think>`` or ``<think>``
then decides how a seeded sample meets the think gate (closing its thinking after a few tokens, never closing it, or
never opening one), while the tokens in between are the model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import Qwen3Config

from scheduler.model.runner import ModelRunner
from scheduler.server_args import ModelArgs
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import HttpServer, serving, write_random_model

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.function.name + \'", "arguments": \' }}'
    "{{- tool_call.function.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
"""Qwen3.5's and Qwen3-Thinking's way: the prompt opens ``<think>`` for the model, or with ``enable_thinking=False``
holds an empty, closed think block. Tools are rendered as Qwen3's template renders them (a system message listing
them; calls in ``<tool_call>`` blocks, the ``qwen25`` syntax, which the server picks from these markers)."""
MODEL_SETTINGS = {"max_seq_len": 512, "max_total_tokens": 16384, "max_running_requests": 16}


def write_reasoning_model(folder: Path, tokenizer_setup: TokenizerSetup) -> None:
    tokenizer = tokenizer_setup.tokenizer
    config = Qwen3Config(
        vocab_size=tokenizer_setup.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    write_random_model(config, folder, lm_head_scale=0.01)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="package")
def reasoning_model(tmp_path_factory: pytest.TempPathFactory, qwen35_tokenizer: TokenizerSetup) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-reasoning")
    write_reasoning_model(folder, qwen35_tokenizer)
    return folder


@pytest.fixture(scope="package")
def reasoning_runner(reasoning_model: Path) -> ModelRunner:
    """The model in this process, for schedulers run in the test (speculation on and off over one load)."""
    return ModelRunner(ModelArgs(model_path=str(reasoning_model), **MODEL_SETTINGS))  # type: ignore[arg-type]


@pytest.fixture(scope="package")
def reasoning_server(reasoning_model: Path) -> Iterator[HttpServer]:
    """The HTTP server on the model with ``--reasoning-parser qwen3`` (one start for the package)."""
    live = HttpServer(
        "--model-path", str(reasoning_model), "--reasoning-parser", "qwen3", "--constrained-json-disable-any-whitespace"
    )
    with serving(live):
        yield live
