"""Scheduler outputs as final HTTP answers: OpenAI completions, SGLang ``/generate`` results, and errors in
OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (streamed answers: ``scheduler.http.streaming``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from scheduler.http.logprobs import TokenText, chat_logprobs, completion_logprobs
from scheduler.http.protocol import ProtocolError
from scheduler.http.tool_calls import ToolPlan
from scheduler.io_struct import AbortCause, FinishReason, GenerateOutput

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a request whose client went away; logged, never seen by a client."""

ABORT_STATUS: dict[AbortCause, int] = {
    AbortCause.BAD_REQUEST: 400,
    AbortCause.INVALID_CONSTRAINT: 400,
    AbortCause.COMPILE_TIMEOUT: 400,
    AbortCause.COMPILE_FAILED: 400,
    AbortCause.UNSATISFIABLE: 400,
    AbortCause.COMPILE_NOT_STARTED: 503,
    AbortCause.GRAMMAR_RESET: 503,
    AbortCause.SHUTDOWN: 503,
    AbortCause.GRAMMAR_ENGINE: 500,
    AbortCause.INTERNAL: 500,
    AbortCause.CLIENT: CLIENT_CLOSED_REQUEST,
}
"""The status of each abort cause: the request's own fault (400: a bad field or prompt, an invalid or unsupported
constraint, a compile past its deadline, a constraint that cannot finish), the server busy or stopping (503: a compile
that waited for a slot until its deadline), the server's fault (500), or the client gone (499, logged only)."""


def abort_error(reason: FinishReason) -> ProtocolError:
    """The HTTP error for a request the scheduler aborted, by its cause (every abort has one; without, 400)."""
    message = reason.message or "the request was aborted"
    status = ABORT_STATUS[reason.cause] if reason.cause is not None else 400
    code = "invalid_constraint" if reason.cause is AbortCause.INVALID_CONSTRAINT else None
    return ProtocolError(message, status_code=status, code=code)


def error_body(error: ProtocolError) -> dict[str, Any]:
    kind = "invalid_request_error" if error.status_code < 500 else "server_error"
    return {"error": {"message": error.message, "type": kind, "param": error.param, "code": error.code}}


def check_finished(output: GenerateOutput) -> None:
    """Raise the request's error if the scheduler aborted it."""
    if output.finish_reason is not None and output.finish_reason.type == "abort":
        raise abort_error(output.finish_reason)


def openai_finish_reason(output: GenerateOutput) -> str | None:
    return output.finish_reason.type if output.finished and output.finish_reason is not None else None


def usage_body(outputs: dict[int, GenerateOutput], n: int) -> dict[str, Any]:
    """Token counts of a whole completion: each prompt counted once (its choice ``p * n``), every choice's output;
    ``prompt_tokens_details.cached_tokens`` as OpenAI's: prompt tokens whose KV came from the prefix cache;
    ``completion_tokens_details``' prediction counts summed over the choices (each choice follows the prediction on
    its own; ``scheduler.predicted_output``)."""
    prompts = [o.usage for i, o in outputs.items() if i % n == 0]
    prompt = sum(usage.prompt_tokens for usage in prompts)
    completion = sum(o.usage.completion_tokens for o in outputs.values())
    details = ("reasoning_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(usage.cached_tokens for usage in prompts)},
        "completion_tokens_details": {name: sum(getattr(o.usage, name) for o in outputs.values()) for name in details},
    }


def chat_completion_body(
    completion_id: str, model: str, outputs: list[GenerateOutput], token_text: TokenText, plan: ToolPlan | None
) -> dict[str, Any]:
    choices = []
    for i, o in enumerate(outputs):
        message, finish_reason = chat_message(o, plan)
        message = with_reasoning(message, o)
        logprobs = chat_logprobs(o.logprobs, token_text) if o.logprobs is not None else None
        choices.append({"index": i, "message": message, "finish_reason": finish_reason, "logprobs": logprobs})
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(dict(enumerate(outputs)), len(outputs)),
    }


def chat_message(output: GenerateOutput, plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a final output and its finish reason (``chat_finish_reason``): with tools, the calls
    read from the text."""
    if plan is None:
        return {"role": "assistant", "content": output.text}, openai_finish_reason(output)
    content, calls = plan.parse(output.text)
    finish_reason = chat_finish_reason(output, plan, has_calls=bool(calls))
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    return {"role": "assistant", "content": content, "tool_calls": calls}, finish_reason


def chat_finish_reason(output: GenerateOutput, plan: ToolPlan | None, has_calls: bool) -> str | None:
    """OpenAI's finish reason: ``tool_calls`` where calls ended the output, but ``stop`` for a named function (as
    OpenAI answers)."""
    reason = openai_finish_reason(output)
    if has_calls and reason == "stop" and plan is not None and plan.mode != "named":
        return "tool_calls"
    return reason


def with_reasoning(message: dict[str, Any], output: GenerateOutput) -> dict[str, Any]:
    """``message`` with SGLang's and vLLM's ``reasoning_content`` where the output reports its think block apart
    (null when the model did not think); the content, tool calls and constraint are the answer's alone."""
    if output.reasoning_text is None:
        return message
    return {"role": message["role"], "reasoning_content": output.reasoning_text or None} | message


def text_completion_body(
    completion_id: str, model: str, outputs: list[GenerateOutput], n: int, token_text: TokenText
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "text": o.text,
            "finish_reason": openai_finish_reason(o),
            "logprobs": completion_logprobs(o.logprobs, token_text) if o.logprobs is not None else None,
        }
        for i, o in enumerate(outputs)
    ]
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(dict(enumerate(outputs)), n),
    }


def sglang_finish_reason(reason: FinishReason) -> dict[str, Any]:
    """``reason`` as SGLang writes it: its type and the fields that are set."""
    return {key: value for key, value in msgspec.to_builtins(reason).items() if value is not None}


def generate_result(
    output: GenerateOutput,
    output_ids: list[int],
    text: str,
    logprob_fields: dict[str, Any] | None = None,
    reasoning_text: str | None = None,
) -> dict[str, Any]:
    """SGLang's ``{"text", "output_ids", "meta_info"}``; ``meta_info.finish_reason`` is null until the end, then
    SGLang's shape (``{"type": "stop", "matched": ...}``, ``{"type": "length", "length": n}``, ...).
    ``logprob_fields``: ``meta_info``'s logprob lists (``scheduler.http.logprobs.sglang_logprobs``), if asked for.
    ``reasoning_text``: with ``separate_reasoning``, the think block (``text`` is then the answer), as SGLang's
    ``/separate_reasoning`` names them."""
    reason = output.finish_reason
    reasoning = {} if reasoning_text is None else {"reasoning_text": reasoning_text}
    return {
        "text": text,
        **reasoning,
        "output_ids": output_ids,
        "meta_info": {
            "id": output.rid,
            "finish_reason": None if reason is None else sglang_finish_reason(reason),
            "prompt_tokens": output.usage.prompt_tokens,
            "completion_tokens": output.usage.completion_tokens,
            "cached_tokens": output.usage.cached_tokens,
            "reasoning_tokens": output.usage.reasoning_tokens,
            "accepted_prediction_tokens": output.usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": output.usage.rejected_prediction_tokens,
            "grammar_cache_hit": output.grammar_cache_hit,
            **(logprob_fields or {}),
        },
    }
