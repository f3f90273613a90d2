"""The kernels' weight warming (``cpu_kernels/csrc/weight_warming.h``): the idle kernel thread asks the caches for a
forward's next weights. It only asks for bytes ahead, so a forward gives the same logits with it on or off, at batch
sizes on both sides of the rows where it stops (8), whatever it is asked while forwards run."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cpu_kernels import library
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ServerArgs

PROMPT = [(i * 7919) % 40000 + 100 for i in range(40)]
WARM_TOKENS = 8
"""``kWarmTokens``: forwards of more rows do not warm."""


@pytest.fixture(scope="module")
def runner(server_args: ServerArgs) -> ModelRunner:
    """The embedded model's own Q4_1 and Q8_0 blocks (``--weight-dtype auto``)."""
    return ModelRunner(replace(server_args.model, max_seq_len=128, max_total_tokens=4096, weight_dtype="auto"))


@pytest.fixture
def warm_bytes() -> Iterator[int]:
    """The kernels' own setting, put back after the test, on two kernel threads (one would warm nothing: the
    caller's thread has no idle worker beside it)."""
    library.load(ServerArgs().model.kernel_build_path)
    kept = library.cache_warm_bytes()
    library.set_kernel_threads(2)
    yield kept
    library.set_kernel_threads(None)
    library.set_cache_warm_bytes(kept)


def decode_logits(runner: ModelRunner, batch: int, steps: int = 3) -> list[torch.Tensor]:
    """A prefill of ``batch`` prompts, then ``steps`` decode steps of all of them: every forward's logits."""
    seqs = [runner.kv.admit(PROMPT[b % 8 :], steps + 1) for b in range(batch)]
    assert all(seq is not None for seq in seqs)
    logits = [runner.prefill(seqs, [PROMPT[b % 8 :] for b in range(batch)])]
    for step in range(steps):
        logits.append(runner.decode(seqs, [(step * 31 + b) % 1000 + 5 for b in range(batch)]))
    for seq in seqs:
        runner.kv.release(seq)
    return logits


def last_level_cache_bytes() -> int:
    """The largest level of cpu0's caches as Linux lists them."""
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        size = (index / "size").read_text().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes[int((index / "level").read_text())] = int(size.rstrip("KMG")) * units.get(size[-1], 1)
    return sizes[max(sizes)] if sizes else 0


@pytest.mark.model
@pytest.mark.parametrize("batch", [1, 2, WARM_TOKENS, WARM_TOKENS + 1, 16, 32])
def test_a_forward_gives_the_same_logits_with_warming_on_or_off(
    runner: ModelRunner, warm_bytes: int, batch: int
) -> None:
    """Off, the whole of the setting (half the last-level cache), and a budget that ends inside a weight; at 16 and 32
    rows too, where the kernels take other tiles (warming stops before them)."""
    runner.kv.flush()
    library.set_cache_warm_bytes(0)
    reference = decode_logits(runner, batch)
    for budget in (warm_bytes, 4096 + 64):
        library.set_cache_warm_bytes(budget)
        warmed = decode_logits(runner, batch)
        assert all(torch.equal(a, b) for a, b in zip(reference, warmed, strict=True))


@pytest.mark.model
def test_warm_requests_racing_forwards_change_no_logits(runner: ModelRunner, warm_bytes: int) -> None:
    """Another thread asking for warms without pause (it replaces the ranges the worker walks, while jobs come and
    go): the pool still runs every job, and the forwards' logits are the same."""
    runner.kv.flush()
    reference = decode_logits(runner, 2, steps=8)
    stop = threading.Event()

    def ask() -> None:
        while not stop.is_set():
            runner.model.warm_weights(1)

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        raced = decode_logits(runner, 2, steps=8)
    finally:
        stop.set()
        asker.join()
    assert all(torch.equal(a, b) for a, b in zip(reference, raced, strict=True))


@pytest.mark.skipif(not Path("/sys/devices/system/cpu/cpu0/cache").exists(), reason="Linux lists no caches here")
def test_warming_asks_for_at_most_half_the_last_level_cache(warm_bytes: int) -> None:
    assert warm_bytes == last_level_cache_bytes() // 2 > 0
    library.set_cache_warm_bytes(0)
    assert library.cache_warm_bytes() == 0
    with pytest.raises(ValueError, match="a byte count"):
        library.set_cache_warm_bytes(-1)
