"""One decode step's mask work for B constrained requests: filling B mask rows, then applying them to [B, V] logits.

Fill: ``SamplingBatchInfo.update_regex_vocab_mask`` over B requests against a plain loop of the engine's own
per-row calls, on matchers at the same states: each request walks a valid MaskBench instance of a real schema,
starting partway in, and both sides accept the same next token after every round (so no engine answers a
repeated state from a cache). Apply: the dispatcher's CPU path (``triton_ops.apply_token_bitmask_inplace``, the
C++ masking loop) against llguidance's shipped ``torch.compile`` kernel, the torch reference and xgrammar's CPU
kernel, on the filled masks. Sides alternate order every round. Prints tables with ratios and writes JSON.
``scripts/bench_apply_mask.py`` times the same appliers on synthetic sparse and dense masks.

    python scripts/bench_batch.py [--batches 1 8 32 128] [--rounds 30] [--per-folder 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import llguidance.torch
import torch
import xgrammar

from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.sampling_batch_info import SamplingBatchInfo
from scheduler.server_args import GrammarArgs, ModelArgs
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.benchmarking import (
    BACKENDS,
    compile_grammar,
    cpu_pressure,
    make_backend,
    raw_accept,
    raw_fill,
    raw_matcher,
    sample_cases,
)
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup
from triton_ops import apply_token_bitmask_inplace, apply_token_bitmask_inplace_reference, load_cpu_bitmask_kernel

REPO = Path(__file__).resolve().parents[1]
MIN_WALK_TOKENS = 8


@dataclass
class Walk:
    """A compiled grammar, its spec and the accepted tokens of one valid instance."""

    grammar: BaseGrammarObject
    spec: str
    tokens: list[int]


@dataclass
class Request:
    """One constrained request, held twice at the same state: as our grammar object and as a raw engine matcher."""

    walk: Walk
    position: int
    ours: BaseGrammarObject
    raw: Any

    def advance(self, backend: GrammarPipeline) -> None:
        """Both sides accept the next token; at the end of the walk both start over at the beginning."""
        token = self.walk.tokens[self.position]
        self.ours.accept_token(token)
        raw_accept(self.raw, token)
        self.position += 1
        if self.position == len(self.walk.tokens):
            self.position = 0
            self.ours = self.walk.grammar.copy()
            self.raw = raw_matcher(backend, self.walk.grammar, self.walk.spec)


def build_walks(backend: GrammarPipeline, setup: TokenizerSetup, per_folder: int, timeout_s: float) -> list[Walk]:
    walks = []
    for case in sample_cases(REPO / "tests" / "data" / "maskbench", per_folder):
        key = make_grammar_key("json", case.schema)
        grammar, _ = compile_grammar(backend, key, timeout_s)
        if isinstance(grammar, str):
            continue
        for text in case.valid_instances:
            tokens = setup.encode(text)
            tokens = tokens[: grammar.copy().validate_tokens(tokens)]
            if len(tokens) >= MIN_WALK_TOKENS:
                walks.append(Walk(grammar, key[1], tokens))
    if not walks:
        raise ValueError(f"no sampled schema compiled with the {backend.name} backend; raise --per-folder")
    return walks


def start_requests(backend: GrammarPipeline, walks: list[Walk], batch: int, rng: random.Random) -> list[Request]:
    """``batch`` requests cycling over the walks, each advanced to a random point in its first half."""
    requests = []
    for index in range(batch):
        walk = walks[index % len(walks)]
        request = Request(walk, 0, walk.grammar.copy(), raw_matcher(backend, walk.grammar, walk.spec))
        for _ in range(rng.randrange(len(walk.tokens) // 2)):
            request.advance(backend)
        requests.append(request)
    return requests


def bench_fill(
    backend: GrammarPipeline, walks: list[Walk], setup: TokenizerSetup, batch: int, rounds: int
) -> tuple[dict[str, float], torch.Tensor]:
    """Median ms of one step's fill, ours and raw, their paired ratio, and the last mask filled (``[batch, words]``)."""
    requests = start_requests(backend, walks, batch, random.Random(batch))
    info = SamplingBatchInfo(setup.vocab_size, max_batch_size=batch, mask_layout=backend.mask_layout)
    reqs = [Req(rid=str(i), client_id=b"", prompt_ids=[0], sampling_params=SamplingParams()) for i in range(batch)]
    raw_mask = xgrammar.allocate_token_bitmask(batch, setup.vocab_size)

    def raw_loop() -> None:
        for row, request in enumerate(requests):
            raw_fill(request.raw, raw_mask, row)

    sides = {"ours": info.update_regex_vocab_mask, "raw": raw_loop}
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(rounds):
        for req, request in zip(reqs, requests, strict=True):
            req.grammar = request.ours
        info.prepare(reqs)
        for name in ("ours", "raw") if round_index % 2 == 0 else ("raw", "ours"):
            start = time.perf_counter()
            sides[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
        if info.fill_errors or info.vocab_mask is None or not torch.equal(info.vocab_mask, raw_mask):
            raise AssertionError(f"{backend.name}: our masks differ from the engine's at batch {batch}")
        mask = info.vocab_mask.clone()
        for request in requests:
            request.advance(backend)
    timing = {f"{name}_ms": statistics.median(times) for name, times in samples.items()}
    return timing | {"ratio": paired_ratio(samples["ours"], samples["raw"])}, mask


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median over rounds of each round's ratio: a burst of load from elsewhere hits both sides of a round."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


APPLIERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "ours": apply_token_bitmask_inplace,
    "llguidance": llguidance.torch.apply_token_bitmask_inplace,
    "reference": apply_token_bitmask_inplace_reference,
    "xgrammar_cpu": xgrammar.apply_token_bitmask_inplace,
}


