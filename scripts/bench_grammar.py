"""Compile time, coverage and per-token mask cost of each grammar backend over MaskBench JSON schemas.

For every tokenizer (SmolLM2 49k, Qwen3.5 248k) and backend (xgrammar, llguidance, outlines), each sampled schema
is compiled through the backend (``get_cached_or_future_value``, a fresh key per schema), then every valid
instance is tokenised and walked: at each step the mask is filled and the token accepted, once through our
grammar object (``fill_vocab_mask`` + ``accept_token``) and once through the engine's own calls on a matcher of
the same compiled grammar. The two walks advance in lockstep and take turns going first, so the machine's noise
hits both; per-token times are fill plus accept. Prints a table with ``ours/raw`` ratios and writes JSON.

With ``--backends auto``, ours is what ``auto`` hands a request and raw is the chosen backend's own grammar object
(compiled by that backend directly), so the ratio is what going through ``auto`` costs (target: at most 1.02).

    python scripts/bench_grammar.py [--per-folder 8] [--data ../shared/data/jsonschemabench/maskbench]
    python scripts/bench_grammar.py --backends auto
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

import llguidance
import torch
import xgrammar

from scheduler.server_args import GrammarArgs, ModelArgs
from sglang_constrained.backends.auto import AutoGrammarBackend
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import AUTO_GRAMMAR_BACKEND
from sglang_constrained.constraint_spec import GrammarKey, make_grammar_key
from sglang_constrained.testing.benchmarking import (
    BACKENDS,
    compile_grammar,
    cpu_pressure,
    make_backend,
    percentile,
    raw_matcher,
    sample_cases,
)
from sglang_constrained.testing.maskbench import MaskBenchCase
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup

REPO = Path(__file__).resolve().parents[1]
FILL_RATIO_TARGETS = {AUTO_GRAMMAR_BACKEND: 1.02}
"""The fill target of ours over raw: 1.05 over an engine's own calls, 1.02 for ``auto`` over the chosen backend."""

Step = Callable[[int], tuple[int, int]]
"""Fill the mask, then accept ``token``; returns (fill ns, accept ns)."""


@dataclass
class Walks:
    """Per-token nanoseconds of one backend and tokenizer, ours and raw, taken in the same steps."""

    ours_fill: list[int] = field(default_factory=list)
    ours_accept: list[int] = field(default_factory=list)
    raw_fill: list[int] = field(default_factory=list)
    raw_accept: list[int] = field(default_factory=list)
    num_instances: int = 0
    num_partial: int = 0


def our_step(grammar: BaseGrammarObject, vocab_size: int) -> Step:
    mask = grammar.allocate_vocab_mask(vocab_size, 1, "cpu")
    clock = time.perf_counter_ns

    def step(token: int) -> tuple[int, int]:
        start = clock()
        grammar.fill_vocab_mask(mask, 0)
        filled = clock()
        grammar.accept_token(token)
        return filled - start, clock() - filled

    return step


def raw_step(matcher: Any, vocab_size: int) -> Step:
    """Per-token timing of the engine's calls alone, each engine's closure calling it directly."""
    mask = torch.zeros(1, math.ceil(vocab_size / 32), dtype=torch.int32)
    clock = time.perf_counter_ns
    if isinstance(matcher, xgrammar.GrammarMatcher):

        def xgrammar_step(token: int) -> tuple[int, int]:
            start = clock()
            matcher.fill_next_token_bitmask(mask, 0)
            filled = clock()
            matcher.accept_token(token)
            return filled - start, clock() - filled

        return xgrammar_step
    num_bytes, num_words = mask.numel() * 4, mask.shape[1]
    if isinstance(matcher, llguidance.LLMatcher):

        def llguidance_step(token: int) -> tuple[int, int]:
            address = mask.data_ptr()  # the closure must hold the mask: the engine writes through a raw pointer
            start = clock()
            matcher.unsafe_compute_mask_ptr(address, num_bytes)
            filled = clock()
            matcher.consume_token(token)
            return filled - start, clock() - filled

        return llguidance_step

    def outlines_step(token: int) -> tuple[int, int]:
        address = mask.data_ptr()
        start = clock()
        matcher.write_mask_into(address, num_words, 4)
        filled = clock()
        matcher.advance(token, return_tokens=False)
        return filled - start, clock() - filled

    return outlines_step


