"""A constrained request's known ending, which ``scheduler.budget_steering`` keeps (``Req.ending``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EndingPlan:
    """``tokens``: a path from the request's grammar state to the grammar's end (None once stale: the output left it
    far from the budget); ``length``: the last known ending's length; ``last_tokens``: the path the plan held when it
    went stale (where the output comes near the budget again, a suffix of it often still ends the output: the same
    closing fields after more of a string); ``after``: the endings checked after each token of this step's steered
    row; ``is_steered``: whether steering ever overruled the model's first choice;
    ``search_failed``: whether the full search for a stale plan within ``WATCH`` found nothing (it is not run
    again)."""

    tokens: list[int] | None
    length: int
    last_tokens: list[int] = field(default_factory=list)
    after: dict[int, list[int]] = field(default_factory=dict)
    is_steered: bool = False
    search_failed: bool = False
