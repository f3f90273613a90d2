"""A request's output message: what is new since the last one sent (all of it without streaming), and its usage."""

from __future__ import annotations

from scheduler.io_struct import GenerateOutput, Usage
from scheduler.request import Req


def next_output(
    req: Req, full_text: str, finished: bool, num_reasoning_tokens: int, full_reasoning: str | None = None
) -> GenerateOutput:
    """The message that brings ``req``'s client up to date, and ``req`` marked as sent up to here;
    ``full_reasoning``: the think block's text so far, for a request that separates it."""
    first_new = req.num_sent_tokens if req.stream else 0
    token_ids = req.output_ids[first_new:]
    text = _new_text(full_text, req.sent_text) if req.stream else full_text
    reasoning = None
    if full_reasoning is not None:
        reasoning = _new_text(full_reasoning, req.sent_reasoning) if req.stream else full_reasoning
        req.sent_reasoning = full_reasoning
    req.num_sent_tokens = len(req.output_ids)
    req.sent_text = full_text
    return GenerateOutput(
        rid=req.rid,
        token_ids=token_ids,
        text=text,
        finished=finished,
        finish_reason=req.finish_reason if finished else None,
        usage=_usage(req, num_reasoning_tokens),
        grammar_cache_hit=req.grammar_cache_hit,
        logprobs=req.output_logprobs[first_new:] if req.top_logprobs_num is not None else None,
        reasoning_text=reasoning,
    )


def _usage(req: Req, num_reasoning_tokens: int) -> Usage:
    usage = Usage(
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.num_cached_tokens,
        reasoning_tokens=num_reasoning_tokens,
    )
    if req.prediction is not None:
        req.prediction.follow(req.output_ids)
        usage.accepted_prediction_tokens = req.prediction.num_accepted
        usage.rejected_prediction_tokens = req.prediction.num_rejected
    return usage


def _new_text(full_text: str, sent_text: str) -> str:
    """What a streaming client lacks of ``full_text`` (all of it if what it has is no longer a prefix)."""
    return full_text[len(sent_text) :] if full_text.startswith(sent_text) else full_text
