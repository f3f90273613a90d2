"""Shared fixtures: the two real tokenizers every grammar test runs against, and server arguments."""

from __future__ import annotations

import os

# The Triton kernels run on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass
from typing import Any

import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.tokenizer_loading import embedded_model_path, load_qwen35_tokenizer, load_tokenizer

TOKENIZER_NAMES = ("smollm2", "qwen35")


@dataclass(frozen=True)
class TokenizerCase:
    """A real tokenizer with the model-side facts a backend is built with.

    ``vocab_size`` is deliberately larger than the tokenizer (as a model's padded embedding is), so every
    test also checks that padding ids are never allowed.
    """

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]


def _padded(num_tokens: int, multiple: int = 128) -> int:
    return (num_tokens // multiple + 1) * multiple


@pytest.fixture(scope="session")
def server_args() -> ServerArgs:
    return ServerArgs()


@pytest.fixture(scope="session")
def smollm2_tokenizer(server_args: ServerArgs) -> TokenizerCase:
    tokenizer = load_tokenizer(embedded_model_path(), server_args.cache_path)
    return TokenizerCase("smollm2", tokenizer, _padded(len(tokenizer)), [tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def qwen35_tokenizer(server_args: ServerArgs) -> TokenizerCase:
    tokenizer = load_qwen35_tokenizer(server_args.cache_path)
    return TokenizerCase("qwen35", tokenizer, _padded(len(tokenizer)), [tokenizer.eos_token_id])


@pytest.fixture(scope="session", params=TOKENIZER_NAMES)
def tokenizer_case(request: pytest.FixtureRequest) -> TokenizerCase:
    return request.getfixturevalue(f"{request.param}_tokenizer")
