"""Translation of HTTP request bodies into scheduler requests: one ``SchedulerCall`` per choice and prompt.

Everything a request's size allows is checked here before any work is done for it: how many scheduler requests it
becomes, its constraint's size and nesting, and (once the frontend has tokenised the prompt) whether prompt and
output fit the context.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from scheduler.http.protocol import (
    MAX_SCHEDULER_REQUESTS,
    SEED_MODULUS,
    ChatCompletionRequest,
    CommonRequest,
    CompletionRequest,
    GenerateRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ProtocolError,
    StructuralTagFormat,
)
from scheduler.io_struct import SamplingParams

UNIMPLEMENTED_FIELDS = (
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "frequency_penalty",
    "presence_penalty",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "echo",
    "suffix",
    "best_of",
)


_BOOLEAN_SCHEMAS = {
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
    """

    rid: str
    sampling_params: SamplingParams
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None
    fills_context: bool = False

    def with_prompt_ids(self, input_ids: list[int], max_seq_len: int) -> SchedulerCall:
        """This call with its prompt as token ids; raises ``ProtocolError`` if prompt and output cannot both fit."""
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
        return SchedulerCall(self.rid, params, input_ids=input_ids)

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "sampling_params": self.sampling_params,
            "text": self.text,
            "messages": self.messages,
            "input_ids": self.input_ids,
        }


def chat_calls(request: ChatCompletionRequest, request_id: str, limits: RequestLimits) -> list[SchedulerCall]:
    """``n`` scheduler requests for a chat completion; without a token limit, the context length bounds it."""
    _refuse_unimplemented(request)
    for i, message in enumerate(request.messages):
        for name, value in (message.model_extra or {}).items():
            if not _is_neutral(value):
                raise ProtocolError(f"messages[{i}].{name} is not supported by this server", param=f"messages.{name}")
    messages = [m.as_template_message() for m in request.messages]
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = _sampling_params(request, max_tokens or limits.max_seq_len, limits)
    return [
        SchedulerCall(f"{request_id}-{i}", _for_choice(params, i), messages=messages, fills_context=max_tokens is None)
        for i in range(request.n)
    ]


def completion_calls(request: CompletionRequest, request_id: str, limits: RequestLimits) -> list[SchedulerCall]:
    """``n`` scheduler requests per prompt, in OpenAI's choice order (prompt-major); 16 tokens by default."""
    _refuse_unimplemented(request)
    prompts = _prompt_list(request.prompt)
    if not prompts:
        raise ProtocolError("prompt must not be empty", param="prompt")
    _check_num_requests(len(prompts), request.n)
    params = _sampling_params(request, request.max_tokens or 16, limits)
    calls = []
    for p, prompt in enumerate(prompts):
        for i in range(request.n):
            calls.append(_call(f"{request_id}-{p * request.n + i}", _for_choice(params, i), prompt))
    return calls


def generate_calls(request: GenerateRequest, limits: RequestLimits) -> list[SchedulerCall]:
    """One scheduler request per prompt of a native ``/generate`` body (a batch when ``text`` is a list)."""
    sources = [name for name in ("text", "input_ids") if getattr(request, name) is not None]
    if len(sources) != 1:
        raise ProtocolError(f"give exactly one of text or input_ids (got {', '.join(sources) or 'neither'})")
    prompts = _prompt_list(request.text if request.text is not None else request.input_ids)
    if not prompts:
        raise ProtocolError("the batch of prompts is empty", param=sources[0])
    _check_num_requests(len(prompts), 1)
    rids = [request.rid] if isinstance(request.rid, str) else request.rid
    if rids is not None and len(rids) != len(prompts):
        raise ProtocolError(f"rid has {len(rids)} entries for {len(prompts)} prompts", param="rid")
    if isinstance(request.sampling_params.get("json_schema"), bool):
        raise ProtocolError(_BOOLEAN_SCHEMAS[str(request.sampling_params["json_schema"]).lower()], param="json_schema")
    try:
        params = msgspec.convert(request.sampling_params, SamplingParams)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"sampling_params: {e}", param="sampling_params") from e
    params = _check_native_params(params, limits)
    return [
        _call(rids[i] if rids is not None else uuid.uuid4().hex, params, prompt) for i, prompt in enumerate(prompts)
    ]


def _prompt_list(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[str | list[int]]:
    """One prompt (a text or token ids) or a batch of them, as a list of prompts."""
    if prompt is None or prompt == []:
        return []
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(item, int) for item in prompt):
        return [cast(list[int], prompt)]
    return cast(list[str | list[int]], prompt)


def _call(rid: str, params: SamplingParams, prompt: str | list[int]) -> SchedulerCall:
    if isinstance(prompt, str):
        return SchedulerCall(rid, params, text=prompt)
    return SchedulerCall(rid, params, input_ids=prompt)


