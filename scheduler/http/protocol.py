"""Request bodies of the HTTP API: OpenAI's, with SGLang's and vLLM's constraint fields, and SGLang's ``/generate``.

Unknown fields are refused (pydantic, ``extra="forbid"``) and types are strict as OpenAI's API is (``"8"`` is not an
integer, ``"yes"`` not a boolean); known OpenAI features this server does not implement are declared here and
refused by ``request_conversion`` when set, so that no setting is ever silently ignored.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from scheduler.io_struct import MAX_TOP_LOGPROBS
from sglang_constrained.constraint_spec import MAX_SPEC_DEPTH

MAX_N = 128
MAX_SCHEDULER_REQUESTS = 128
"""Most scheduler requests one HTTP request may become (prompts x ``n``)."""
SEED_MODULUS = 2**64
"""torch seeds are 64-bit: a request's seed (and seed + choice index) is taken modulo this."""
MAX_TOKEN_BOUND = 2**63
"""Token counts (``max_tokens``, ``max_completion_tokens``, ``top_k``) are below this: the scheduler's are int64."""


class ProtocolError(ValueError):
    """A request the server refuses, answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


BodyT = TypeVar("BodyT", bound=Body)


def parse_body(model: type[BodyT], data: bytes) -> BodyT:
    """Parse a JSON body (whatever its content type); raises ``ProtocolError`` naming the first problem, in OpenAI's
    wording where OpenAI has one (wrong type, missing or unknown parameter)."""
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        problems = e.errors(include_url=False)
        first = problems[0]
        if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:
            raise ProtocolError(
                f"the request body nests objects and arrays too deeply to parse ({first['msg']}); a constraint may "
                f"nest at most {MAX_SPEC_DEPTH} levels",
                code="invalid_json",
            ) from e
        if first["type"] == "json_invalid":
            raise ProtocolError(f"the request body is not valid JSON: {first['msg']}", code="invalid_json") from e
        field = _field_path(first["loc"])
        where = ".".join(str(part) for part in field)
        same_field = [p for p in problems if _field_path(p["loc"]) == field]
        message, code = _openai_wording(first, where, same_field, len(field))
        if len(problems) > 1 and code is None:
            message += f" (and {len(problems) - 1} more problems)"
        raise ProtocolError(message, param=where or None, code=code) from e


_UNION_MEMBER = re.compile(r"^(str|int|bool|float|none|list\[.*\]|dict\[.*\]|function-\w+\[.*\])$")
_EXPECTED_TYPES = {
    "int_type": "an integer",
    "bool_type": "a boolean",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
}


def _field_path(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A problem's location up to the member of a union it was checked against (pydantic names members by type)."""
    for index, part in enumerate(loc):
        if _is_union_member(part):
            return loc[:index]
    return loc


def _is_union_member(part: Any) -> bool:
    return isinstance(part, str) and _UNION_MEMBER.match(part) is not None


def _openai_wording(problem: Any, where: str, same_field: list[Any], depth: int) -> tuple[str, str | None]:
    """``(message, code)`` for a pydantic problem, as OpenAI words it where it has a wording. ``same_field``: the
    problems of the same field (one per union member when it takes several types), found ``depth`` parts deep."""
    is_type_mismatch = all(p["type"] in _EXPECTED_TYPES and len(p["loc"]) <= depth + 1 for p in same_field)
    if is_type_mismatch:
        expected = " or ".join(dict.fromkeys(_EXPECTED_TYPES[p["type"]] for p in same_field))
        got = json_type_name(problem["input"])
        what = f"'{where}'" if where else "the request body"
        return f"Invalid type for {what}: expected {expected}, but got {got} instead.", "invalid_type"
    inside = [p for p in same_field if len(p["loc"]) > depth + 1]
    if inside:  # the value has the type of a member of the field's union: its problem is within the value
        problem = min(inside, key=_problem_rank)
        where = ".".join(str(part) for part in problem["loc"] if not _is_union_member(part))
    kind = problem["type"]
    if kind == "missing":
        return f"Missing required parameter: '{where}'.", "missing_required_parameter"
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {where}", "unknown_parameter"
    return f"{where or 'body'}: {problem['msg']}", None


_RANKED_KINDS = ("literal_error", *_EXPECTED_TYPES, "missing")
"""Which of a value's problems its message names: the wrong tag of a tagged part first (a part of another kind
then also lacks fields and has unknown ones), then a wrong type, then a missing field; pydantic's own order of
them differs between its releases (2.13 reports an unknown field of the part before its tag)."""


