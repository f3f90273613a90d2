"""Messages that cross the process boundary between clients and the scheduler (msgpack, via msgspec).

Client → scheduler: ``ClientMessage`` (a tagged union of ``GenerateReq``, ``AbortReq``, ``PingReq``).
Scheduler → client: ``ServerMessage`` (``GenerateOutput`` or ``Pong``). No pickle crosses a socket.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from sglang_constrained.constraint_spec import GrammarKey, make_grammar_key

CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag", "choice", "json_object")
_CONSTRAINT_KIND = {"json_schema": "json", "regex": "regex", "ebnf": "ebnf", "structural_tag": "structural_tag"}


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How to sample, when to stop, and at most one constraint on the output."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = msgspec.field(default_factory=list)
    seed: int | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    choice: list[str] | None = None
    json_object: bool = False
    require_reasoning: bool = False

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
        if self.max_new_tokens >= 2**63 or (self.top_k is not None and self.top_k >= 2**63):
            raise ValueError("max_new_tokens and top_k must be below 2**63")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        constraints = self.constraint_fields()
        if len(constraints) > 1:
            raise ValueError(f"at most one constraint per request, got {', '.join(constraints)}")

    def constraint_fields(self) -> list[str]:
        return [name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False)]

    def grammar_key(self) -> GrammarKey | None:
        """The constraint as a grammar cache key, or None for a free request; raises ValueError if malformed."""
        constraints = self.constraint_fields()
        if not constraints:
            return None
        field = constraints[0]
        if field == "json_object":
            return make_grammar_key("json_object", None)
        if field == "choice":
            return make_grammar_key("choice", self.choice)
        return make_grammar_key(_CONSTRAINT_KIND[field], getattr(self, field))


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


class AbortReq(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    rid: str


class PingReq(msgspec.Struct, tag="ping", forbid_unknown_fields=True):
    """Readiness probe; answered with a ``Pong`` carrying the same ``ping_id`` once the model is loaded."""

    ping_id: str = ""


ClientMessage = GenerateReq | AbortReq | PingReq


class FinishReason(msgspec.Struct, forbid_unknown_fields=True):
    """``stop``: EOS, a stop string or the grammar's end; ``length``: token limit; ``abort``: error or abort."""

    type: Literal["stop", "length", "abort"]
    message: str | None = None
    matched: str | int | None = None


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class GenerateOutput(msgspec.Struct, tag="output", kw_only=True, forbid_unknown_fields=True):
    """A result, or with ``stream`` one chunk of it: ``token_ids`` and ``text`` are what is new in this message."""

    rid: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    usage: Usage
    grammar_cache_hit: bool | None = None


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
    # source ("grammar", "follower", "ngram", "ngram_cache") the tokens proposed and accepted and the request-forwards
    # it proposed in.
    num_forwards: int = 0
    num_output_tokens: int = 0
    num_forced_tokens: int = 0
    drafts_proposed: dict[str, int] = msgspec.field(default_factory=dict)
    drafts_accepted: dict[str, int] = msgspec.field(default_factory=dict)
    draft_runs: dict[str, int] = msgspec.field(default_factory=dict)
    metrics_text: str = ""
    """The scheduler's own Prometheus metrics (grammar compiles), in the text exposition format."""


ServerMessage = GenerateOutput | Pong

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


def error_output(rid: str, message: str, prompt_tokens: int = 0) -> GenerateOutput:
    """A final output that aborts ``rid`` with ``message``."""
    return GenerateOutput(
        rid=rid,
        token_ids=[],
        text="",
        finished=True,
        finish_reason=FinishReason(type="abort", message=message),
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0),
    )
