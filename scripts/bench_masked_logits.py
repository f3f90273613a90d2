"""The lm_head over a grammar mask's panels against the full product, in one process on the default runner.

Answers: the serving benchmark's JSON schema and regex, greedy, from its prompts, on xgrammar's masks; each decode
step runs twice on two copies of the sequence, the forward handed the step's mask and not (alternating which goes
first), and the allowed logits of both must be the same bits. Prints per kind the forwards, how many had a row that
allowed under a quarter of the panels, and the masked over the full forwards' time. Densities: decode steps of 1
and 8 rows whose masks allow a given share of the panels (random panels), over steps without a mask.

    python -m scripts.bench_masked_logits [--answers 6] [--rounds 40] [--model-path <a GGUF file>]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xgrammar

from cpu_kernels.cpu_info import describe_cpu
from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner import ModelRunner
from scheduler.prompt_encoder import PromptEncoder
from scheduler.server_args import ModelArgs
from scripts.serving_workload import PERSON_REGEX, PERSON_SCHEMA, prompt_for
from triton_ops import apply_token_bitmask_inplace
from triton_ops.bitmask_format import allocate_bitmask

SIDES = ("masked", "full")
DENSITIES = (0.001, 0.05, 0.1, 0.2, 0.24)
"""Shares of the lm_head's panels a row allows: up to just under the quarter where rows take the full product."""


def admitted(runner: ModelRunner, tokens: list[int], budget: int) -> KVSequence:
    seq = runner.kv.admit(tokens, budget)
    if seq is None:
        raise RuntimeError("the KV pool has no room for the benchmark's sequences")
    return seq


def replay(runner: ModelRunner, grammar: xgrammar.CompiledGrammar, prompts: list[list[int]]) -> dict[str, float]:
    """Greedy answers under ``grammar``, each forward timed with and without its mask (the same tokens)."""
    mask = xgrammar.allocate_token_bitmask(1, runner.vocab_size)
    seconds = dict.fromkeys(SIDES, 0.0)
    forwards = sparse = 0
    for prompt in prompts:
        matcher = xgrammar.GrammarMatcher(grammar)
        seqs = {side: admitted(runner, prompt, 100) for side in SIDES}
        logits = {side: runner.prefill([seqs[side]], [prompt])[0] for side in SIDES}
        while True:
            matcher.fill_next_token_bitmask(mask)
            row = logits["full"].clone()[None]
            apply_token_bitmask_inplace(row, mask)
            token = int(row.argmax())
            if not matcher.accept_token(token):
                raise AssertionError(f"the grammar refused its own mask's token {token}")
            if matcher.is_terminated() or len(seqs["full"]) - len(prompt) >= 72:
                break
            matcher.fill_next_token_bitmask(mask)
            for side in SIDES if forwards % 2 == 0 else SIDES[::-1]:
                started = time.perf_counter()
                given = mask if side == "masked" else None
                logits[side] = runner.forward([seqs[side]], [[token]], vocab_mask=given)[0]
                seconds[side] += time.perf_counter() - started
            skipped = torch.isneginf(logits["masked"])
            if not torch.equal(logits["masked"][~skipped], logits["full"][~skipped]):
                raise AssertionError("a masked forward's computed logits differ from the full product's")
            forwards += 1
            sparse += bool(skipped.any())
        for seq in seqs.values():
            runner.kv.release(seq)
    return {"forwards": forwards, "sparse": sparse, "ratio": seconds["masked"] / seconds["full"]}


def density_costs(runner: ModelRunner, rows: int, rounds: int) -> dict[float, float]:
    """A decode step of ``rows`` sequences whose masks allow each share of ``DENSITIES`` of the panels, over one
    without a mask (medians of ``rounds`` interleaved steps)."""
    generator = torch.Generator().manual_seed(0)
    num_panels = -(-runner.vocab_size // 16)
    seqs = []
    for r in range(rows):
        tokens = [(i * 7919 + r * 31) % (runner.vocab_size - 200) + 100 for i in range(300)]
        seq = admitted(runner, tokens, 400)
        runner.prefill([seq], [tokens])
        seqs.append(seq)
    masks = {}
    for density in DENSITIES:
        mask = allocate_bitmask(rows, runner.vocab_size, "cpu").zero_()
        for r in range(rows):
            panels = torch.randperm(num_panels, generator=generator)[: max(1, int(density * num_panels))]
            mask[r].view(torch.int16)[panels] = 1  # the first token of each chosen panel
        masks[density] = mask
    times: dict[float | None, list[float]] = {None: [], **{density: [] for density in DENSITIES}}
    for _ in range(rounds):
        for share, seconds in times.items():
            started = time.perf_counter()
            runner.forward(seqs, [[5]] * rows, [1] * rows, masks[share] if share is not None else None)
            seconds.append(time.perf_counter() - started)
            for seq in seqs:
                runner.truncate(seq, 300)
    for seq in seqs:
        runner.kv.release(seq)
    full = statistics.median(times[None])
    return {density: statistics.median(times[density]) / full for density in DENSITIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=6, help="greedy answers per constraint kind")
    parser.add_argument("--rounds", type=int, default=40, help="decode steps per density")
    parser.add_argument("--model-path", default=None, help="a GGUF file or model folder (default: the embedded model)")
    args = parser.parse_args()
    print(describe_cpu())
    model = {"model_path": args.model_path} if args.model_path is not None else {}
    runner = ModelRunner(ModelArgs(max_running_requests=8, **model))
    encoder = PromptEncoder(runner.tokenizer, runner.vocab_size, runner.max_seq_len)
    info = xgrammar.TokenizerInfo.from_huggingface(
        runner.tokenizer, vocab_size=runner.vocab_size, stop_token_ids=runner.eos_token_ids
    )
    compiler = xgrammar.GrammarCompiler(info)
    grammars = {
        "json": compiler.compile_json_schema(json.dumps(PERSON_SCHEMA)),
        "regex": compiler.compile_regex(PERSON_REGEX),
    }
    prompts = [encoder.encode(messages=[{"role": "user", "content": prompt_for(i)}]) for i in range(args.answers)]
    for kind, grammar in grammars.items():
        result = replay(runner, grammar, prompts)
        print(
            f"{kind}: {result['forwards']} forwards, {result['sparse']} with a row under a quarter of the panels; "
            f"masked / full forward time {result['ratio']:.3f}"
        )
    for rows in (1, 8):
        costs = density_costs(runner, rows, args.rounds)
        shares = ", ".join(f"{density:.1%} of the panels {ratio:.3f}" for density, ratio in costs.items())
        print(f"{rows} row(s), a decode step over one without a mask: {shares}")


if __name__ == "__main__":
    main()