def _problem_rank(problem: Any) -> int:
    kind = problem["type"]
    return _RANKED_KINDS.index(kind) if kind in _RANKED_KINDS else len(_RANKED_KINDS)


def json_type_name(value: Any) -> str:
    """The JSON name of a parsed value's type, with its article (``"a string"``)."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "an integer" if isinstance(value, int) else "a number"
    names: dict[type, str] = {str: "a string", list: "an array", dict: "an object"}
    return names.get(type(value), "null" if value is None else type(value).__name__)


class JsonSchemaSpec(Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class TextFormat(Body):
    type: Literal["text"]


class JsonObjectFormat(Body):
    type: Literal["json_object"]


class JsonSchemaFormat(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


class StructuralTagFormat(BaseModel):
    """xgrammar's ``{"type": "structural_tag", "format": ...}`` or the legacy ``structures``/``triggers`` form."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["structural_tag"]


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat | StructuralTagFormat, Field(discriminator="type")
]


class StructuredOutputs(Body):
    """vLLM's ``structured_outputs`` (``grammar`` is EBNF; a per-request ``whitespace_pattern`` is refused)."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    whitespace_pattern: str | None = None


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class TextPart(Body):
    type: Literal["text"]
    text: str


class PredictionContent(Body):
    """OpenAI's predicted output: text the answer is expected to mostly repeat (a latency hint)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class CommonRequest(Body):
    """Fields shared by chat and text completions: OpenAI's, vLLM's and SGLang's sampling extras, and every way to ask
    for a constraint."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, lt=MAX_TOKEN_BOUND)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=MAX_TOKEN_BOUND, description="SGLang/vLLM; -1 or 0 means no limit")
    seed: int | None = Field(None, ge=-(2**63), lt=SEED_MODULUS)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prediction: PredictionContent | None = None
    # OpenAI's bookkeeping (``openai_fields.BOOKKEEPING_FIELDS``): accepted, and cannot change the answer
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | bool | str | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    # SGLang's; its router sends false (``openai_fields.REFUSED_FIELDS``)
    return_hidden_states: bool | None = None


class FunctionCall(Body):
    name: str
    arguments: str


class ToolCall(Body):
    """A call an assistant message made (echoed back by a client in a later turn)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message; fields beyond these are accepted only when empty (as clients echo them)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template: ``developer`` is the newer name of ``system``. (An
        assistant's ``tool_calls`` are written into its content by ``scheduler.http.tool_calls``.)"""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class FunctionDefinition(Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(CommonRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=MAX_TOKEN_BOUND)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    # refused unless neutral (``openai_fields.REFUSED_FIELDS``)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    # reasoning models (``--reasoning-parser``; ``scheduler.http.reasoning_fields``)
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    """vLLM's: documents for a chat template that renders them (retrieval-augmented generation)."""
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    """SGLang's: stream the think block as it is generated; false sends it in one delta once it has closed."""
    continue_final_message: bool = False
    """SGLang's: a final assistant message is continued (its text follows the generation prompt) instead of being
    answered."""
    thinking_token_budget: int | None = Field(None, ge=0)
    custom_params: dict[str, Any] | None = None


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class GenerateRequest(Body):
    """SGLang's native ``/generate``: ``sampling_params`` are the scheduler's own ``SamplingParams`` fields, plus
    SGLang's ``n``, ``sampling_seed`` and ``custom_params`` (``request_conversion``). ``logprob_start_len`` -1 asks
    for output logprobs only (prompt logprobs are refused). ``prediction``: a predicted output (text or token ids) for
    every prompt and choice, as OpenAI's ``prediction`` on the completions endpoints."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    separate_reasoning: bool = False
    prediction: str | list[int] | None = None
    # SGLang's, which its router sends with their defaults (``generate_conversion.GENERATE_REFUSED_FIELDS`` and
    # ``GENERATE_BOOKKEEPING_FIELDS``)
    model: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    background: bool = False
    return_bytes: bool = False
    return_entropy: bool = False

    @property
    def is_batch(self) -> bool:
        """A list of texts or of token-id lists: answered with a list of results."""
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))


class TokenizeRequest(Body):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` through the chat template (with ``tools``,
    ``documents`` and ``chat_template_kwargs`` as a chat completion gives them to it)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
