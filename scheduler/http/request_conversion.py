"""Translation of HTTP request bodies into scheduler requests: one ``SchedulerCall`` per choice and prompt.

Everything a request's size allows is checked here before any work is done for it: how many scheduler requests it
becomes, its constraint's size and nesting, and (once the frontend has tokenised the prompt) whether prompt and
output fit the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import msgspec

from scheduler.http.constraint_fields import requested_constraint
from scheduler.http.openai_fields import is_neutral, refuse_unimplemented
from scheduler.http.protocol import (
    MAX_SCHEDULER_REQUESTS,
    SEED_MODULUS,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    ProtocolError,
)
from scheduler.http.reasoning_fields import enables_thinking, thinking_budget
from scheduler.http.tool_calls import (
    DEFAULT_TOOL_FORMAT,
    ToolFormat,
    ToolPlan,
    offered_tools,
    template_messages,
    tool_schemas,
    with_tools_offered,
)
from scheduler.io_struct import SamplingParams
from sglang_constrained.constraint_spec import GrammarSpecError, SpecForm, constraint_kind

BOOLEAN_SCHEMAS = {
    "true": "the JSON schema `true` (any JSON value) is not supported: send {} for any JSON value, or "
    'response_format {"type": "json_object"} for any JSON object',
    "false": "the JSON schema `false` allows no value at all, so nothing could ever be generated",
}


@dataclass(frozen=True)
class RequestLimits:
    """The bounds on one HTTP request's work (``--max-seq-len``, ``--grammar-max-spec-bytes``)."""

    max_seq_len: int
    max_spec_bytes: int


@dataclass(frozen=True)
class SchedulerCall:
    """One scheduler request (one choice of one prompt): the arguments of ``scheduler.client.make_request``.

    ``fills_context``: no token limit was asked for, so the output may take whatever room the prompt leaves.
    ``top_logprobs_num``: None for no logprobs, else the alternatives wanted per output token.
    ``chat_template_kwargs``: variables for the chat template of ``messages``; ``tools``: the tools it renders (when
    it renders tools, ``scheduler.http.tool_calls``); ``documents``: the documents it renders;
    ``continue_final_message``: a final assistant message is continued (``PromptEncoder.encode``);
    ``separate_reasoning``: report the think block apart (``--reasoning-parser``); ``prediction``: a predicted
    output, text until the frontend tokenises it (``FrontendState.tokenized``).
    """

    rid: str
    sampling_params: SamplingParams
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    input_ids: list[int] | None = None
    fills_context: bool = False
    top_logprobs_num: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = False
    prediction: str | list[int] | None = None

    def with_prompt_ids(
        self, input_ids: list[int], max_seq_len: int, prediction_ids: list[int] | None = None
    ) -> SchedulerCall:
        """This call with its prompt (and its prediction, if any) as token ids; raises ``ProtocolError`` if prompt
        and output cannot both fit."""
        room = max_seq_len - len(input_ids)
        max_new_tokens = room if self.fills_context else self.sampling_params.max_new_tokens
        if room < 1 or max_new_tokens > room:
            asked = "no room for output" if self.fills_context else f"{max_new_tokens} in the completion"
            raise ProtocolError(
                f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                f"{len(input_ids) + max(max_new_tokens, 1)} tokens ({len(input_ids)} in the prompt, {asked}). "
                "Please reduce the length of the prompt or of the completion (max_tokens).",
                param="max_tokens" if room >= 1 else None,
                code="context_length_exceeded",
            )
        params = msgspec.structs.replace(self.sampling_params, max_new_tokens=max_new_tokens)
        if params.min_new_tokens > max_new_tokens:
            raise ProtocolError(
                f"min_tokens ({params.min_new_tokens}) is more than the {max_new_tokens} tokens the output may take",
                param="min_tokens",
            )
        return SchedulerCall(
            self.rid,
            params,
            input_ids=input_ids,
            top_logprobs_num=self.top_logprobs_num,
            separate_reasoning=self.separate_reasoning,
            prediction=self.prediction if prediction_ids is None else prediction_ids,
        )

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "sampling_params": self.sampling_params,
            "text": self.text,
            "messages": self.messages,
            "input_ids": self.input_ids,
            "top_logprobs_num": self.top_logprobs_num,
            "chat_template_kwargs": self.chat_template_kwargs,
            "separate_reasoning": self.separate_reasoning,
            "prediction": self.prediction,
        }


