"""The terms of one compile, shared by everything that works on it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class CompileControl:
    """The terms of one compile, shared with whatever works on it (its thread, a compile process, ``auto``'s
    attempts): its deadline, whether its result is still wanted, and whether it has left its slot as slow.

    Callbacks run once, on the thread that cancels or marks slow, outside any lock of this object; a callback
    registered after the fact runs at once.
    """

    def __init__(self, timeout_s: float, deadline: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.started_at = time.monotonic()
        self.deadline = self.started_at + timeout_s if deadline is None else deadline
        self._lock = threading.Lock()
        self._cancel_reason: str | None = None
        self._is_slow = False
        self._on_cancel: list[Callable[[str], None]] = []
        self._on_slow: list[Callable[[], None]] = []
        self._children: list[CompileControl] = []

    @property
    def cancel_reason(self) -> str | None:
        """Why the result is no longer wanted (None while it is)."""
        return self._cancel_reason

    @property
    def is_slow(self) -> bool:
        return self._is_slow

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def cancel(self, reason: str) -> None:
        """Nobody wants the result any more (deadline, reset, another backend won): stop what can be stopped."""
        with self._lock:
            if self._cancel_reason is not None:
                return
            self._cancel_reason = reason
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            callback(reason)

    def extend_deadline(self, deadline: float) -> None:
        """Someone else now waits for the result, until ``deadline``: this compile and the work done for it
        (``child``) may run until then."""
        with self._lock:
            self.deadline = max(self.deadline, deadline)
            children = list(self._children)
        for child in children:
            child.extend_deadline(deadline)

    def mark_slow(self) -> None:
        """The compile left its slot: whatever works on it lowers its CPU priority."""
        with self._lock:
            if self._is_slow:
                return
            self._is_slow = True
            callbacks, self._on_slow = self._on_slow, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[str], None]) -> None:
        with self._lock:
            if self._cancel_reason is None:
                self._on_cancel.append(callback)
                return
        callback(self._cancel_reason)

    def on_slow(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._is_slow:
                self._on_slow.append(callback)
                return
        callback()

    def child(self) -> CompileControl:
        """A control for work done for this compile: the same deadline (extended with it), cancelled when this one
        is (slowness is each one's own: work started after this one turned slow is not slow yet)."""
        child = CompileControl(self.timeout_s, self.deadline)
        with self._lock:
            self._children.append(child)
        self.on_cancel(child.cancel)
        return child
