"""When a request finishes, in one place: its stop tokens (the one definition of that set), stop strings, the token
limit, the context limit and its grammar's end, checked after every token it takes; and its text once it has
finished (a stop token is not part of it)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.io_struct import SamplingParams
from scheduler.reasoning_gate import ReasoningGate
from scheduler.request import Req


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> set[int]:
    """Tokens that end a request: its ``stop_token_ids``, and the model's EOS unless ``ignore_eos``. While fewer than
    ``min_new_tokens`` are out they are disallowed (``SamplingBatchInfo``), unless a grammar forces one."""
    eos = set() if params.ignore_eos else set(eos_token_ids)
    return eos | set(params.stop_token_ids)


class FinishPolicy:
    """Decides, token by token, whether a request has finished, and why (``Req.finish``); ``reasoning`` says which of
    a request's output is its answer (stop strings read the answer alone)."""

    def __init__(self, eos_token_ids: Sequence[int], max_seq_len: int, reasoning: ReasoningGate) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.max_seq_len = max_seq_len
        self.reasoning = reasoning

    def check(self, req: Req, token: int) -> None:
        """After ``req`` took ``token`` (its last output token, accepted by its grammar): follow its text, and finish
        it on a stop token or its grammar's end, a stop string, its token limit or the context limit."""
        assert req.text is not None
        reasoning_ids, content_ids = self.reasoning.split_output(req)
        req.text.update(content_ids, can_stop=len(req.output_ids) >= req.sampling_params.min_new_tokens)
        if req.reasoning_text is not None:
            req.reasoning_text.update(reasoning_ids)
        grammar = req.ready_grammar
        if token in stop_token_ids(req.sampling_params, self.eos_token_ids) or (
            grammar is not None and grammar.is_terminated()
        ):
            req.finish("stop", matched=token)
        elif req.text.matched_stop is not None:
            req.finish("stop", matched=req.text.matched_stop)
        elif len(req.output_ids) >= req.sampling_params.max_new_tokens:
            req.finish("length", length=len(req.output_ids))
        elif len(req.prompt_ids) + len(req.output_ids) >= self.max_seq_len:
            message = f"reached the context limit of {self.max_seq_len} tokens"
            req.finish("length", message=message, length=len(req.output_ids))

    def final_texts(self, req: Req) -> tuple[str, str | None]:
        """A finished request's answer text, without the stop token that ended it, and with ``separate_reasoning``
        its think block's text (else None)."""
        matched = req.finish_reason.matched if req.finish_reason is not None else None
        reasoning_ids, content_ids = self.reasoning.split_output(req)
        ends_with_stop_token = (
            isinstance(matched, int)
            and matched in stop_token_ids(req.sampling_params, self.eos_token_ids)
            and bool(content_ids)
        )
        text = req.text.final_text(content_ids, ends_with_stop_token) if req.text is not None else ""
        reasoning = req.reasoning_text.final_text(reasoning_ids) if req.reasoning_text is not None else None
        return text, reasoning