def chat_calls(
    request: ChatCompletionRequest,
    request_id: str,
    limits: RequestLimits,
    plan: ToolPlan | None = None,
    tool_format: ToolFormat = DEFAULT_TOOL_FORMAT,
) -> list[SchedulerCall]:
    """``n`` scheduler requests for a chat completion; without a token limit, the context length bounds it. ``plan``:
    the request's use of its tools (``scheduler.http.tool_calls.tool_plan``); ``tool_format``: the server's."""
    refuse_unimplemented(request)
    for i, message in enumerate(request.messages):
        for name, value in (message.model_extra or {}).items():
            if not is_neutral(value):
                raise ProtocolError(f"messages[{i}].{name} is not supported by this server", param=f"messages.{name}")
        if message.tool_calls and message.role != "assistant":
            raise ProtocolError(
                f"messages[{i}].tool_calls is not supported on a {message.role} message: only assistant messages "
                "carry tool calls",
                param="messages.tool_calls",
            )
        if message.role == "tool" and not message.tool_call_id:
            raise ProtocolError(
                f"messages[{i}].tool_call_id is required on a tool message: it names the call whose result it is",
                param="messages.tool_call_id",
            )
    messages, tools = chat_template_input(request, plan, tool_format)
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = msgspec.structs.replace(
        _sampling_params(request, max_tokens or limits.max_seq_len, limits, plan, tool_format),
        require_reasoning=enables_thinking(request.chat_template_kwargs),
        thinking_budget=thinking_budget(request.thinking_token_budget, request.custom_params),
    )
    if request.top_logprobs is not None and not request.logprobs:
        raise ProtocolError("top_logprobs needs logprobs set to true", param="top_logprobs")
    top_logprobs_num = (request.top_logprobs or 0) if request.logprobs else None
    return [
        SchedulerCall(
            f"{request_id}-{i}",
            for_choice(params, i),
            messages=messages,
            fills_context=max_tokens is None,
            top_logprobs_num=top_logprobs_num,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=tools,
            documents=request.documents,
            continue_final_message=request.continue_final_message,
            separate_reasoning=request.separate_reasoning,
            prediction=request.prediction.text if request.prediction is not None else None,
        )
        for i in range(request.n)
    ]


def chat_template_input(
    request: ChatCompletionRequest, plan: ToolPlan | None, tool_format: ToolFormat
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a chat request gives the chat template: the tools to a template that renders them,
    else offered in the system message (``scheduler.http.tool_calls``)."""
    renders_tools = tool_format.template_renders_tools
    messages = template_messages(request.messages, tool_format.syntax, renders_tools, tool_schemas(request))
    tools = offered_tools(request) if plan is not None and renders_tools else None
    if plan is not None and not renders_tools:
        messages = with_tools_offered(messages, plan)
    return messages, tools


def completion_calls(request: CompletionRequest, request_id: str, limits: RequestLimits) -> list[SchedulerCall]:
    """``n`` scheduler requests per prompt, in OpenAI's choice order (prompt-major); 16 tokens by default."""
    refuse_unimplemented(request)
    prompts = prompt_list(request.prompt)
    if not prompts:
        raise ProtocolError("prompt must not be empty", param="prompt")
    check_num_requests(len(prompts), request.n)
    params = _sampling_params(request, request.max_tokens or 16, limits)
    prediction = request.prediction.text if request.prediction is not None else None
    calls = []
    for p, prompt in enumerate(prompts):
        for i in range(request.n):
            rid = f"{request_id}-{p * request.n + i}"
            calls.append(prompt_call(rid, for_choice(params, i), prompt, request.logprobs, prediction))
    return calls


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[str | list[int]]:
    """One prompt (a text or token ids) or a batch of them, as a list of prompts."""
    if prompt is None or prompt == []:
        return []
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(item, int) for item in prompt):
        return [cast(list[int], prompt)]
    return cast(list[str | list[int]], prompt)


def prompt_call(
    rid: str,
    params: SamplingParams,
    prompt: str | list[int],
    top_logprobs_num: int | None,
    prediction: str | list[int] | None = None,
) -> SchedulerCall:
    if isinstance(prompt, str):
        return SchedulerCall(rid, params, text=prompt, top_logprobs_num=top_logprobs_num, prediction=prediction)
    return SchedulerCall(rid, params, input_ids=prompt, top_logprobs_num=top_logprobs_num, prediction=prediction)


