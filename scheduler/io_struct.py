"""Messages that cross the process boundary between clients and the scheduler (msgpack, via msgspec).

Client → scheduler: ``ClientMessage`` (a tagged union of ``GenerateReq``, ``AbortReq``, ``PingReq``,
``FlushCacheReq``). Scheduler → client: ``ServerMessage`` (``GenerateOutput``, ``Pong`` or ``FlushCacheDone``). No
pickle crosses a socket.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec

from sglang_constrained.constraint_spec import CONSTRAINT_KIND_TABLE, GrammarKey, make_grammar_key

CONSTRAINT_FIELDS = tuple(kind.field for kind in CONSTRAINT_KIND_TABLE)
"""The ``SamplingParams`` fields that carry a constraint, one per kind (``CONSTRAINT_KIND_TABLE``)."""
MAX_TOP_LOGPROBS = 20
"""Most alternatives a request may ask for per output token: OpenAI's limit on ``top_logprobs`` (chat), the bound of
``top_logprobs_num`` here and of ``logprobs`` (completions) over HTTP."""


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample, when to stop, and at most one constraint on the output (SGLang's field names and defaults).

    Logits are adjusted in vLLM's order before the grammar mask, which comes last (nothing re-enables a token it
    disallows): ``logit_bias`` (token id as a string → added to its logit), ``repetition_penalty`` (tokens of the
    prompt or output: a positive logit divided by it, a negative one multiplied), ``frequency_penalty`` and
    ``presence_penalty`` (subtracted per occurrence in the output, and once for any), and while fewer than
    ``min_new_tokens`` are out the stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are disallowed,
    unless the grammar allows nothing else. Then temperature, ``min_p``, top-k and top-p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] = msgspec.field(default_factory=dict)
    seed: int | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    choice: list[str] | None = None
    json_object: bool = False
    require_reasoning: bool = False
    """With ``--reasoning-parser``: the model may think first; a constraint applies from the think-end token on
    (False: thinking off, a constraint holds from the first token)."""
    thinking_budget: int | None = None
    """With ``require_reasoning``: the most reasoning tokens before the think-end token is forced (None: the server's
    ``--thinking-budget``)."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1 (or null for no limit)")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.max_new_tokens >= 2**63:
            raise ValueError(f"max_new_tokens must be below 2**63, got {self.max_new_tokens}")
        if self.top_k is not None and self.top_k >= 2**63:
            raise ValueError(f"top_k must be below 2**63, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.thinking_budget is not None and not 0 <= self.thinking_budget < 2**63:
            raise ValueError("thinking_budget must be >= 0")
        self._validate_adjustments()
        constraints = self.constraint_fields()
        if len(constraints) > 1:
            raise ValueError(f"at most one constraint per request, got {', '.join(constraints)}")

    def _validate_adjustments(self) -> None:
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError("min_new_tokens must be in [0, max_new_tokens]")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError("repetition_penalty must be in (0, 2]")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (non-negative integers)")
        for key, value in self.logit_bias.items():
            if not key.isdigit():
                raise ValueError(f"logit_bias keys must be token ids written as decimal strings, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError for a ``stop_token_ids`` or ``logit_bias`` token outside the vocabulary."""
        bad = [t for t in [*self.stop_token_ids, *map(int, self.logit_bias)] if t >= vocab_size]
        if bad:
            raise ValueError(f"token ids in stop_token_ids and logit_bias must be below {vocab_size}; got {bad[:5]}")

    @property
    def has_penalties(self) -> bool:
        """Whether the output so far changes this request's logits (beyond the grammar mask)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0)

    def constraint_fields(self) -> list[str]:
        """The constraint fields this request sets, in the table's order."""
        return [kind.field for kind in CONSTRAINT_KIND_TABLE if kind.is_requested(getattr(self, kind.field))]

    def grammar_key(self) -> GrammarKey | None:
        """The constraint as a grammar cache key, or None for a free request; raises ValueError if malformed."""
        for kind in CONSTRAINT_KIND_TABLE:
            value = getattr(self, kind.field)
            if kind.is_requested(value):
                return make_grammar_key(kind.name, value)
        return None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str


class GenerateReq(msgspec.Struct, tag="generate", kw_only=True, forbid_unknown_fields=True):
    """Generate from exactly one of ``text``, chat ``messages`` or ``input_ids``."""

    rid: str
    text: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = False
    top_logprobs_num: int | None = None
    """None: no logprobs; k >= 0: each output token's logprob and the k most likely tokens' (see ``TokenLogprob``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template of ``messages`` (Qwen3's ``enable_thinking``)."""
    separate_reasoning: bool = False
    """With ``--reasoning-parser``: outputs carry the think block's text in ``reasoning_text`` and the answer alone
    in ``text``."""
    prediction: str | list[int] | None = None
    """OpenAI's predicted output: text (tokenised as the prompt is) or token ids the answer is expected to mostly
    repeat. A latency hint: speculative decoding drafts from it, and the output is the one without it
    (``scheduler.predicted_output``)."""


class AbortReq(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    rid: str


class PingReq(msgspec.Struct, tag="ping", forbid_unknown_fields=True):
    """Readiness probe; answered with a ``Pong`` carrying the same ``ping_id`` once the model is loaded."""

    ping_id: str = ""


class FlushCacheReq(msgspec.Struct, tag="flush_cache", forbid_unknown_fields=True):
    """Drop the prefix cache; answered with a ``FlushCacheDone`` carrying the same ``request_id``."""

    request_id: str = ""


ClientMessage = GenerateReq | AbortReq | PingReq | FlushCacheReq


class TokenLogprob(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An output token's log-probability, and the ``top`` most likely tokens' as ``(token_id, logprob)``.

    The log-softmax of the logits the token was sampled from: logit bias, penalties and the grammar mask applied,
    divided by the temperature (SGLang's definition; greedy rows are not scaled). A token the grammar disallows is
    never among ``top``; a token jump-forward appended (the only one the grammar allowed) has logprob 0.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = msgspec.field(default_factory=list)


class AbortCause(str, enum.Enum):
    """Why the scheduler aborted a request, set where that was decided; the HTTP frontend answers each with its
    status (``scheduler.http.responses.ABORT_STATUS``), whatever the message says."""

    BAD_REQUEST = "bad_request"
    """The request itself: a field, its prompt, a running rid, a constraint the server cannot serve at all."""
    INVALID_CONSTRAINT = "invalid_constraint"
    """Its constraint does not compile (the message says why)."""
    COMPILE_TIMEOUT = "compile_timeout"
    """Its grammar's compile ran past the compile deadline."""
    COMPILE_NOT_STARTED = "compile_not_started"
    """Its compile waited for a free slot until the deadline, behind other compiles: the server is busy."""
    COMPILE_FAILED = "compile_failed"
    """The grammar engine failed on its constraint (a crash, the compile's memory bound)."""
    GRAMMAR_RESET = "grammar_reset"
    """The grammar backend was reset while its grammar compiled."""
    UNSATISFIABLE = "unsatisfiable"
    """Its grammar allows no token: the constraint cannot be completed."""
    GRAMMAR_ENGINE = "grammar_engine"
    """The grammar engine failed mid-generation (a mask fill, a token its mask allowed)."""
    INTERNAL = "internal"
    """Anything else that went wrong in the server."""
    SHUTDOWN = "shutdown"
    """The server is shutting down (or the replica holding it is gone)."""
    CLIENT = "client"
    """The client aborted it."""


class FinishReason(msgspec.Struct, forbid_unknown_fields=True):
    """``stop``: EOS, a stop token or string (``matched``) or the grammar's end; ``length``: the token limit, after
    ``length`` output tokens (as SGLang reports it); ``abort``: error or abort, with its ``cause``."""

    type: Literal["stop", "length", "abort"]
    message: str | None = None
    matched: str | int | None = None
    length: int | None = None
    cause: AbortCause | None = None


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache; ``reasoning_tokens``: output tokens of the
    think block, its tags included (with ``--reasoning-parser``). With a ``prediction``: ``accepted_prediction_tokens``,
    its tokens that appeared in the output (repeated in step with it), and ``rejected_prediction_tokens``, the rest
    (final once the request has finished); both 0 without one."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class GenerateOutput(msgspec.Struct, tag="output", kw_only=True, forbid_unknown_fields=True):
    """A result, or with ``stream`` one chunk of it: ``token_ids`` and ``text`` are what is new in this message."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    usage: Usage
    grammar_cache_hit: bool | None = None
    logprobs: list[TokenLogprob] | None = None
    """With ``top_logprobs_num``: one per token of ``token_ids``."""
    reasoning_text: str | None = None
    """With ``separate_reasoning``: the think block's text without its tags (new text only, streamed); ``text`` is
    then the answer alone. None when the request does not separate it."""


class ReplicaStatus(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One data-parallel replica's load and what it has served since the start (``--dp-size``)."""

    rank: int
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_compiling_requests: int = 0
    num_free_kv_tokens: int = 0
    num_finished_requests: int = 0
    num_output_tokens: int = 0
    num_forwards: int = 0


class Pong(msgspec.Struct, tag="pong", kw_only=True, forbid_unknown_fields=True):
    """The scheduler's identity and current load."""

    model: str
    grammar_backend: str
    vocab_size: int
    ping_id: str = ""
    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_compiling_requests: int = 0
    num_free_kv_tokens: int = 0
    cache_hit_rate: float = 0.0
    # Speculative decoding since the start: forwards per output token, tokens jump-forward appended, and per draft
    # source ("grammar", "follower", "ngram", "ngram_cache", "prediction") the tokens proposed and accepted and the
    # request-forwards it proposed in.
    num_forwards: int = 0
    num_output_tokens: int = 0
    num_forced_tokens: int = 0
    drafts_proposed: dict[str, int] = msgspec.field(default_factory=dict)
    drafts_accepted: dict[str, int] = msgspec.field(default_factory=dict)
    draft_runs: dict[str, int] = msgspec.field(default_factory=dict)
    metrics_text: str = ""
    """The scheduler's own Prometheus metrics (grammar compiles), in the text exposition format."""
    replicas: list[ReplicaStatus] = msgspec.field(default_factory=list)
    """With ``--dp-size``: each replica's status, in rank order (the counts above are their sums)."""


class FlushCacheDone(msgspec.Struct, tag="flush_cache_done", kw_only=True, forbid_unknown_fields=True):
    """``success``: the prefix cache was dropped (refused while requests run, which read it)."""

    request_id: str
    success: bool
    message: str = ""


ServerMessage = GenerateOutput | Pong | FlushCacheDone

_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)
_encoder = msgspec.msgpack.Encoder()


def encode(message: ClientMessage | ServerMessage) -> bytes:
    return _encoder.encode(message)


def decode_client_message(data: bytes) -> ClientMessage:
    """Raises ``msgspec.DecodeError``/``ValidationError`` for malformed messages."""
    return _client_decoder.decode(data)


def decode_server_message(data: bytes) -> ServerMessage:
    return _server_decoder.decode(data)


def read_rid(data: bytes) -> str | None:
    """The ``rid`` of a message that failed to decode, if it can be read at all (for answering with an error)."""
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    rid = raw.get("rid") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) and rid else None


def error_output(rid: str, cause: AbortCause, message: str) -> GenerateOutput:
    """A final output that aborts ``rid`` for ``cause`` with ``message``."""
    return GenerateOutput(
        rid=rid,
        token_ids=[],
        text="",
        finished=True,
        finish_reason=FinishReason(type="abort", message=message, cause=cause),
        usage=Usage(prompt_tokens=0, completion_tokens=0),
    )
