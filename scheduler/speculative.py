"""Speculative decoding's proposals: exact jump-forward over forced tokens, and draft tokens to verify.

Two things make a constrained answer cheaper than one forward per token:

- **Forced tokens** (jump-forward): where the grammar's mask allows exactly one token, plain decoding could only
  sample that token, so it is appended at once, with no forward of its own (it rides along with the next one). The
  output is what plain decoding gives, for every backend; the reasoner wrapper allows every token while thinking, so
  nothing is forced across the think-end boundary.
- **Drafts**: up to k guesses of the tokens after the pending ones, verified by one forward that returns logits after
  each (one mask row per position). Sources: the grammar's forced continuation (xgrammar's jump-forward string,
  llguidance's fast-forward tokens and bytes), tokenised without its last token (the text may end inside a token the
  model would merge with what follows, as llguidance's token healing avoids), and prompt lookup (the longest suffix of
  prompt + output, 1 to ``NGRAM_MAX`` tokens, that occurred before: the tokens that followed it), or the n-gram cache of
  earlier outputs where it matches a longer suffix or prompt lookup finds nothing the grammar accepts
  (``scheduler.ngram_cache``, source "ngram_cache": an answer's first ``{`` then ``\\n  "``, which no prompt holds). The
  sources alternate (forced text, then lookup from there, then forced text again: a lookup may settle the whitespace the
  grammar leaves open, after which the next key is forced); after forced text comes the token the output put after the
  previous forced text (source "follower": ``"name"`` is drafted as ``name``, without its closing quote, and the model
  writes ``":``, as it will after the next key). Drafts are cut where the grammar stops accepting them, so the model
  never sees one the grammar rejects. A request with a predicted output (OpenAI's ``prediction``) drafts from it
  first (source "prediction", ``scheduler.predicted_output``): the prediction's next tokens while the output and the
  drafts before are in step with it, whatever ``--speculative-algorithm`` names (except ``none``, which verifies no
  drafts), up to ``--speculative-num-prediction-tokens`` per forward, in batches of any size; the other sources take
  over (up to ``--speculative-num-draft-tokens``) where it is used up or the output has departed from it. Its drafts
  stand far more often than lookups', so it may draft more (``scripts/bench_predicted_outputs.py``; figures in
  docs/benchmarks.md).

k adapts: each request's prompt-lookup length doubles after a fully accepted run and halves after a rejected first
draft (pausing at 0, then probing again), its prediction length likewise (from the most, never below 1). The n-gram
cache drafts only what earlier outputs agreed on (greedy serving-workload answers: 0.6 of its drafts stood, 0.2-0.5 of
prompt lookup's), so a request's failed lookups do not pause it (JSON: forwards/token 0.513 -> 0.481 for as many
draft rows). A batch's drafts share a token budget that shrinks as the batch grows (a full batch is already
compute-bound: drafts would slow it). Lookup drafts (prompt lookup and the cache) stop at the runner's
``lookup_max_batch`` requests; below it, the rows that fill the model runner's row multiple (``free_rows``) always take
lookup drafts, paused or not, since they cost no more weight reads. On block weights a row costs compute, most of all
the first row of another tile of the matmuls (Q4_1 on AMD EPYC Zen 3, two runs: an extend of 4 rows 1.29-1.65x a
decode step, of 5 1.69-2.07x): there lookup drafts only fill the rows up to the runner's ``lookup_row_tile``
multiple, while the grammar's and the prediction's, which mostly stand, may go past it. Side by side at C=1, greedy,
against lookups up to the draft limit: free text 1.11-1.15x the output tokens/s, JSON 1.00-1.05x, regex 1.01-1.07x
(docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy

from scheduler.grammar_steps import Lookahead
from scheduler.model.runner_contract import LOOKUP_MAX_BATCH, TOKENS_PER_FORWARD
from scheduler.ngram_cache import NgramCache
from scheduler.request import Req
from sglang_constrained.backends.base import BaseGrammarObject
from triton_ops.bitmask_format import allocate_bitmask, only_allowed_token

NGRAM_MAX = 4
"""Longest output suffix searched for in the prompt and output."""
NGRAM_MIN_CONTEXT = 8
"""Below this many context tokens a lookup finds nothing worth a draft."""
PROBE_INTERVAL = 8
"""Steps a request whose prompt-lookup drafts kept failing waits before it tries one again."""


@dataclass
class DraftState:
    """A request's adaptive prompt-lookup and prediction lengths (``prediction_k`` None: the most), the token its output
    put after its last forced text, and how many of its output positions the n-gram cache has taken.

    ``grammar_follower`` exists because forced text is drafted less its last token (``"name"`` as ``name``), which
    the model merges with what follows (``":``): the next forced text likely ends the same way."""

    ngram_k: int = 4
    paused_steps: int = 0
    prediction_k: int | None = None
    grammar_follower: int | None = None
    num_cached_positions: int = 0


@dataclass(frozen=True)
class Drafts:
    """One request's drafts for one forward; ``sources[i]`` names where ``token_ids[i]`` came from."""

    token_ids: list[int]
    sources: list[str]


NO_DRAFTS = Drafts([], [])


def resolve_algorithm(choice: str, model_runner: str) -> str:
    """The draft sources in use: ``--speculative-algorithm`` as chosen, or for ``auto`` the model runner's: both
    (grammar+ngram) on the exact runner, none on llama.cpp's, whose k-token forward costs nearly k one-token forwards
    on this CPU (so verifying drafts loses time there)."""
    if choice != "auto":
        return choice
    return "none" if model_runner == "llamacpp" else "grammar+ngram"


class DraftProposer:
    """Finds forced tokens and proposes drafts for the requests of a decode batch."""

    def __init__(
        self,
        algorithm: str,
        max_draft_tokens: int,
        tokenizer: Any,
        vocab_size: int,
        row_multiple: int = 1,
        ngram_cache: NgramCache | None = None,
        tokens_per_forward: int = TOKENS_PER_FORWARD,
        max_prediction_tokens: int = 0,
        lookup_max_batch: int = LOOKUP_MAX_BATCH,
        lookup_row_tile: int | None = None,
    ) -> None:
        """``algorithm``: one of ``scheduler.server_args.SPECULATIVE_ALGORITHMS`` but auto (``resolve_algorithm``);
        ``row_multiple``: the model runner's (rows up to a multiple of it cost no more weight reads); ``ngram_cache``:
        outputs' n-grams shared by every request (used where ``algorithm`` looks up n-grams; None: none);
        ``tokens_per_forward``: the model runner's (most tokens a decode forward takes: pending and drafts over the
        batch; drafts fill what the batch leaves); ``max_prediction_tokens``: the most drafts per forward of a request
        with a prediction, where they come from it (the other sources keep to ``max_draft_tokens``);
        ``lookup_max_batch``: the model runner's (from this many requests on, no lookup drafts); ``lookup_row_tile``:
        the model runner's (lookup drafts fill a forward's rows up to a multiple of it; None: no such limit)."""
        self.row_multiple = row_multiple
        self.tokens_per_forward = tokens_per_forward
        self.lookup_max_batch = lookup_max_batch
        self.lookup_row_tile = lookup_row_tile
        self.use_grammar = algorithm in ("grammar", "grammar+ngram")
        self.use_ngram = algorithm in ("ngram", "grammar+ngram")
        self.enabled = algorithm != "none" and max_draft_tokens > 0
        self.ngram_cache = ngram_cache if self.use_ngram and self.enabled else None
        self.max_draft_tokens = max_draft_tokens
        self.max_prediction_tokens = max_prediction_tokens
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._scratch = allocate_bitmask(1, vocab_size, "cpu")
        self.states: dict[str, DraftState] = {}

    def forced_token(self, grammar: BaseGrammarObject) -> int | None:
        """The one token ``grammar`` allows next, or None when it allows several (or none)."""
        grammar.fill_vocab_mask(self._scratch, 0)
        return only_allowed_token(self._scratch[0], self.vocab_size)

    def propose(self, batch: list[Req], pending: list[list[int]], room: list[int]) -> list[Drafts]:
        """Drafts per request: at most ``room[i]`` tokens each, within the batch's token budget."""
        if not self.enabled:
            return [NO_DRAFTS] * len(batch)
        num_pending = sum(len(tokens) for tokens in pending)
        free_rows = -num_pending % self.row_multiple
        budget = max(self.tokens_per_forward - num_pending, free_rows)
        use_ngram = self.use_ngram and len(batch) < self.lookup_max_batch
        rows = num_pending  # the forward's rows so far: the pending tokens, then each request's drafts in turn
        proposals = []
        for req, tokens, limit in zip(batch, pending, room, strict=True):
            most = max(self.max_draft_tokens, self.max_prediction_tokens if req.prediction else 0)
            limit = min(limit, most, max(budget, 0))
            ngram_floor = min(free_rows, limit)
            drafts = self._propose_one(req, tokens, limit, use_ngram, ngram_floor, rows) if limit > 0 else NO_DRAFTS
            rows += len(drafts.token_ids)
            budget -= len(drafts.token_ids)
            free_rows = max(free_rows - len(drafts.token_ids), 0)
            proposals.append(drafts)
        return proposals

    def record(self, req: Req, drafts: Drafts, num_accepted: int) -> None:
        """Adapt ``req``'s lookup length to how many of its drafts stood (``req`` has taken its tokens), and give
        the n-gram cache the output positions whose continuation is now complete."""
        state = self.states.setdefault(req.rid, DraftState())
        if num_accepted and drafts.sources[num_accepted - 1] == "grammar" and len(req.output_ids) > num_accepted:
            state.grammar_follower = req.output_ids[-1]
        if self.ngram_cache is not None:
            _cache_output(self.ngram_cache, req, state, len(req.output_ids) - self.ngram_cache.max_continuation)
        predicted = [i for i, source in enumerate(drafts.sources) if source == "prediction"]
        if predicted:
            prediction_k = state.prediction_k or self.max_prediction_tokens
            if num_accepted > predicted[-1]:
                state.prediction_k = min(self.max_prediction_tokens, prediction_k * 2)
            elif num_accepted <= predicted[0]:
                state.prediction_k = max(1, prediction_k // 2)
        ngram_drafts = [i for i, source in enumerate(drafts.sources) if source == "ngram"]
        if not ngram_drafts:
            return
        if num_accepted > ngram_drafts[-1]:
            state.ngram_k = min(self.max_draft_tokens, state.ngram_k * 2)
        elif num_accepted <= ngram_drafts[0]:
            state.ngram_k //= 2
            if state.ngram_k == 0:
                state.paused_steps = PROBE_INTERVAL

    def forget(self, req: Req) -> DraftState | None:
        """``req`` is done: the n-gram cache takes the rest of its output."""
        state = self.states.pop(req.rid, None)
        if state is not None and self.ngram_cache is not None:
            _cache_output(self.ngram_cache, req, state, len(req.output_ids))
        return state

    def _propose_one(
        self, req: Req, pending: list[int], limit: int, use_ngram: bool, ngram_floor: int, rows: int
    ) -> Drafts:
        """Alternate the sources until none adds a token: the request's prediction where the drafts so far are in
        step with it, the grammar's forced continuation, then prompt lookup from there (which may settle what the
        grammar left open, such as whitespace), then the prediction and the grammar's again. The
        grammar follows the drafts as they grow (and is rolled back after), so each source sees the state the
        drafts lead to and every draft is one the grammar accepts. ``ngram_floor``: prompt-lookup drafts allowed even
        while the request's adaptive length is paused; ``rows``: the forward's rows before this request's drafts."""
        grammar = req.ready_grammar
        if grammar is not None and grammar.is_terminated():
            return NO_DRAFTS
        other_limit = min(limit, self.max_draft_tokens)  # for the sources besides the prediction
        state = self.states.setdefault(req.rid, DraftState())
        ngram_left = max(self._ngram_allowance(state), ngram_floor) if use_ngram else 0
        prediction_left = state.prediction_k or self.max_prediction_tokens
        tokens: list[int] = []
        sources: list[str] = []
        with Lookahead(grammar) as ahead:
            while len(tokens) < limit and not ahead.is_terminated:
                size = len(tokens)
                if req.prediction is not None and prediction_left > 0:
                    predicted = req.prediction.drafts(req.output_ids, tokens, min(limit - len(tokens), prediction_left))
                    prediction_left -= self._extend(ahead, tokens, sources, predicted, "prediction", limit)
                if self.use_grammar and grammar is not None:
                    forced = self._grammar_continuation(grammar)
                    extended = self._extend(ahead, tokens, sources, forced, "grammar", other_limit)
                    if extended and state.grammar_follower:
                        self._extend(ahead, tokens, sources, [state.grammar_follower], "follower", other_limit)
                lookup_limit = min(other_limit, len(tokens) + self._lookup_rows(rows + len(tokens)))
                if use_ngram and len(tokens) < lookup_limit:
                    context = req.prompt_ids + req.output_ids + tokens
                    looked_up, source = self._look_up(ahead, context, lookup_limit - len(tokens), ngram_left)
                    taken = self._extend(ahead, tokens, sources, looked_up, source, lookup_limit)
                    if source == "ngram":
                        ngram_left -= taken
                if len(tokens) == size:
                    break
        return Drafts(tokens, sources)

    @staticmethod
    def _extend(
        ahead: Lookahead, tokens: list[int], sources: list[str], new: list[int], source: str, limit: int
    ) -> int:
        """Append the part of ``new`` the grammar accepts (advancing it) within ``limit``; returns how many."""
        new = ahead.advance(new[: limit - len(tokens)])
        tokens += new
        sources += [source] * len(new)
        return len(new)

    def _look_up(
        self, ahead: Lookahead, context: list[int], max_tokens: int, prompt_tokens: int
    ) -> tuple[list[int], str]:
        """Prompt lookup's drafts (at most ``prompt_tokens``), or the n-gram cache's where it matches a longer suffix
        of ``context`` or prompt lookup finds nothing the grammar accepts; with its source name."""
        prompt_n, looked_up = prompt_lookup(context, min(max_tokens, prompt_tokens))
        if self.ngram_cache is None:
            return looked_up, "ngram"
        cache_n, cached = self.ngram_cache.lookup(context, max_tokens)
        if cached and (cache_n > prompt_n or not ahead.num_valid(looked_up)):
            return cached, "ngram_cache"
        return looked_up, "ngram"

    def _lookup_rows(self, rows: int) -> int:
        """The lookup drafts a forward of ``rows`` rows may still take: up to its row tile's next multiple."""
        if self.lookup_row_tile is None:
            return self.tokens_per_forward
        return -rows % self.lookup_row_tile

    @staticmethod
    def _ngram_allowance(state: DraftState) -> int:
        """This step's prompt-lookup length: the adaptive one, or a one-token probe after a pause."""
        if state.ngram_k == 0:
            state.paused_steps -= 1
            if state.paused_steps <= 0:
                state.ngram_k = 1
        return state.ngram_k

    def _grammar_continuation(self, grammar: BaseGrammarObject) -> list[int]:
        """The grammar's forced continuation as tokens, without the last token its text tokenises to."""
        forced = grammar.try_jump_forward(self.tokenizer)
        if forced is None:
            return []
        token_ids, text = forced
        tail = self.tokenizer.encode(text, add_special_tokens=False)[:-1] if text else []
        return [t for t in [*token_ids, *tail] if 0 <= t < self.vocab_size]


def _cache_output(cache: NgramCache, req: Req, state: DraftState, stop: int) -> None:
    """Give ``cache`` ``req``'s output positions up to ``stop``; the n-grams before the first ones reach into the
    prompt's end (the chat template's ``assistant\\n`` before the answer's ``{``)."""
    if stop <= state.num_cached_positions:
        return
    prompt_tail = req.prompt_ids[-cache.max_ngram :]
    offset = len(prompt_tail)
    cache.insert(prompt_tail + req.output_ids, offset + state.num_cached_positions, offset + stop)
    state.num_cached_positions = stop


def prompt_lookup(context: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """The length of the longest suffix of ``context`` (``NGRAM_MAX`` down to 1 tokens) that occurred earlier in it,
    and the tokens that followed its latest earlier occurrence, at most ``max_tokens``; ``(0, [])`` when none did.

    In NumPy, one suffix token at a time over the positions where the shorter suffix ended: after a forward has
    streamed the weights through the caches each torch op cost 10-30 µs, and the torch version's ~30 a call were
    ~0.2 ms of a constrained decode step (AMD EPYC: docs/benchmarks.md)."""
    if max_tokens <= 0 or len(context) < NGRAM_MIN_CONTEXT:
        return 0, []
    data = numpy.asarray(context)
    ends = numpy.flatnonzero(data[:-1] == data[-1])  # where an earlier occurrence of the last token ends
    if not ends.size:
        return 0, []
    n, end = 1, int(ends[-1])
    for k in range(1, NGRAM_MAX):
        ends = ends[ends >= k]
        ends = ends[data[ends - k] == data[-1 - k]]
        if not ends.size:
            break
        n, end = k + 1, int(ends[-1])
    return n, context[end + 1 : end + 1 + max_tokens]
