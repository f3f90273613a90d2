"""A scheduler's loop turned in this process, without zmq: requests handed to it, its final outputs collected. For
the tests and scripts that count its forwards, hold one of its threads, or judge many answers at once."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future

from scheduler.io_struct import GenerateOutput, GenerateReq, encode
from scheduler.scheduler import Scheduler

IDLE_TURN_WAIT_S = 0.005
"""Between turns while the loop has nothing to run (grammars compiling, start endings searched): the other threads
get the core instead of a spinning loop."""


def submit(scheduler: Scheduler, requests: Iterable[GenerateReq]) -> None:
    """Hand ``requests`` to the loop as its zmq socket would; the next turn admits them."""
    for request in requests:
        scheduler.handle_message(b"in-process", encode(request))


def wait_for_grammars(scheduler: Scheduler, timeout_s: float) -> None:
    """Until every queued request's grammar is ready (compiled, its start ending searched), without turning the loop:
    the next turn then admits them all, whenever each compile or search ended."""
    deadline = time.monotonic() + timeout_s
    queue = scheduler.grammar_manager.grammar_queue
    while any(isinstance(req.grammar, Future) and not req.grammar.done() for req in queue):
        if time.monotonic() > deadline:
            raise TimeoutError(f"grammars not ready after {timeout_s:g} s")
        time.sleep(IDLE_TURN_WAIT_S)


def turn_until_finished(scheduler: Scheduler, rids: Collection[str], timeout_s: float) -> dict[str, GenerateOutput]:
    """Turn the loop until each of ``rids`` has its final output; returns every final output seen meanwhile, by rid."""
    deadline = time.monotonic() + timeout_s
    finished: dict[str, GenerateOutput] = {}
    while not all(rid in finished for rid in rids):
        if time.monotonic() > deadline:
            unfinished = [rid for rid in rids if rid not in finished]
            raise TimeoutError(f"{len(unfinished)} requests unfinished after {timeout_s:g} s: {unfinished[:5]}")
        scheduler.step([])
        finished.update(
            (message.rid, message)
            for _, message in scheduler.outbox
            if isinstance(message, GenerateOutput) and message.finished
        )
        scheduler.outbox.clear()
        if not scheduler.running and not scheduler.waiting_queue:
            time.sleep(IDLE_TURN_WAIT_S)
    return finished


def serve(scheduler: Scheduler, requests: list[GenerateReq], timeout_s: float = 600.0) -> list[GenerateOutput]:
    """Every request at once: handed to the loop, their grammars awaited, the loop turned until each has its final
    output; the outputs in the requests' order. The first turn admits them all, so how many forwards a run takes does
    not depend on when a compile or a search ended."""
    deadline = time.monotonic() + timeout_s
    submit(scheduler, requests)
    wait_for_grammars(scheduler, deadline - time.monotonic())
    finished = turn_until_finished(scheduler, [request.rid for request in requests], deadline - time.monotonic())
    return [finished[request.rid] for request in requests]