def reference_step(backend: GrammarPipeline, grammar: BaseGrammarObject, key: GrammarKey, vocab_size: int) -> Step:
    """What the walk of ``grammar`` is timed against: the engine's own calls on a matcher of the same compiled
    grammar, or for ``auto`` the chosen backend's own grammar object, compiled by that backend directly."""
    if isinstance(backend.backend, AutoGrammarBackend):
        assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend is not None
        chosen = backend.backend.backends[grammar.grammar_stats.chosen_backend].backend
        return our_step(chosen.build_grammar(key), vocab_size)
    return raw_step(raw_matcher(backend, grammar, key[1]), vocab_size)


def walk_interleaved(ours: Step, raw: Step, tokens: list[int], first_is_ours: bool, walks: Walks) -> None:
    for index, token in enumerate(tokens):
        order = ((ours, walks.ours_fill, walks.ours_accept), (raw, walks.raw_fill, walks.raw_accept))
        for step, fills, accepts in order if (index % 2 == 0) == first_is_ours else order[::-1]:
            fill_ns, accept_ns = step(token)
            fills.append(fill_ns)
            accepts.append(accept_ns)


def summarise(walks: Walks, compile_s: list[float], errors: list[str], num_cases: int) -> dict[str, Any]:
    ours = [f + a for f, a in zip(walks.ours_fill, walks.ours_accept, strict=True)]
    raw = [f + a for f, a in zip(walks.raw_fill, walks.raw_accept, strict=True)]
    us = 1e-3

    def median(values: list[int]) -> float:
        return statistics.median(values) * us if values else math.nan

    return {
        "schemas": num_cases,
        "compiled": num_cases - len(errors),
        "compile_p50_ms": percentile(compile_s, 50) * 1e3,
        "compile_p99_ms": percentile(compile_s, 99) * 1e3,
        "compile_errors": errors,
        "instances": walks.num_instances,
        "instances_cut_at_rejection": walks.num_partial,
        "tokens": len(ours),
        "ours_median_us": median(ours),
        "ours_p99_us": percentile(ours, 99) * us,
        "raw_median_us": median(raw),
        "raw_p99_us": percentile(raw, 99) * us,
        "ours_fill_median_us": median(walks.ours_fill),
        "raw_fill_median_us": median(walks.raw_fill),
        "ours_accept_median_us": median(walks.ours_accept),
        "raw_accept_median_us": median(walks.raw_accept),
        "ratio_median": median(ours) / median(raw) if raw else math.nan,
        "ratio_total": sum(ours) / sum(raw) if raw else math.nan,
        "fill_ratio_total": sum(walks.ours_fill) / sum(walks.raw_fill) if raw else math.nan,
    }


