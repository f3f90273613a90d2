"""What limiting xgrammar's grammars to well-formed UTF-8 costs: compile time and per-token mask cost, side by side.

For every tokenizer, each sampled MaskBench schema (and a few string schemas walked with non-ASCII text, where the
limited character classes are tested most) is turned into xgrammar's grammar as the backend makes it, then compiled
twice by the backend's compiler: as xgrammar made it, and limited by ``well_formed_utf8_grammar`` (what the backend
serves). Every valid instance is tokenised and walked through a matcher of each in lockstep, taking turns going
first, so the machine's noise hits both, several times (each token keeps its fastest time on each side); per-token
times are the engine's fill plus accept. Prints ``limited/plain``
ratios (the target: fills at most 1.05x) and the rewrite's own time, beside the CPU model and its load.

    python scripts/bench_utf8_grammars.py [--per-folder 8] [--data ../shared/data/jsonschemabench/maskbench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import xgrammar

from scheduler.server_args import GrammarArgs, ModelArgs
from scripts.bench_grammar import Walks, raw_step, walk_interleaved
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.backends.xgrammar.utf8 import well_formed_utf8_grammar
from sglang_constrained.constraint_spec import lower_constraint, make_grammar_key
from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.testing.benchmarking import cpu_pressure, percentile, sample_cases
from sglang_constrained.testing.maskbench import MaskBenchCase
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup

REPO = Path(__file__).resolve().parents[1]
FILL_RATIO_TARGET = 1.05
NON_ASCII_TEXTS = (
    "Grüße aus Köln, ça va? Ελληνικά и русский",
    "東京都の天気は晴れ、気温は二十度です。",
    "emoji 😀👩‍💻🚀 and math 𝔸𝔹ℂ ∀x∈ℝ",
    "한국어 텍스트와 العربية والعبرية עברית",
)
STRING_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}, "short": {"type": "string", "maxLength": 40}},
    "required": ["text", "short"],
}
"""Walked with ``NON_ASCII_TEXTS``: the plain string (an EBNF class) and the bounded one (a ``Regex``)."""


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def non_ascii_case() -> MaskBenchCase:
    instances = tuple(json.dumps({"text": text, "short": text[:40]}, ensure_ascii=False) for text in NON_ASCII_TEXTS)
    return MaskBenchCase("non-ASCII strings", "(ours)", STRING_SCHEMA, instances, ())


def bench(
    backend: XGrammarGrammarBackend, setup: TokenizerSetup, cases: list[MaskBenchCase], args: argparse.Namespace
) -> dict[str, float]:
    """Walks of every compiled case, limited (``ours_*``) against plain (``raw_*``), and the compile seconds.

    Each walk is repeated ``args.repeats`` times and each token keeps its fastest time on each side: on a shared
    machine a burst of load lands on one repeat, rarely on all.
    """
    walks = Walks()
    compiles_plain: list[float] = []
    compiles_limited: list[float] = []
    rewrites: list[float] = []
    for index, case in enumerate(cases):
        try:
            _, spec = lower_constraint(
                make_grammar_key("json", case.schema), backend.max_spec_bytes, backend.prepare_json_schema
            )
            grammar = backend.json_schema_grammar(spec)
        except (GrammarSpecError, RuntimeError):
            continue
        start = time.perf_counter()
        limited_grammar = well_formed_utf8_grammar(grammar)
        rewrites.append(time.perf_counter() - start)
        compiled = {}
        for name, each in (("plain", grammar), ("limited", limited_grammar))[:: 1 if index % 2 else -1]:
            start = time.perf_counter()
            compiled[name] = backend.compiler.compile_grammar(each)
            (compiles_plain if name == "plain" else compiles_limited).append(time.perf_counter() - start)
        for instance_index, text in enumerate(case.valid_instances[: args.max_instances]):
            tokens = setup.encode(text)
            num_valid = min(accepted_prefix(xgrammar.GrammarMatcher(each), tokens) for each in compiled.values())
            repeats = []
            for repeat in range(args.repeats):
                ours = raw_step(xgrammar.GrammarMatcher(compiled["limited"]), setup.vocab_size)
                raw = raw_step(xgrammar.GrammarMatcher(compiled["plain"]), setup.vocab_size)
                repeats.append(Walks())
                walk_interleaved(ours, raw, tokens[:num_valid], (index + instance_index + repeat) % 2 == 0, repeats[-1])
            walks.num_instances += 1
            for name in ("ours_fill", "ours_accept", "raw_fill", "raw_accept"):
                getattr(walks, name).extend(map(min, zip(*(getattr(each, name) for each in repeats), strict=True)))
    ms, us = 1e3, 1e-3
    return {
        "compiled": len(compiles_plain),
        "tokens": len(walks.ours_fill),
        "rewrite_p50_ms": percentile(rewrites, 50) * ms,
        "rewrite_p99_ms": percentile(rewrites, 99) * ms,
        "compile_ratio_total": sum(compiles_limited) / sum(compiles_plain),
        "limited_fill_median_us": statistics.median(walks.ours_fill) * us,
        "plain_fill_median_us": statistics.median(walks.raw_fill) * us,
        "limited_fill_p99_us": percentile(walks.ours_fill, 99) * us,
        "plain_fill_p99_us": percentile(walks.raw_fill, 99) * us,
        "fill_ratio_total": sum(walks.ours_fill) / sum(walks.raw_fill),
        "fill_accept_ratio_total": (sum(walks.ours_fill) + sum(walks.ours_accept))
        / (sum(walks.raw_fill) + sum(walks.raw_accept)),
    }


def accepted_prefix(matcher: xgrammar.GrammarMatcher, tokens: list[int]) -> int:
    for index, token in enumerate(tokens):
        if not matcher.accept_token(token):
            return index
    return len(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO / "tests" / "data" / "maskbench")
    parser.add_argument("--per-folder", type=int, default=8, help="schemas per folder; 0 for all")
    parser.add_argument("--max-instances", type=int, default=3, help="valid instances walked per schema")
    parser.add_argument("--repeats", type=int, default=5, help="walks per instance; each token keeps its fastest")
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_SETUPS), choices=TOKENIZER_SETUPS)
    args = parser.parse_args()
    cases = [*sample_cases(args.data, args.per_folder or None), non_ascii_case()]
    server_args = GrammarArgs()
    print(f"{len(cases)} schemas; {cpu_model()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    for tokenizer_name in args.tokenizers:
        setup = load_tokenizer_setup(tokenizer_name, ModelArgs().cache_path)
        backend = XGrammarGrammarBackend(
            server_args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, compile_in_processes=False
        )
        row = bench(backend, setup, cases, args)
        backend.shutdown()
        verdict = "ok" if row["fill_ratio_total"] <= FILL_RATIO_TARGET else f"MISS (target <= {FILL_RATIO_TARGET})"
        print(
            f"{tokenizer_name}: {row['compiled']} schemas, {row['tokens']} tokens; ratio limited/plain: fill "
            f"{row['fill_ratio_total']:.3f} ({verdict}), fill+accept {row['fill_accept_ratio_total']:.3f}, compile "
            f"{row['compile_ratio_total']:.3f}; fill median {row['limited_fill_median_us']:.2f} vs "
            f"{row['plain_fill_median_us']:.2f} µs, p99 {row['limited_fill_p99_us']:.1f} vs "
            f"{row['plain_fill_p99_us']:.1f} µs; the rewrite itself p50 {row['rewrite_p50_ms']:.2f} ms, p99 "
            f"{row['rewrite_p99_ms']:.2f} ms; load average {os.getloadavg()[0]:.1f}, CPU pressure {cpu_pressure()}"
        )


if __name__ == "__main__":
    main()
