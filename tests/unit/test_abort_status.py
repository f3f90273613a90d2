"""The HTTP status of a request the scheduler aborted follows the abort's cause, never the wording of its message."""

from __future__ import annotations

import pytest

from scheduler.http.responses import ABORT_STATUS, abort_error
from scheduler.io_struct import AbortCause, FinishReason

MESSAGES = ["Failed to compile json grammar: x", "internal error: boom", "aborted by the client", "anything"]


def test_every_abort_cause_has_a_status() -> None:
    """A cause without one would reach its client as the frontend's own failure."""
    assert set(ABORT_STATUS) == set(AbortCause)


@pytest.mark.parametrize("cause", list(AbortCause))
@pytest.mark.parametrize("message", MESSAGES)
def test_the_status_and_code_follow_the_cause_whatever_the_message(cause: AbortCause, message: str) -> None:
    error = abort_error(FinishReason(type="abort", message=message, cause=cause))
    assert error.status_code == ABORT_STATUS[cause] and error.message == message
    assert (error.code == "invalid_constraint") == (cause is AbortCause.INVALID_CONSTRAINT)
