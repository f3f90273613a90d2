"""Grammar backends shared by every backend test module: each is built once per tokenizer and settings.

Building one decodes the whole vocabulary (0.5 s at 49k tokens, ~5 s at 248k), so test modules split by subject
share them instead of building their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import BaseGrammarBackend
from sglang_constrained.llguidance_backend import GuidanceBackend
from sglang_constrained.outlines_backend import OutlinesGrammarBackend
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from sglang_constrained.xgrammar_backend import XGrammarGrammarBackend

BACKEND_CLASSES: dict[str, type[BaseGrammarBackend]] = {
    "xgrammar": XGrammarGrammarBackend,
    "llguidance": GuidanceBackend,
    "outlines": OutlinesGrammarBackend,
}

BackendBuilder = Callable[..., Any]
"""``build_backend(name, setup, eos_token_ids=None, **server_arg_overrides)``."""


@pytest.fixture(scope="session")
def build_backend(server_args: ServerArgs) -> Iterator[BackendBuilder]:
    built: dict[tuple[Any, ...], BaseGrammarBackend] = {}

    def build(name: str, setup: TokenizerSetup, eos_token_ids: list[int] | None = None, **overrides: Any) -> Any:
        stops = eos_token_ids or setup.eos_token_ids
        key = (name, setup.name, tuple(stops), tuple(sorted(overrides.items())))
        if key not in built:
            args = replace(server_args, grammar_backend=name, **overrides)
            built[key] = BACKEND_CLASSES[name](args, setup.tokenizer, setup.vocab_size, stops)
        return built[key]

    yield build
    for backend in built.values():
        backend.shutdown()
