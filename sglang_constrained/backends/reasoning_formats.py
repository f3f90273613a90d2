"""What each ``--reasoning-parser`` expects of a model (no engine, no torch: the server's flags read it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ReasoningStart = Literal["thinking", "may_think", "answering"]
"""Where a request's output starts: inside the think block (the prompt opened it, or the model always thinks), free to
open one with the think-start token as its first token (otherwise it answers at once), or answering (thinking off)."""


@dataclass(frozen=True)
class ReasoningFormat:
    """What a ``--reasoning-parser`` expects of the model: its think tags, and where its output starts when the
    prompt does not say (a prompt that ends inside an open think block starts thinking; one that ends right after a
    closed, empty one starts answering)."""

    think_start: str
    think_end: str
    default_start: ReasoningStart


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("<think>", "</think>", "may_think"),
    "qwen3-thinking": ReasoningFormat("<think>", "</think>", "thinking"),
    "deepseek-r1": ReasoningFormat("<think>", "</think>", "thinking"),
    "glm45": ReasoningFormat("<think>", "</think>", "may_think"),
}
"""Each ``--reasoning-parser``: Qwen3 and GLM-4.5 hybrids open ``<think>`` themselves or answer at once; DeepSeek-R1
and Qwen3's thinking models think from their first token (R1 writes no ``<think>``)."""


def reasoning_format(reasoning_parser: str) -> ReasoningFormat:
    """The format of ``reasoning_parser``; raises ValueError naming the choices for an unknown one."""
    if reasoning_parser not in REASONING_FORMATS:
        raise ValueError(f"unknown --reasoning-parser {reasoning_parser!r}; choose one of {sorted(REASONING_FORMATS)}")
    return REASONING_FORMATS[reasoning_parser]