def bench_apply(mask: torch.Tensor, vocab_size: int, rounds: int) -> dict[str, float]:
    """Median ms per applier, and ours over each other (median of per-round ratios), on the same [B, V] logits.

    Logits are restored outside the timed region; round 0 checks that every applier gives the reference's result
    (and compiles llguidance's kernel for the shape, untimed).
    """
    source = torch.randn(mask.shape[0], vocab_size, generator=torch.Generator().manual_seed(0))
    expected = source.clone()
    apply_token_bitmask_inplace_reference(expected, mask)
    logits = source.clone()
    samples: dict[str, list[float]] = {name: [] for name in APPLIERS}
    names = list(APPLIERS)
    for round_index in range(rounds + 1):
        for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
            logits.copy_(source)
            start = time.perf_counter()
            APPLIERS[name](logits, mask)
            if round_index > 0:  # round 0 checks results and touches every buffer once
                samples[name].append((time.perf_counter() - start) * 1e3)
            elif not torch.equal(logits, expected):
                raise AssertionError(f"{name} disagrees with the reference at batch {mask.shape[0]}")
    timing = {f"{name}_ms": statistics.median(times) for name, times in samples.items()}
    return timing | {f"ours_over_{name}": paired_ratio(samples["ours"], samples[name]) for name in names[1:]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps per configuration")
    parser.add_argument("--per-folder", type=int, default=3, help="MaskBench schemas per folder in the grammar pool")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_SETUPS), choices=TOKENIZER_SETUPS)
    parser.add_argument("--compile-timeout", type=float, default=60.0)
    parser.add_argument("--output", type=Path, default=REPO / "results" / "bench_batch.json")
    args = parser.parse_args(argv)
    server_args = GrammarArgs()
    load_cpu_bitmask_kernel(ModelArgs().kernel_build_path)
    fills, applies = [], []
    print(
        f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, CPU pressure {cpu_pressure()}"
    )
    for tokenizer_name in args.tokenizers:
        setup = load_tokenizer_setup(tokenizer_name, ModelArgs().cache_path)
        masks: dict[int, torch.Tensor] = {}
        for backend_name in args.backends:
            backend = make_backend(replace(server_args, grammar_backend=backend_name), setup)
            walks = build_walks(backend, setup, args.per_folder, args.compile_timeout)
            for batch in args.batches:
                timing, mask = bench_fill(backend, walks, setup, batch, args.rounds)
                masks.setdefault(batch, mask)
                row = {"tokenizer": tokenizer_name, "backend": backend_name, "batch": batch, "walks": len(walks)}
                row["cpu_pressure_avg60"] = cpu_pressure()
                fills.append(row | timing)
                print(
                    f"fill  {tokenizer_name:>7} {backend_name:>10} B={batch:<3} ours {timing['ours_ms']:8.3f} ms  "
                    f"raw loop {timing['raw_ms']:8.3f} ms  ratio ours/raw {fills[-1]['ratio']:.3f}"
                )
            backend.shutdown()
        for batch, mask in masks.items():
            timing = bench_apply(mask, setup.vocab_size, args.rounds)
            applies.append({"tokenizer": tokenizer_name, "vocab": setup.vocab_size, "batch": batch} | timing)
            print(
                f"apply {tokenizer_name:>7} V={setup.vocab_size} B={batch:<3} ours {timing['ours_ms']:8.3f} ms  "
                f"llguidance {timing['llguidance_ms']:8.3f} ms  reference {timing['reference_ms']:8.3f} ms  "
                f"xgrammar {timing['xgrammar_cpu_ms']:8.3f} ms  ratio ours/llguidance "
                f"{timing['ours_over_llguidance']:.3f}  ours/reference {timing['ours_over_reference']:.3f}  "
                f"ours/xgrammar {timing['ours_over_xgrammar_cpu']:.3f}"
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {"rounds": args.rounds, "per_folder": args.per_folder, "fill": fills, "apply": applies}
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