def _sampling_params(
    request: CommonRequest,
    max_tokens: int,
    limits: RequestLimits,
    plan: ToolPlan | None = None,
    tool_format: ToolFormat = DEFAULT_TOOL_FORMAT,
) -> SamplingParams:
    """The sampling parameters every choice shares (``for_choice`` sets each one's seed), checked; a tool plan's
    constraint is the request's (its answer format, if any, is in the plan); a syntax of special tokens
    (``tool_format``) has outputs with tools decoded with them."""
    if request.min_tokens is not None and request.min_tokens > max_tokens:
        message = f"min_tokens ({request.min_tokens}) is more than max_tokens ({max_tokens})"
        raise ProtocolError(message, param="min_tokens")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    given: dict[str, Any] = {
        name: value
        for name, value in (
            ("temperature", request.temperature),
            ("top_p", request.top_p),
            ("min_p", request.min_p),
            ("min_new_tokens", request.min_tokens),
            ("frequency_penalty", request.frequency_penalty),
            ("presence_penalty", request.presence_penalty),
            ("repetition_penalty", request.repetition_penalty),
            ("ignore_eos", request.ignore_eos),
            ("stop_token_ids", request.stop_token_ids),
            ("logit_bias", request.logit_bias),
            ("skip_special_tokens", _special_tokens_field(request.skip_special_tokens, plan, tool_format)),
            (
                "spaces_between_special_tokens",
                _special_tokens_field(request.spaces_between_special_tokens, plan, tool_format),
            ),
            ("no_stop_trim", request.include_stop_str_in_output or request.no_stop_trim),
        )
        if value is not None
    }
    constraint = requested_constraint(request)  # checked even where a tool plan's constraint replaces it
    if plan is not None:
        constraint = plan.constraint()
    params = SamplingParams(
        top_k=request.top_k if request.top_k and request.top_k > 0 else None,
        max_new_tokens=max_tokens,
        stop=stop,
        seed=request.seed,
        **given,
        **constraint,
    )
    return checked_params(params, limits)


def _special_tokens_field(value: bool | None, plan: ToolPlan | None, tool_format: ToolFormat) -> bool | None:
    """``skip_special_tokens`` or ``spaces_between_special_tokens`` as the request sets it; else, with tools in a
    syntax of special tokens, false: the calls are read from those tokens' text, as the syntax writes it."""
    if value is None and plan is not None and tool_format.writes_special_tokens:
        return False
    return value


def for_choice(params: SamplingParams, choice_index: int) -> SamplingParams:
    """Choice ``i`` is seeded with ``seed + i``, so that ``n`` seeded choices differ yet are reproducible."""
    if params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + choice_index) % SEED_MODULUS)


def checked_params(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """The scheduler's own checks and the constraint's bounds (its kind's spec-size rule, the one the backends
    enforce), run here so that a bad request is a 400 before it is sent. A JSON spec (a schema, a structural tag)
    travels as its canonical text (the cache key's), which carries numbers of any size."""
    try:
        params.validate()
        key = params.grammar_key()
    except ValueError as e:
        raise ProtocolError(str(e)) from e
    if key is None:
        return params
    kind, spec = constraint_kind(key[0]), key[1]
    if kind.form is SpecForm.JSON_SCHEMA and spec in BOOLEAN_SCHEMAS:
        raise ProtocolError(BOOLEAN_SCHEMAS[spec], param=kind.field, code="invalid_constraint")
    try:
        kind.check_size(spec, limits.max_spec_bytes)
    except GrammarSpecError as e:
        raise ProtocolError(str(e), param=kind.field, code="invalid_constraint") from e
    if kind.form.is_json:
        return msgspec.structs.replace(params, **{kind.field: spec})
    return params


def check_num_requests(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SCHEDULER_REQUESTS:
        raise ProtocolError(
            f"{num_prompts} prompts x n={n} would be {num_prompts * n} generations; at most "
            f"{MAX_SCHEDULER_REQUESTS} per request are allowed: send fewer prompts or a smaller n",
            param="n" if n > 1 else "prompt",
        )
