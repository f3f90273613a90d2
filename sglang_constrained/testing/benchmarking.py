"""What the benchmark scripts share: the engines' own calls (the baseline our grammar objects are timed against),
timed compiles, backends as the scheduler builds them, MaskBench samples, and how contended the machine was."""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError
from pathlib import Path
from typing import Any

import llguidance
import outlines_core
import torch
import xgrammar

from sglang_constrained.backends.base import (
    BaseGrammarObject,
    GrammarBackendArgs,
    InvalidGrammarObject,
)
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.outlines.backend import OutlinesGrammar
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar
from sglang_constrained.testing.maskbench import MaskBenchCase, iter_case_paths, load_case
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup

BACKENDS = ("xgrammar", "llguidance", "outlines")
FOLDERS = ("Github_trivial", "Github_easy", "Glaiveai2K", "Handwritten")
# The llguidance backend's parser limits (its backend module), so both matchers do equal work.
LLGUIDANCE_LIMITS = llguidance.LLParserLimits(verbose_errors=False, step_lexer_fuel=2_000_000)


def raw_matcher(backend: GrammarPipeline, grammar: BaseGrammarObject, spec: str) -> Any:
    """A new engine matcher at the start state of the grammar that ``grammar`` (from ``backend``) was compiled to.

    xgrammar and outlines share the compiled grammar or index; llguidance copies a template matcher built from
    the same grammar text, tokenizer and parser limits as the backend's.
    """
    if isinstance(grammar, XGrammarGrammar):
        return xgrammar.GrammarMatcher(grammar.compiled_grammar, override_stop_tokens=list(grammar.stop_token_ids))
    if isinstance(grammar, OutlinesGrammar):
        return outlines_core.Guide(grammar.compiled.index)
    if isinstance(backend.backend, GuidanceBackend):
        return llguidance_template(backend.backend, spec).deep_copy()
    raise ValueError(f"no raw engine calls for a {type(grammar).__name__} of the {backend.name} backend")


@functools.cache
def llguidance_template(backend: GuidanceBackend, spec: str) -> llguidance.LLMatcher:
    """One start-state matcher per schema, deep-copied per walk as the backend does with its own template; built
    from the schema the backend compiles (``prepare_json_schema``: its formats and patterns made sound)."""
    prepared = json.dumps(backend.prepare_json_schema(json.loads(spec)))
    lark = llguidance.LLMatcher.grammar_from_json_schema(
        prepared, defaults=backend.json_options, overrides={"lenient": False}
    )
    return llguidance.LLMatcher(backend.ll_tokenizer, lark, log_level=0, limits=LLGUIDANCE_LIMITS)


def raw_fill(matcher: Any, mask: torch.Tensor, row: int) -> None:
    """The engine's own mask call for one row of a contiguous int32 CPU bitmask (no checks: the engine's cost)."""
    if isinstance(matcher, xgrammar.GrammarMatcher):
        matcher.fill_next_token_bitmask(mask, row)
    elif isinstance(matcher, llguidance.LLMatcher):
        matcher.unsafe_compute_mask_ptr(mask.data_ptr() + row * mask.shape[1] * 4, mask.shape[1] * 4)
    else:
        matcher.write_mask_into(mask.data_ptr() + row * mask.shape[1] * 4, mask.shape[1], 4)


def raw_accept(matcher: Any, token: int) -> None:
    if isinstance(matcher, outlines_core.Guide):
        matcher.advance(token, return_tokens=False)
    elif isinstance(matcher, llguidance.LLMatcher):
        matcher.consume_token(token)
    else:
        matcher.accept_token(token)


def cpu_pressure() -> float | None:
    """Share of the last minute in which a runnable task waited for a CPU (Linux PSI ``some avg60``), or None.

    The 2 cores are shared with other sessions: this says how contended a run was.
    """
    try:
        fields = Path("/proc/pressure/cpu").read_text().split()
    except OSError:
        return None
    return float(fields[2].removeprefix("avg60=")) / 100


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else math.nan


def compile_grammar(backend: GrammarPipeline, key: tuple[str, str], timeout_s: float) -> tuple[Any, float]:
    """(grammar or an error string, wall seconds) through the backend's cache-and-future path.

    Wall seconds include the hand-off to the backend's compile thread (tens of µs).
    """
    start = time.perf_counter()
    value, _ = backend.get_cached_or_future_value(key)
    try:
        grammar = value if isinstance(value, BaseGrammarObject) else value.result(timeout=timeout_s)
    except FutureTimeoutError:
        backend.discard_pending(key)
        return f"no compile within {timeout_s:g} s", time.perf_counter() - start
    seconds = time.perf_counter() - start
    return (grammar.error_message[:120] if isinstance(grammar, InvalidGrammarObject) else grammar), seconds


def make_backend(server_args: GrammarBackendArgs, setup: TokenizerSetup) -> GrammarPipeline:
    """The grammar backend ``server_args.grammar_backend`` as the scheduler would build it for this tokenizer."""
    name = server_args.grammar_backend
    backend = create_grammar_backend(server_args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    if backend is None:
        raise ValueError(f"backend {name} applies no constraints: nothing to measure")
    return backend


def sample_cases(root: Path, per_folder: int | None) -> list[MaskBenchCase]:
    """``per_folder`` schemas spread evenly over each folder's files in name order (all of them with None)."""
    cases = []
    for folder in FOLDERS:
        num_files = len(list((root / folder).glob("*.json")))
        stride = 1 if per_folder is None else max(1, num_files // per_folder)
        cases += [load_case(path) for path in iter_case_paths(root, folder, per_folder, stride)]
    return cases
