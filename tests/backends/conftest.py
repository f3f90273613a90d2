"""Grammar backends shared by every backend test module: each is built once per tokenizer and settings.

Building one decodes the whole vocabulary (0.5 s at 49k tokens, ~5 s at 248k), so test modules split by subject
share them instead of building their own.

Their xgrammar compiles run on threads (``new_backend``; xgrammar releases the GIL while it compiles), not in compile
processes: the compiled grammar is the same, without serialising it back from the process (at 248k tokens ~13 MB of
JSON for a plain schema: 0.2 s to write and 0.1 s to read, against 0.05 s to compile). Grammars from compile
processes are checked where that path is the subject: ``test_grammar_sharing`` (an export allows what the compiled
grammar allows), ``test_grammar_disk_cache`` (an export kept for the disk), ``test_compile_processes``,
``test_eager_refusals``, ``test_plain_scripts``, and every test that starts a server.

The package's torch ops run on one thread (``one_torch_thread``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from scheduler.server_args import GrammarArgs, ServerArgs
from sglang_constrained.backends.base import BaseGrammarBackend
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.outlines.backend import OutlinesGrammarBackend
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup

BACKEND_CLASSES: dict[str, type[BaseGrammarBackend]] = {
    "xgrammar": XGrammarGrammarBackend,
    "llguidance": GuidanceBackend,
    "outlines": OutlinesGrammarBackend,
}

BackendBuilder = Callable[..., Any]
"""``build_backend(name, setup, eos_token_ids=None, **server_arg_overrides)``."""


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """torch's ops on one thread in this package: they are elementwise over a vocabulary row or two (unpacking a
    mask, weighing a walk's next token), where a team of threads only adds its fork-join, and the other core is
    busy with the compiles queued ahead (and servers starting for later tests), so that a team's every op waits
    for a descheduled thread. ``tests/backends`` alone, one run each: 225 s and 305 s of CPU with two threads,
    211 s and 264 s with one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def build_backend(server_args: ServerArgs) -> Iterator[BackendBuilder]:
    built: dict[tuple[Any, ...], GrammarPipeline] = {}

    def build(name: str, setup: TokenizerSetup, eos_token_ids: list[int] | None = None, **overrides: Any) -> Any:
        stops = eos_token_ids or setup.eos_token_ids
        key = (name, setup.name, tuple(stops), tuple(sorted(overrides.items())))
        if key not in built:
            args = replace(server_args.grammar, grammar_backend=name, **overrides)
            built[key] = new_backend(args, setup, stops)
        return built[key]

    yield build
    for backend in built.values():
        backend.shutdown()


def new_backend(args: GrammarArgs, setup: TokenizerSetup, eos_token_ids: list[int] | None = None) -> GrammarPipeline:
    """A new ``args.grammar_backend`` on ``setup``'s tokenizer, in its pipeline (``.backend`` is the engine's);
    xgrammar's compiles on threads (see module doc)."""
    stops = eos_token_ids or setup.eos_token_ids
    if args.grammar_backend == "xgrammar":
        return GrammarPipeline(
            XGrammarGrammarBackend(args, setup.tokenizer, setup.vocab_size, stops, compile_in_processes=False)
        )
    return GrammarPipeline(BACKEND_CLASSES[args.grammar_backend](args, setup.tokenizer, setup.vocab_size, stops))
