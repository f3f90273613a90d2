"""Shared fixtures: the two real tokenizers every grammar test runs against, and server arguments."""

from __future__ import annotations

import os

# The Triton kernels run on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup


@pytest.fixture(scope="session")
def server_args() -> ServerArgs:
    return ServerArgs()


@pytest.fixture(scope="session")
def smollm2_tokenizer(server_args: ServerArgs) -> TokenizerSetup:
    return load_tokenizer_setup("smollm2", server_args.cache_path)


@pytest.fixture(scope="session")
def qwen35_tokenizer(server_args: ServerArgs) -> TokenizerSetup:
    return load_tokenizer_setup("qwen35", server_args.cache_path)


@pytest.fixture(scope="session", params=TOKENIZER_SETUPS)
def tokenizer_case(request: pytest.FixtureRequest) -> TokenizerSetup:
    return request.getfixturevalue(f"{request.param}_tokenizer")
