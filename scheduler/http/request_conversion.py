"""Translation of HTTP request bodies into scheduler requests: one ``SchedulerCall`` per choice and prompt."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any, cast

import msgspec

from scheduler.http.protocol import (
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


@dataclass(frozen=True)
class SchedulerCall:
    """One scheduler request (one choice of one prompt): the arguments of ``scheduler.client.make_request``."""

    rid: str
    sampling_params: SamplingParams
    text: str | None = None
    messages: list[dict[str, str]] | None = None
    input_ids: list[int] | None = None

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "sampling_params": self.sampling_params,
            "text": self.text,
            "messages": self.messages,
            "input_ids": self.input_ids,
        }


def chat_calls(request: ChatCompletionRequest, request_id: str, max_seq_len: int) -> list[SchedulerCall]:
    """``n`` scheduler requests for a chat completion; without a token limit, the context length bounds it."""
    _refuse_unimplemented(request)
    for i, message in enumerate(request.messages):
        for name, value in (message.model_extra or {}).items():
            if not _is_neutral(value):
                raise ProtocolError(f"messages[{i}].{name} is not supported by this server", param=f"messages.{name}")
    messages = [m.as_template_message() for m in request.messages]
    max_tokens = request.max_completion_tokens or request.max_tokens or max_seq_len
    return [
        SchedulerCall(
            rid=f"{request_id}-{i}", sampling_params=_sampling_params(request, max_tokens, i), messages=messages
        )
        for i in range(request.n)
    ]


def completion_calls(request: CompletionRequest, request_id: str) -> list[SchedulerCall]:
    """``n`` scheduler requests per prompt, in OpenAI's choice order (prompt-major); 16 tokens by default."""
    _refuse_unimplemented(request)
    prompts = _prompt_list(request.prompt)
    if not prompts:
        raise ProtocolError("prompt must not be empty", param="prompt")
    calls = []
    for p, prompt in enumerate(prompts):
        for i in range(request.n):
            params = _sampling_params(request, request.max_tokens or 16, i)
            calls.append(_call(f"{request_id}-{p * request.n + i}", params, prompt))
    return calls


def generate_calls(request: GenerateRequest) -> list[SchedulerCall]:
    """One scheduler request per prompt of a native ``/generate`` body (a batch when ``text`` is a list)."""
    sources = [name for name in ("text", "input_ids") if getattr(request, name) is not None]
    if len(sources) != 1:
        raise ProtocolError(f"give exactly one of text or input_ids (got {', '.join(sources) or 'neither'})")
    prompts = _prompt_list(request.text if request.text is not None else request.input_ids)
    if not prompts:
        raise ProtocolError("the batch of prompts is empty", param=sources[0])
    rids = [request.rid] if isinstance(request.rid, str) else request.rid
    if rids is not None and len(rids) != len(prompts):
        raise ProtocolError(f"rid has {len(rids)} entries for {len(prompts)} prompts", param="rid")
    try:
        params = msgspec.convert(request.sampling_params, SamplingParams)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"sampling_params: {e}", param="sampling_params") from e
    _check_native_params(params)
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
            if value not in (None, False):
                found.append((f"structured_outputs.{source.rstrip('_')}", field, value))
    if len(found) > 1:
        names = [source for source, _, _ in found]
        raise ProtocolError(
            f"at most one constraint per request; got {', '.join(names[:-1])} and {names[-1]}",
            param=found[1][0].split(" ")[0],
            code="multiple_constraints",
        )
    return {field: value for _, field, value in found}


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


def _sampling_params(request: CommonRequest, max_tokens: int, choice_index: int) -> SamplingParams:
    """Choice ``i`` is seeded with ``seed + i``, so that ``n`` seeded choices differ yet are reproducible."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k if request.top_k and request.top_k > 0 else None,
        max_new_tokens=max_tokens,
        stop=stop,
        seed=None if request.seed is None else (request.seed + choice_index) % SEED_MODULUS,
        **requested_constraint(request),
    )
    _check(params)
    return params


def _check_native_params(params: SamplingParams) -> None:
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(params, name)):
            raise ProtocolError(f"sampling_params.{name} must be a finite number", param=name)
    if params.seed is not None and not -(2**63) <= params.seed < SEED_MODULUS:
        raise ProtocolError(f"sampling_params.seed must be in [-2**63, 2**64), got {params.seed}", param="seed")
    _check(params)


def _check(params: SamplingParams) -> None:
    """The scheduler's own checks, run here too so that a bad request is a 400 before it is sent."""
    try:
        params.validate()
        params.grammar_key()
    except ValueError as e:
        raise ProtocolError(str(e)) from e


def _refuse_unimplemented(request: CommonRequest) -> None:
    for name in UNIMPLEMENTED_FIELDS:
        if not _is_neutral(getattr(request, name, None)):
            raise ProtocolError(f"{name} is not supported by this server", param=name, code="unsupported_parameter")


def _is_neutral(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == "none" or value == [] or value == {}
