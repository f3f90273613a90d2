"""Output logprobs in each API's shape: OpenAI chat (``content`` entries with ``top_logprobs``), OpenAI completions
(``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``) and SGLang's ``meta_info`` lists.

Every value is the scheduler's ``TokenLogprob``: the log-softmax of the logits the token was sampled from, after
logit bias, penalties and the grammar mask, divided by the temperature (SGLang's definition). A token is shown as the
text it decodes to alone (a partial UTF-8 character shows as U+FFFD; ``bytes`` are that text's UTF-8).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from scheduler.io_struct import TokenLogprob

TokenText = Callable[[int], str]
"""A token id's text, decoded alone."""


def chat_logprobs(logprobs: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    """OpenAI's chat ``choice.logprobs``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [entry(t.token_id, t.logprob) | {"top_logprobs": [entry(i, v) for i, v in t.top]} for t in logprobs]
    return {"content": content, "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob], token_text: TokenText, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``choice.logprobs``; ``top_logprobs`` holds the sampled token too (as vLLM's does).
    ``text_offset``: where the first token's text starts in the completion (a stream's earlier chunks)."""
    tokens = [token_text(t.token_id) for t in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [t.logprob for t in logprobs],
        "top_logprobs": [{token_text(i): v for i, v in [(t.token_id, t.logprob), *t.top]} for t in logprobs],
        "text_offset": offsets,
    }


def sglang_logprobs(logprobs: list[TokenLogprob], num_top: int, token_text: TokenText | None) -> dict[str, Any]:
    """SGLang's ``meta_info`` fields: ``[logprob, token_id, text]`` triples (text None unless
    ``return_text_in_logprobs``); input (prompt) lists are empty, as with ``logprob_start_len`` -1."""

    def entry(token_id: int, logprob: float) -> list[Any]:
        return [logprob, token_id, token_text(token_id) if token_text is not None else None]

    fields: dict[str, Any] = {
        "input_token_logprobs": [],
        "output_token_logprobs": [entry(t.token_id, t.logprob) for t in logprobs],
    }
    if num_top:
        fields["input_top_logprobs"] = []
        fields["output_top_logprobs"] = [[entry(i, v) for i, v in t.top] for t in logprobs]
    return fields