def bench_backend(
    backend: GrammarPipeline, setup: TokenizerSetup, cases: list[MaskBenchCase], args: argparse.Namespace
) -> dict[str, Any]:
    walks, compile_s, errors = Walks(), [], []
    for case_index, case in enumerate(cases):
        key = make_grammar_key("json", case.schema)
        grammar, seconds = compile_grammar(backend, key, args.compile_timeout)
        if isinstance(grammar, str):
            errors.append(f"{case.folder}/{case.name}: {grammar}")
            continue
        compile_s.append(seconds)
        for instance_index, text in enumerate(case.valid_instances[: args.max_instances]):
            tokens = setup.encode(text)
            num_valid = grammar.copy().validate_tokens(tokens)
            walks.num_instances += 1
            walks.num_partial += num_valid < len(tokens)
            ours = our_step(grammar.copy(), setup.vocab_size)
            raw = reference_step(backend, grammar, key, setup.vocab_size)
            walk_interleaved(ours, raw, tokens[:num_valid], (case_index + instance_index) % 2 == 0, walks)
    return summarise(walks, compile_s, errors, len(cases))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "maskbench")
    parser.add_argument("--per-folder", type=int, default=8, help="schemas per folder; 0 for all")
    parser.add_argument("--max-instances", type=int, default=3, help="valid instances walked per schema")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=(*BACKENDS, AUTO_GRAMMAR_BACKEND))
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_SETUPS), choices=TOKENIZER_SETUPS)
    parser.add_argument("--compile-timeout", type=float, default=60.0, help="seconds before a compile counts as failed")
    parser.add_argument("--output", type=Path, default=REPO / "results" / "bench_grammar.json")
    args = parser.parse_args(argv)
    cases = sample_cases(args.data, args.per_folder or None)
    server_args = GrammarArgs()
    print(
        f"{len(cases)} schemas from {args.data}; torch threads {torch.get_num_threads()}; CPU pressure {cpu_pressure()}"
    )
    print(
        f"{'tokenizer':>9} {'backend':>10} {'compiled':>9} {'c.p50ms':>8} {'c.p99ms':>8} {'tokens':>6} "
        f"{'ours.med':>8} {'raw.med':>8} {'ours.p99':>8} {'raw.p99':>8} {'med o/r':>7} {'tot o/r':>7}  (µs per token)"
    )
    results = []
    for tokenizer_name in args.tokenizers:
        setup = load_tokenizer_setup(tokenizer_name, ModelArgs().cache_path)
        for backend_name in args.backends:
            started = time.perf_counter()
            backend = make_backend(replace(server_args, grammar_backend=backend_name), setup)
            build_s = time.perf_counter() - started
            row = {"tokenizer": tokenizer_name, "backend": backend_name, "backend_build_s": build_s}
            row |= bench_backend(backend, setup, cases, args)
            row |= {"load_average_1min": os.getloadavg()[0], "cpu_pressure_avg60": cpu_pressure()}
            backend.shutdown()
            results.append(row)
            print(
                f"{tokenizer_name:>9} {backend_name:>10} {row['compiled']:>4}/{row['schemas']:<4} "
                f"{row['compile_p50_ms']:>8.1f} {row['compile_p99_ms']:>8.0f} {row['tokens']:>6} "
                f"{row['ours_median_us']:>8.2f} {row['raw_median_us']:>8.2f} {row['ours_p99_us']:>8.1f} "
                f"{row['raw_p99_us']:>8.1f} {row['ratio_median']:>7.3f} {row['ratio_total']:>7.3f}"
            )
    print(
        "ratios: 'fill' and 'fill+accept' are the time summed over every walked token, ours over raw (the cost a "
        "generated token adds); per-token medians follow (a state's mask costs 0.5 to 80 µs, so medians can fall "
        "between the modes)"
    )
    for row in results:
        target = FILL_RATIO_TARGETS.get(row["backend"], 1.05)
        verdict = "ok" if row["fill_ratio_total"] <= target else f"MISS (target <= {target})"
        print(
            f"ratio ours/raw {row['backend']} {row['tokenizer']}: fill {row['fill_ratio_total']:.3f} ({verdict}), "
            f"fill+accept {row['ratio_total']:.3f}; medians per token: fill+accept {row['ratio_median']:.3f}, "
            f"fill {row['ours_fill_median_us']:.2f} vs {row['raw_fill_median_us']:.2f} µs, "
            f"accept {row['ours_accept_median_us']:.2f} vs {row['raw_accept_median_us']:.2f} µs"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "data": str(args.data),
        "per_folder": args.per_folder,
        "max_instances": args.max_instances,
        "versions": {name: version(name) for name in ("torch", "xgrammar", "llguidance", "outlines-core")},
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
