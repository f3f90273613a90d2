"""Settling futures that several parties race for: a compile, its deadline and its cancellation."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import TypeVar

T = TypeVar("T")


def settle(future: Future[T], value: T | None = None, error: BaseException | None = None) -> None:
    """Settle ``future`` unless it already is: the compile and its deadline race, and the first one wins.

    Called outside any lock of ours: settling runs every waiter's callback (copies of the value among them).
    """
    with contextlib.suppress(InvalidStateError):
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)  # type: ignore[arg-type]


def cancel(future: Future[T]) -> None:
    future.cancel()


def relay(source: Future[T], target: Future[T]) -> None:
    """Settle ``target`` as ``source`` settled (cancelled, failed or with its value)."""
    if source.cancelled():
        target.cancel()
    elif (error := source.exception()) is not None:
        settle(target, error=error)
    else:
        settle(target, value=source.result())


def map_future(source: Future[T], transform: Callable[[T], T]) -> Future[T]:
    """A future resolving to ``transform(source.result())``; cancelled or failed when ``source`` is."""
    derived: Future[T] = Future()

    def on_done(done: Future[T]) -> None:
        if done.cancelled():
            derived.cancel()
            return
        try:
            derived.set_result(transform(done.result()))
        except Exception as e:
            derived.set_exception(e)

    source.add_done_callback(on_done)
    return derived
