"""The scheduler's own record of one request, from admission to its last output."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

from scheduler.ending_plan import EndingPlan
from scheduler.io_struct import AbortCause, FinishReason, SamplingParams, TokenLogprob
from scheduler.model.kv_cache import KVSequence
from scheduler.output_text import OutputText
from scheduler.predicted_output import PredictionAligner
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.constraint_spec import GrammarKey


@dataclass(frozen=True)
class Abort:
    """Why a request must end with an error: the cause (which the client's status follows) and the message it reads."""

    cause: AbortCause
    message: str


CLIENT_ABORT = Abort(AbortCause.CLIENT, "aborted by the client")


@dataclass(eq=False)
class Req:
    """One generation request inside the scheduler (never sent over a socket).

    ``grammar`` is a ``Future`` while its grammar compiles, the grammar object once ready, None for a free
    request. ``kv`` is its KV sequence from admission to its end; ``num_cached_tokens`` of its prompt came cached.
    ``text`` follows the output as text (stop strings, streaming); ``num_sent_tokens`` / ``sent_text`` track what
    a streaming client has already received. With ``top_logprobs_num`` set, ``output_logprobs`` holds one
    ``TokenLogprob`` per output token. ``sampling_seed`` keys its random draws by output position (its own
    seed, or one the server drew for it). With ``--reasoning-parser`` and ``separate_reasoning``, ``reasoning_text``
    follows the think block's text and ``text`` the answer's (``sent_reasoning``: what a streaming client has).
    ``prediction`` follows the output through the request's predicted output, if it has one. ``ending`` is its
    grammar's known ending, where budget-aware constraints steer it (``scheduler.budget_steering``).
    """

    rid: str
    client_id: bytes
    prompt_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    grammar_key: GrammarKey | None = None
    grammar: BaseGrammarObject | Future[BaseGrammarObject] | None = None
    grammar_cache_hit: bool | None = None
    grammar_queued_at: float | None = None
    sampling_seed: int = 0
    output_ids: list[int] = field(default_factory=list)
    top_logprobs_num: int | None = None
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    text: OutputText | None = None
    finish_reason: FinishReason | None = None
    kv: KVSequence | None = None
    num_cached_tokens: int = 0
    num_sent_tokens: int = 0
    sent_text: str = ""
    reasoning_text: OutputText | None = None
    sent_reasoning: str = ""
    prediction: PredictionAligner | None = None
    ending: EndingPlan | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_ids(self) -> list[int]:
        """Output tokens the KV cache does not hold yet: the last sampled one, and any forced after it."""
        num_held = len(self.kv) - len(self.prompt_ids) if self.kv is not None else 0
        return self.output_ids[num_held:]

    @property
    def ready_grammar(self) -> BaseGrammarObject | None:
        """The grammar object, once compiled; None for free requests and while compiling."""
        return self.grammar if isinstance(self.grammar, BaseGrammarObject) else None

    def finish(
        self,
        reason: Literal["stop", "length"],
        message: str | None = None,
        matched: str | int | None = None,
        length: int | None = None,
    ) -> None:
        """Finish ``req`` (the first reason given stands); its grammar is finished with it."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason(type=reason, message=message, matched=matched, length=length)
            self._finish_grammar()

    def abort(self, abort: Abort) -> None:
        if self.finish_reason is None:
            self.finish_reason = FinishReason(type="abort", message=abort.message, cause=abort.cause)
            self._finish_grammar()

    def _finish_grammar(self) -> None:
        grammar = self.ready_grammar
        if grammar is not None:
            grammar.finished = True
