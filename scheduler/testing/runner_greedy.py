"""Greedy decoding straight on a model runner (no scheduler), for the benchmarks that compare runners and formats."""

from __future__ import annotations

from scheduler.model.kv_cache import KVSequence
from scheduler.model.runner_contract import BaseModelRunner


def admitted(runner: BaseModelRunner, prompt: list[int], reserve: int) -> KVSequence:
    """``prompt``'s KV sequence with room for ``reserve`` more tokens."""
    seq = runner.kv.admit(prompt, max_new_tokens=reserve)
    assert seq is not None, "the KV pool is too small for the benchmark"
    return seq


def greedy_tokens(runner: BaseModelRunner, prompt: list[int], steps: int) -> list[int]:
    """The ``steps`` tokens greedy decoding picks after ``prompt``, one decode step each; the KV is released."""
    seq = admitted(runner, prompt, steps)
    logits = runner.prefill([seq], [prompt])[0]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = runner.decode([seq], [tokens[-1]])[0]
    runner.kv.release(seq)
    return tokens
