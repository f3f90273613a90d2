"""The grammar library's errors, and the one rule for quoting an engine's message: short, and never the whole spec.

Importing this module loads nothing else (the HTTP frontend builds constraint keys without torch or an engine).
"""

from __future__ import annotations

import re

MAX_MESSAGE_CHARS = 300
"""Longest engine message quoted to a user; engines echo whole grammars and schemas in theirs."""

_FEATURE_REFUSAL = re.compile(r"((?:feature|refuses|narrows) .+? \(at .*?\))(?:[;:]|$)")
_MAX_REASON_CHARS = 80


class GrammarSpecError(ValueError):
    """A constraint spec that cannot be compiled; the message says why without echoing the whole spec."""


class TokenRejectedError(ValueError):
    """Raised by ``accept_token`` when the grammar does not allow the token in its current state."""

    def __init__(self, token: int, reason: str = "") -> None:
        self.token = token
        message = f"token {token} is not allowed by the grammar"
        super().__init__(f"{message}: {reason}" if reason else message)


COMPILE_TIMEOUT_PREFIX = "Grammar compilation timed out"
"""How a compile past its deadline's message starts."""
COMPILE_NOT_STARTED_PREFIX = "Grammar compilation did not start"
"""How the message of a compile that waited for a slot until its deadline starts."""


class CompileTimeoutError(TimeoutError):
    """A grammar compile ran past its deadline; it is not cached, so the next request compiles anew."""


class CompileNotStartedError(CompileTimeoutError):
    """A grammar compile waited for a free slot until its deadline, behind other compiles: it never ran."""


class CompileProcessError(RuntimeError):
    """A compile process died (a crash inside a native engine: its signal), failed, was killed (past its memory
    bound, or its compile no longer wanted), or was shut down mid-compile; the message says which."""


def bounded_message(text: str, first_line_only: bool = True, limit: int = MAX_MESSAGE_CHARS) -> str:
    """An engine's message fit to show a user: its first line (or all lines joined), at most ``limit`` characters."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    message = (lines[0] if first_line_only else " ".join(lines)) if lines else "no details given"
    return message if len(message) <= limit else message[:limit] + "..."


def refusal_reason(message: str) -> str:
    """The short, stable part of a refusal message (what ``known_refusals.json`` records, what ``auto`` quotes).

    The refused (or narrowed) feature and where it is (``feature 'not' (at /properties/a)``) for the backends' own
    refusals; otherwise the message's first sentence, cut at a word boundary near 80 characters.
    """
    feature = _FEATURE_REFUSAL.search(message)
    if feature is not None:
        return feature.group(1)
    sentence = message.split(". ")[0]
    return sentence if len(sentence) <= _MAX_REASON_CHARS else sentence[:_MAX_REASON_CHARS].rsplit(" ", 1)[0]
