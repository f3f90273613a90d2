"""OpenAI's predicted outputs as a draft source: text the answer is expected to mostly repeat, followed as the
answer grows.

The prediction's tokens are kept in step with the output: while the output repeats the prediction, the drafts are
what comes next in it. Where the output departs from it (an edited field, a renamed variable), it is found again,
first as a local edit (the output left the prediction's token out, replaced it, or put tokens before it: the next
tokens equal the prediction's from just past the departure, or from it), else where the output's last tokens occur
in it again (the longest suffix of ``MAX_MATCH`` down to ``MIN_MATCH`` tokens, its first occurrence past the last
aligned position, or once ``MAX_MATCH`` tokens have passed without a local edit its first anywhere: the output
repeating part of the prediction), and drafting resumes from there. Drafts are only proposals: the verifier keeps
exactly the tokens the model would have produced.

The same walk counts the prediction's tokens that appeared in the output (OpenAI's ``accepted_prediction_tokens``):
those an output token was matched with, in step or on a re-alignment (each output token with one at most). The
rest did not appear (``rejected_prediction_tokens``). Both depend on the output alone, never on how it was decoded
(drafts, batch, load).
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_MATCH = 8
"""The longest output suffix a re-alignment looks for, and how long a local edit is looked for."""
MIN_MATCH = 2
"""The shortest output suffix a re-alignment takes: one token matches too many places to say where the output is."""


@dataclass
class Cursor:
    """Where an output stands in the prediction."""

    position: int | None = 0
    """Where the next output token is expected in the prediction; None while the output is elsewhere."""
    anchor: int = 0
    """The last position the output was aligned at: a re-alignment looks past it first."""
    departure: int | None = None
    """Where the output last departed from the prediction (a local edit is looked for past it)."""
    tail: list[int] = field(default_factory=list)
    """The output's last ``MAX_MATCH`` tokens (a re-alignment's suffixes)."""
    num_unmatched: int = 0
    """The output's last tokens that no prediction token was matched with."""

    def copy(self) -> Cursor:
        return Cursor(self.position, self.anchor, self.departure, list(self.tail), self.num_unmatched)


class PredictionAligner:
    """Follows one request's output (which only grows) through its predicted token ids."""

    def __init__(self, prediction: list[int]) -> None:
        self.prediction = prediction
        self.cursor = Cursor()
        self.num_seen = 0
        """Output tokens followed so far."""
        self.appeared = bytearray(len(prediction))
        """1 at each prediction position an output token was matched with (each output token with one at most)."""
        self._ends: dict[tuple[int, ...], list[int]] = {}
        """The ends of each ``MIN_MATCH``-gram of the prediction, in order (where a re-alignment may land)."""
        for end in range(MIN_MATCH, len(prediction) + 1):
            self._ends.setdefault(tuple(prediction[end - MIN_MATCH : end]), []).append(end)

    @property
    def num_accepted(self) -> int:
        """Prediction tokens that appeared in the output followed so far."""
        return sum(self.appeared)

    @property
    def num_rejected(self) -> int:
        """Prediction tokens that have not appeared in the output followed so far (at the end: those the completion
        does not repeat)."""
        return len(self.prediction) - self.num_accepted

    def follow(self, output: list[int]) -> None:
        """Take the tokens ``output`` added since the last call."""
        for token in output[self.num_seen :]:
            self._step(self.cursor, token, self.appeared)
        self.num_seen = len(output)

    def drafts(self, output: list[int], pending: list[int], max_tokens: int) -> list[int]:
        """The prediction's next tokens after ``output`` (the request's output so far) and ``pending`` (tokens this
        step adds before the prediction's: other drafts), at most ``max_tokens``. Only ``output`` is taken for good:
        ``pending`` may yet be rejected."""
        self.follow(output)
        cursor = self.cursor.copy()
        for token in pending:
            self._step(cursor, token, None)
        if cursor.position is None or max_tokens <= 0:
            return []
        return self.prediction[cursor.position : cursor.position + max_tokens]

    def _step(self, cursor: Cursor, token: int, appeared: bytearray | None) -> None:
        """Move ``cursor`` past ``token``; ``appeared`` (if given) marks the prediction positions matched."""
        cursor.tail.append(token)
        del cursor.tail[:-MAX_MATCH]
        cursor.num_unmatched += 1
        matched = self._match(cursor, token)
        if not matched:
            return
        if appeared is not None:  # the output tokens matched before are not counted again
            newly = range(max(matched.start, matched.stop - cursor.num_unmatched), matched.stop)
            appeared[newly.start : newly.stop] = b"\x01" * len(newly)
        cursor.position = cursor.anchor = matched.stop
        cursor.departure = None
        cursor.num_unmatched = 0

    def _match(self, cursor: Cursor, token: int) -> range:
        """The prediction positions ``token`` (the end of ``cursor.tail``) is matched with, if any: the next one in
        step, one of a local edit, or a re-alignment's; a departure sets ``cursor.position`` to None."""
        prediction = self.prediction
        if cursor.position is not None:
            if cursor.position < len(prediction) and prediction[cursor.position] == token:
                return range(cursor.position, cursor.position + 1)
            cursor.departure, cursor.position = cursor.position, None
        departure = cursor.departure
        is_near_departure = departure is not None and cursor.num_unmatched <= MAX_MATCH
        if departure is not None and is_near_departure:
            first = departure + (cursor.num_unmatched == 1)  # on departing, only a token left out
            for position in range(first, min(departure + 2, len(prediction))):
                if prediction[position] == token:
                    return range(position, position + 1)
        ahead, anywhere = self._realign(cursor.tail, cursor.anchor)
        return ahead if ahead or is_near_departure else anywhere

    def _realign(self, tail: list[int], after: int) -> tuple[range, range]:
        """The prediction positions of the longest suffix of ``tail`` that occurs in the prediction: its first
        occurrence ending past ``after`` (empty if none does), and its first; both empty when no suffix of
        ``MIN_MATCH`` tokens occurs."""
        if len(tail) < MIN_MATCH:
            return range(0), range(0)
        candidates = self._ends.get(tuple(tail[-MIN_MATCH:]), [])
        for n in range(min(MAX_MATCH, len(tail)), MIN_MATCH - 1, -1):
            suffix = tail[-n:]
            ends = [end for end in candidates if end >= n and self.prediction[end - n : end] == suffix]
            if ends:
                ahead = next((end for end in ends if end > after), None)
                return range(ahead - n, ahead) if ahead is not None else range(0), range(ends[0] - n, ends[0])
        return range(0), range(0)