def requested_constraint(request: CommonRequest) -> dict[str, Any]:
    """The request's constraint as ``{SamplingParams field: value}`` (empty for none); refuses more than one."""
    found: list[tuple[str, str, Any]] = []
    fmt = request.response_format
    if isinstance(fmt, JsonSchemaFormat):
        found.append(("response_format (json_schema)", "json_schema", fmt.json_schema.schema_))
    elif isinstance(fmt, JsonObjectFormat):
        found.append(("response_format (json_object)", "json_object", True))
    elif isinstance(fmt, StructuralTagFormat):
        found.append(("response_format (structural_tag)", "structural_tag", fmt.model_dump()))
    for source, field in _TOP_LEVEL_CONSTRAINTS:
        value = getattr(request, source)
        if value is not None:
            found.append((source, field, value))
    if request.structured_outputs is not None:
        for source, field in _STRUCTURED_OUTPUTS_FIELDS:
            value = getattr(request.structured_outputs, source)
            if value is not None and not (value is False and source == "json_object"):  # json: false is a schema
                found.append((f"structured_outputs.{source.rstrip('_')}", field, value))
    if len(found) > 1:
        names = [source for source, _, _ in found]
        raise ProtocolError(
            f"at most one constraint per request; got {', '.join(names[:-1])} and {names[-1]}",
            param=found[1][0].split(" ")[0],
            code="multiple_constraints",
        )
    # A boolean schema travels as its JSON text: as a value, false would read as "no constraint".
    return {
        field: json.dumps(value) if field == "json_schema" and isinstance(value, bool) else value
        for _, field, value in found
    }


_TOP_LEVEL_CONSTRAINTS = (
    ("regex", "regex"),
    ("ebnf", "ebnf"),
    ("json_schema", "json_schema"),
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "ebnf"),
)
_STRUCTURED_OUTPUTS_FIELDS = (
    ("json_", "json_schema"),
    ("regex", "regex"),
    ("choice", "choice"),
    ("grammar", "ebnf"),
    ("json_object", "json_object"),
    ("structural_tag", "structural_tag"),
)


def _sampling_params(request: CommonRequest, max_tokens: int, limits: RequestLimits) -> SamplingParams:
    """The sampling parameters every choice shares (``_for_choice`` sets each one's seed), checked."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k if request.top_k and request.top_k > 0 else None,
        max_new_tokens=max_tokens,
        stop=stop,
        seed=request.seed,
        **requested_constraint(request),
    )
    return _checked(params, limits)


def _for_choice(params: SamplingParams, choice_index: int) -> SamplingParams:
    """Choice ``i`` is seeded with ``seed + i``, so that ``n`` seeded choices differ yet are reproducible."""
    if params.seed is None:
        return params
    return msgspec.structs.replace(params, seed=(params.seed + choice_index) % SEED_MODULUS)


def _check_native_params(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(params, name)):
            raise ProtocolError(f"sampling_params.{name} must be a finite number", param=name)
    if params.seed is not None and not -(2**63) <= params.seed < SEED_MODULUS:
        raise ProtocolError(f"sampling_params.seed must be in [-2**63, 2**64), got {params.seed}", param="seed")
    return _checked(params, limits)


def _checked(params: SamplingParams, limits: RequestLimits) -> SamplingParams:
    """The scheduler's own checks and the constraint's bounds, run here so that a bad request is a 400 before it is
    sent. A JSON schema or structural tag travels as its canonical text (the cache key's), which carries numbers of
    any size."""
    try:
        params.validate()
        key = params.grammar_key()
    except ValueError as e:
        raise ProtocolError(str(e)) from e
    if key is None:
        return params
    kind, spec = key
    field_name = params.constraint_fields()[0]
    if kind == "json" and spec in _BOOLEAN_SCHEMAS:
        raise ProtocolError(_BOOLEAN_SCHEMAS[spec], param=field_name, code="invalid_constraint")
    num_bytes = len(spec.encode())
    if num_bytes > limits.max_spec_bytes:
        raise ProtocolError(
            f"the {field_name} constraint is {num_bytes:,} bytes, over the limit of {limits.max_spec_bytes:,} bytes "
            "(--grammar-max-spec-bytes)",
            param=field_name,
            code="invalid_constraint",
        )
    if kind in ("json", "structural_tag"):
        return msgspec.structs.replace(params, **{field_name: spec})
    return params


def _check_num_requests(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SCHEDULER_REQUESTS:
        raise ProtocolError(
            f"{num_prompts} prompts x n={n} would be {num_prompts * n} generations; at most "
            f"{MAX_SCHEDULER_REQUESTS} per request are allowed: send fewer prompts or a smaller n",
            param="n" if n > 1 else "prompt",
        )


def _refuse_unimplemented(request: CommonRequest) -> None:
    for name in UNIMPLEMENTED_FIELDS:
        if not _is_neutral(getattr(request, name, None)):
            raise ProtocolError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "none" or value == [] or value == {}
