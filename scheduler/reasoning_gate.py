"""``--reasoning-parser`` applied to requests, in one owner: the think tokens, the wrapper around the grammar backend,
where each output starts (thinking, free to think, answering), its thinking budget, the think gate on requests
without a constraint, and what each request's output holds of reasoning.

A request that may reason gets a ``ReasonerGrammarObject``: around its compiled constraint (the backend this gate
wraps, ``wrap_backend``), or around a ``FreeGrammarObject`` when it has none, so that the think block of every request
is gated alike: the budget forces the think-end token, and the output splits into reasoning and answer at the same
token. The rest of the scheduler asks the gate (``num_reasoning_tokens``, ``split_output``), not the grammar object.
"""

from __future__ import annotations

from typing import Any

from scheduler.request import Req
from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.reasoner import (
    FreeGrammarObject,
    ReasonerGrammarBackend,
    ReasonerGrammarObject,
    reasoning_start,
    think_end_token_id,
    think_start_token_id,
)
from sglang_constrained.backends.reasoning_formats import ReasoningStart, reasoning_format


class ReasoningGate:
    """The server's reasoning parser, resolved against the tokenizer (off without one, or without its think-end
    token)."""

    def __init__(self, grammar_args: GrammarArgs, tokenizer: Any) -> None:
        parser = grammar_args.reasoning_parser
        self.tokenizer = tokenizer
        self.think_end_id = think_end_token_id(tokenizer, parser)
        self.think_start_id = think_start_token_id(tokenizer, parser)
        self.default_start: ReasoningStart = reasoning_format(parser).default_start if parser else "answering"
        self.default_budget = grammar_args.thinking_budget

    @property
    def enabled(self) -> bool:
        return self.think_end_id is not None

    def wrap_backend(self, backend: GrammarPipeline | None) -> GrammarPipeline | None:
        """``backend`` (whichever the registry built) with its grammars gated on the think-end token when reasoning
        is on; as it is otherwise."""
        if backend is None or self.think_end_id is None:
            return backend
        return ReasonerGrammarBackend(backend, self.think_end_id, self.think_start_id)

    def attach(self, req: Req) -> None:
        """Set up ``req``'s gate once its grammar is ready (before its first token): its start phase from its
        prompt, its budget, and a gate of its own if it has no constraint but may reason."""
        if self.think_end_id is None:
            return
        params = req.sampling_params
        grammar = req.ready_grammar
        if grammar is None and params.require_reasoning:
            grammar = req.grammar = ReasonerGrammarObject(
                FreeGrammarObject(), self.think_end_id, think_start_id=self.think_start_id
            )
        if not isinstance(grammar, ReasonerGrammarObject):
            return
        start: ReasoningStart = "answering"
        if params.require_reasoning:
            start = reasoning_start(
                req.prompt_ids, self.think_start_id, self.think_end_id, self.default_start, self.tokenizer
            )
        budget = params.thinking_budget if params.thinking_budget is not None else self.default_budget
        grammar.set_reasoning(start, budget)

    def num_reasoning_tokens(self, req: Req) -> int:
        """``req``'s output tokens of the think block, its tags included (0 for a request this gate does not gate)."""
        gate = _gate_of(req)
        return gate.num_reasoning_tokens if gate is not None else 0

    def split_output(self, req: Req) -> tuple[list[int], list[int]]:
        """``req``'s output as its reasoning tokens (without the think tags) and its answer tokens; all of it is the
        answer for a request that does not separate its reasoning (``separate_reasoning``) or is not gated."""
        gate = _gate_of(req)
        if req.reasoning_text is None or gate is None:
            return [], req.output_ids
        return gate.split_output(req.output_ids)


def _gate_of(req: Req) -> ReasonerGrammarObject | None:
    grammar = req.ready_grammar
    return grammar if isinstance(grammar, ReasonerGrammarObject) else None
