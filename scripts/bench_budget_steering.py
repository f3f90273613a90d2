"""Cost per token of budget-aware constraints, far from the budget and near it, beside the mask fill it adds to.

Walks SmolLM2's vocabulary through ``bench_serving``'s JSON schema and regex on each backend: random logits masked by
the grammar, steered as the scheduler steers them (``BudgetSteering.steer``, the check of a sampled token within
``WATCH`` and ``record``), sampled, accepted. Each walk runs three times, interleaved: with a budget its output never
nears (the feature's cost there is its bookkeeping), with the constraint's shortest output plus ``--watch-slack``
tokens (within ``WATCH``: each sampled token checked, the plan kept current after every token) and plus ``--slack``
tokens (every step near the budget). One ``BudgetSteering`` serves a constraint's walks, as the scheduler's serves its
requests. Printed per backend and constraint: microseconds per token of the mask fill (for scale) and of all the
steering's work (checks, the steering and sampling again of refused tokens, ``record``) far, within ``WATCH`` and
near, each over the fill; the bounded searches run to keep plans current and the plans gone stale (nothing found:
searched anew once the budget nears). Random logits choose tokens no model would near the budget (a new item, a long
string), so far more of their tokens are refused and steered than a model's. The start's ending (searched once per
constraint, when its first request is admitted) is timed apart.

    python -m scripts.bench_budget_steering [--walks 12] [--slack 6] [--watch-slack 30]
        [--backends xgrammar llguidance outlines]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from cpu_kernels.cpu_info import cpu_model
from scheduler.budget_steering import BudgetSteering
from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.server_args import GrammarArgs, ModelArgs
from scripts.serving_workload import PERSON_REGEX, PERSON_SCHEMA
from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.endings.search import EndingSearch
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup
from triton_ops.bitmask_format import allocate_bitmask, unpack_bitmask

FAR_BUDGET = 1 << 20
MAX_FAR_TOKENS = 96
"""A walk far from its budget stops here (random logits may write a string for ever)."""


def walk(
    grammar: BaseGrammarObject, key: Any, steering: BudgetSteering, budget: int, seed: int, vocab_size: int
) -> tuple[float, float, float, float, int, bool]:
    """Seconds spent filling masks, steering rows (before sampling), checking sampled tokens within ``WATCH`` (after
    it) and recording tokens (``record``: keeping the plan current), tokens walked, and whether the grammar ended.
    ``steering`` is
    shared by the walks of one constraint, as the scheduler shares it among requests."""
    params = SamplingParams(max_new_tokens=budget, temperature=1.0)
    req = Req(rid=str(seed), client_id=b"", prompt_ids=[], sampling_params=params, grammar_key=key, grammar=grammar)
    steering.refusal(req)
    generator = torch.Generator().manual_seed(seed)
    mask = allocate_bitmask(1, vocab_size, "cpu")
    fill_s = steer_s = check_s = record_s = 0.0
    limit = min(budget, MAX_FAR_TOKENS) if budget == FAR_BUDGET else budget
    while len(req.output_ids) < limit and not grammar.is_terminated():
        start = time.perf_counter()
        grammar.fill_vocab_mask(mask, 0)
        filled = time.perf_counter()
        logits = torch.randn(1, vocab_size, generator=generator) * 3
        logits[~unpack_bitmask(mask, vocab_size)] = float("-inf")
        steer_start = time.perf_counter()
        steering.steer([req], [range(1)], logits, [False])
        watched = steering.watched_rows([req], [range(1)], [False])
        steered = time.perf_counter()
        token = int(torch.multinomial(torch.softmax(logits[0], dim=0), 1, generator=generator))
        check_start = time.perf_counter()
        if steering.refused_samples([req], [range(1)], watched, logits, [token]):
            token = int(torch.multinomial(torch.softmax(logits[0], dim=0), 1, generator=generator))
        checked = time.perf_counter()
        grammar.accept_token(token)
        req.output_ids.append(token)
        record_start = time.perf_counter()
        steering.record(req, token)
        fill_s += filled - start
        steer_s += steered - steer_start
        check_s += checked - check_start
        record_s += time.perf_counter() - record_start
    return fill_s, steer_s, check_s, record_s, len(req.output_ids), grammar.is_terminated()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=12, help="walks per backend, constraint and distance")
    parser.add_argument("--slack", type=int, default=6, help="near: the shortest output plus this many tokens")
    parser.add_argument(
        "--watch-slack", type=int, default=30, help="watch: the shortest output plus this many tokens (within WATCH)"
    )
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance", "outlines"])
    args = parser.parse_args(argv)
    server_args = GrammarArgs()
    setup = load_tokenizer_setup("smollm2", ModelArgs().cache_path)
    vocabulary = tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    search = EndingSearch(vocabulary)
    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; SmolLM2 vocabulary ({setup.vocab_size})")
    print("us/token: fill (the grammar's mask) | far from the budget | within WATCH (check + record) | near it")
    for name in args.backends:
        backend = create_grammar_backend(
            replace(server_args, grammar_backend=name), setup.tokenizer, setup.vocab_size, setup.eos_token_ids
        )
        assert backend is not None
        try:
            for kind, spec in (("json", PERSON_SCHEMA), ("regex", PERSON_REGEX)):
                key = make_grammar_key(kind, spec)
                grammar = compile_grammar(backend, key)
                if isinstance(grammar, InvalidGrammarObject):
                    print(f"{name:10} {kind:5} refused: {grammar.error_message[:100]}")
                    continue
                start = time.perf_counter()
                ending = search.find(grammar)
                start_ms = (time.perf_counter() - start) * 1e3
                assert ending is not None, f"{name} {kind}: no ending from the start"
                per_token: dict[str, list[float]] = {"fill": [], "far": [], "watch": [], "near": []}
                steering = BudgetSteering(search, max_seq_len=FAR_BUDGET * 2)
                num_ended = 0
                for i in range(args.walks):
                    distances = [
                        ("far", FAR_BUDGET),
                        ("watch", len(ending) + args.watch_slack),
                        ("near", len(ending) + args.slack),
                    ]
                    for label, budget in distances if i % 2 == 0 else distances[::-1]:
                        fill_s, steer_s, check_s, record_s, num_tokens, ended = walk(
                            grammar.copy(), key, steering, budget, i, setup.vocab_size
                        )
                        spent = steer_s + check_s + record_s
                        per_token[label].append(spent / num_tokens * 1e6)
                        per_token["fill"].append(fill_s / num_tokens * 1e6)
                        num_ended += ended and label == "near"
                fill, far, watch, near = (statistics.median(per_token[k]) for k in ("fill", "far", "watch", "near"))
                print(
                    f"{name:10} {kind:5} fill {fill:7.1f} | far {far:6.1f} ({far / fill:5.2f}x fill)"
                    f" | watch {watch:6.1f} ({watch / fill:5.2f}x fill)"
                    f" | near {near:8.1f} ({near / fill:6.1f}x fill)  near walks ended in budget"
                    f" {num_ended}/{args.walks}; start ending {len(ending)} tokens in {start_ms:.0f} ms;"
                    f" bounded searches {steering.num_searches}, plans gone stale {steering.num_stale}"
                    f" (over {args.walks * 3} walks)"
                )
        finally:
            backend.shutdown()


if __name__ == "__main__":
    main()
