"""Budget-aware constraints: a constrained output that its token budget would cut ends inside the budget instead,
in a state its grammar accepts, with ``finish_reason: "stop"``.

Each constrained request carries an ``EndingPlan``: a token path from its grammar's state to the grammar's end
(``sglang_constrained.endings.search``), whose length bounds the shortest ending from above. Its remaining budget is
what ``max_new_tokens`` (and the context) still allow, this token included; the thinking of a reasoning request
spends it first (after its own thinking budget), and is closed (the think-end token forced) where one more thinking
token would leave the answer's shortest ending no room.

- Far from the budget (the remaining budget at least ``WATCH`` tokens more than the plan) no row is checked. The
  plan follows the output where the output follows it. Beyond ``WATCH`` tokens of slack nothing else is computed
  (the plan goes stale); within it the plan is kept current after every token (``record``): the plan itself where
  it still ends the output (a string's content), a suffix of it, an ending searched for this constraint's other
  requests, a few bytes followed by the plan (``]`` after one more ``[``), else a bounded search (milliseconds,
  remembered for the others); where that finds nothing it goes stale until the budget comes near. A plan gone stale
  beyond ``WATCH`` is found anew as the output comes within it: a suffix of the path it last held, an ending known
  for the constraint, else a bounded search (once: where that finds nothing, it waits for the horizon too). Outputs
  that never come near their budget are the same token for token as without the feature (a row is changed only
  where the model's choice would leave no ending within the budget).
- Near the budget the masked logits are steered: the most likely tokens the grammar allows are checked in order
  (after each, an ending must fit the budget left: the plan's own next token, a suffix of the plan, or a new
  search), and the row keeps those that pass plus the plan's next token, which always does. The guarantee is
  therefore sound whatever the search misses: every token allowed has a walked ending within the budget. A row is
  steered only where the model's own choice leaves no ending within the budget: within ``WATCH`` that choice is
  checked (a greedy row's before sampling; a sampled row's after it, ``refused_samples``, which steers a refused
  row to ``NUM_CANDIDATES`` passing tokens to be sampled again with the same draws). One token can open an item
  whose ending is longer than the slack (a second tool call after a first, a new array item of many required
  fields), so the check runs from ``WATCH`` tokens of slack, not only at the last few.
- Drafts stop where the rows they would need come near the horizon; within ``WATCH`` the model's choices after
  drafts that stood are checked as first rows are (``may_take``), so that speculation changes no output. Forced
  tokens (the grammar allows one token) keep any ending's length minus one and need no check.

A budget below the shortest ending from the grammar's start is refused when the grammar is ready (``refusal``). Within
``WATCH`` every token taken is checked, so the guarantee is exact there. What it assumes: that one token does not grow
the ending by more than ``WATCH`` tokens of slack; where the plan is stale (beyond ``WATCH``, or where the searches
found nothing), that the ending does not grow by more than the slack left beyond ``HORIZON`` before the plan is
current again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import numpy
import torch

from scheduler.ending_plan import EndingPlan
from scheduler.io_struct import AbortCause
from scheduler.request import Abort, Req
from scheduler.start_endings import MAX_CACHED_STARTS, StartEndings
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.backends.reasoner import ReasonerGrammarObject
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.endings.search import EndingSearch

HORIZON = 12
"""Slack (remaining budget beyond the plan's length) below which a stale plan is searched for in full and no drafts
are verified."""
WATCH = 48
"""Slack below which the plan is kept current after every token (``record``); beyond it nothing is computed."""
NUM_CANDIDATES = 8
"""Tokens a sampled row whose own choice was refused keeps (a greedy row needs one): the most likely that pass."""
MAX_CHECKED = 24
"""Most tokens checked for one row in one step."""
MAX_SEARCHES = 1
"""Most new searches for one row in one step (the plan's suffixes are tried first, for every candidate)."""
MAX_CHECK_STEPS = 300
"""Steps a candidate's search may take (``EndingSearch.find``); a candidate whose ending it does not find is not
kept (the plan's next token always is)."""
SEARCH_SAFETY_SECONDS = 0.25
"""A safety net on the searches for a candidate's ending and for a plan kept current, in CPU seconds, for grammars
whose masks are slow (~1 ms): everywhere else their steps (``MAX_CHECK_STEPS``) bound them, the same on every machine.
Bounded at 5 and 20 ms before, what they found depended on the machine, and with it which tokens were allowed: on AMD
EPYC Zen 3 greedy JSON answers of 20 tokens under a budget of 32 were steered from their fifth token on (``"Bo"``
became ``"Bo1234567890"``) where Zen 5 left them alone, and speculation changed outputs."""
MAX_GROWTH = 64
"""Most tokens a replayed ending may have beyond the one it replaces (far from the budget any length will do)."""
MAX_KNOWN_ENDINGS = 8
"""Endings kept per constraint key for its other requests, shortest first (endings recur: after ``"age": 34,`` every
request of a schema needs the same closing fields)."""


class BudgetSteering:
    """Plans endings and steers rows near the budget; ``on_steered`` is called once per request steered."""

    def __init__(self, search: EndingSearch, max_seq_len: int, on_steered: Callable[[], None] = lambda: None) -> None:
        self.search = search
        self.max_seq_len = max_seq_len
        self.on_steered = on_steered
        self.start_endings = StartEndings(search.vocabulary)
        self._known_endings: OrderedDict[GrammarKey, list[list[int]]] = OrderedDict()
        self.num_searches = 0
        """Bounded searches run within ``WATCH`` because no plan, suffix or known ending fitted."""
        self.num_stale = 0
        """Plans gone stale within ``WATCH``: nothing fitted and the bounded search found nothing (searched anew,
        unbounded, once the budget is near; ``bench_budget_steering`` counts both)."""

    def after_compile(self, key: GrammarKey, compiling: Future[BaseGrammarObject]) -> Future[BaseGrammarObject]:
        """``compiling``'s grammar once its start ending is known too (``StartEndings.after_compile``): what a request
        waits for in the grammar queue, so that ``refusal`` finds the ending searched."""
        return self.start_endings.after_compile(key, compiling, _answer_grammar)

    def shutdown(self) -> None:
        """Stop searching start endings: searches queued are dropped, the one running ends on its own bound."""
        self.start_endings.shutdown()

    def refusal(self, req: Req) -> Abort | None:
        """Give ``req`` (whose grammar is ready, at its start) its first plan; why it must be refused if its budget
        is below the constraint's shortest output. Waits for the constraint's start ending where it is not known yet
        (a cached grammar whose ending was dropped; a request admitted through ``after_compile`` finds it)."""
        grammar = req.ready_grammar
        if grammar is None or req.grammar_key is None:
            return None
        ending = self.start_endings.ending(req.grammar_key, _answer_grammar(grammar)).result()
        if ending is None:
            return None
        req.ending = EndingPlan(list(ending), len(ending))
        self._remember(req.grammar_key, ending)
        budget = min(req.sampling_params.max_new_tokens, self.max_seq_len - len(req.prompt_ids))
        if budget < len(ending):
            return Abort(
                AbortCause.BAD_REQUEST,
                f"the token budget (max_tokens / max_new_tokens) of {budget} is below the {len(ending)} tokens of "
                f"the shortest output found for the {req.grammar_key[0]} constraint",
            )
        return None

    def draft_room(self, req: Req) -> int | None:
        """Most drafts ``req`` may verify this step without a row near its budget (None: no limit)."""
        plan = self._plan(req)
        if plan is None:
            return None
        return max(self._remaining(req) - plan.length - HORIZON, 0)

    def steer(self, batch: list[Req], rows: list[range], logits: torch.Tensor, greedy: list[bool]) -> None:
        """Steer the masked logits of greedy requests within ``WATCH`` whose choice leaves no ending within the
        budget, in place: ``rows[i]`` are ``batch[i]``'s rows of ``logits``, ``greedy[i]`` whether it samples greedily.
        Only a greedy request's first row is steered here (the tokens after its verified drafts by ``may_take``); a
        sampled request's choice is checked after sampling (``watched_rows``, ``refused_samples``)."""
        for req, req_rows, is_greedy in zip(batch, rows, greedy, strict=True):
            grammar = req.ready_grammar
            if isinstance(grammar, ReasonerGrammarObject) and grammar.is_thinking and len(req_rows) == 1:
                self._close_thinking_in_time(req, grammar.think_end_id, logits[req_rows.start])
                continue
            if not is_greedy:
                continue
            plan = self._plan(req)
            if plan is None or plan.tokens is None:
                continue
            remaining = self._remaining(req)
            if remaining - len(plan.tokens) >= WATCH:
                continue
            assert grammar is not None
            self._steer_row(grammar, req.grammar_key, plan, remaining, logits[req_rows.start], 1)

    def may_take(self, req: Req, token: int) -> bool:
        """Whether ``req`` may take ``token``, its model's choice after drafts that stood (a row ``steer`` did not
        check): not where its budget is near and no ending fits after it (the next step steers that position as its
        first row)."""
        plan = req.ending
        grammar = req.ready_grammar
        if plan is None or not plan.tokens or grammar is None or not _is_answering(grammar):
            return True
        remaining = self._remaining(req)
        if remaining - len(plan.tokens) >= WATCH:
            return True
        return self._choice_ending(grammar, req.grammar_key, plan.tokens, token, remaining - 1) is not None

    def watched_rows(self, batch: list[Req], rows: list[range], greedy: list[bool]) -> list[int]:
        """The first rows of sampled requests within ``WATCH`` (``steer`` left them as they are): their sampled
        tokens are checked after sampling (``refused_samples``); the tokens after their drafts by ``may_take``."""
        watched = []
        for req, req_rows, is_greedy in zip(batch, rows, greedy, strict=True):
            if is_greedy:
                continue
            plan = self._plan(req)
            if plan is not None and plan.tokens and self._remaining(req) - len(plan.tokens) < WATCH:
                watched.append(req_rows.start)
        return watched

    def refused_samples(
        self, batch: list[Req], rows: list[range], watched: list[int], logits: torch.Tensor, tokens: list[int | None]
    ) -> list[int]:
        """Of the ``watched`` rows, those whose sampled token leaves no ending within the budget: steered now to the
        most likely tokens that leave one (``logits`` are the rows as they were before sampling), to be sampled
        again."""
        owner = {req_rows.start: req for req, req_rows in zip(batch, rows, strict=True)}
        refused = []
        for row in watched:
            req, token = owner[row], tokens[row]
            plan, grammar = req.ending, req.ready_grammar
            if token is None or plan is None or not plan.tokens or grammar is None:
                continue
            remaining = self._remaining(req)
            ending = self._choice_ending(grammar, req.grammar_key, plan.tokens, token, remaining - 1)
            if ending is not None:
                plan.after = {token: ending}
                continue
            self._steer_row(grammar, req.grammar_key, plan, remaining, logits[row], NUM_CANDIDATES)
            refused.append(row)
        return refused

    def record(self, req: Req, token: int) -> None:
        """``req`` took ``token`` (its grammar accepted it): follow it with the plan. Within ``WATCH`` tokens of the
        budget a plan the output left is found anew (the plan itself where it still ends the output, a suffix of it,
        an ending searched for this constraint's other requests, a few bytes and the plan, a bounded search), so that
        its length is current at every step there; it goes stale where none is found, or beyond ``WATCH`` (nothing is
        checked there)."""
        plan = req.ending
        grammar = req.ready_grammar
        if plan is None or grammar is None or not _is_answering(grammar, counting_last=True):
            return
        after, plan.after = plan.after, {}
        if plan.tokens and plan.tokens[0] == token:
            plan.tokens = plan.tokens[1:]
        elif token in after:
            plan.tokens = after[token]
        elif self._remaining(req) - plan.length >= WATCH:
            plan.last_tokens = plan.tokens or plan.last_tokens
            plan.tokens = None
        elif plan.tokens is None:
            plan.tokens = self._stale_ending_anew(grammar, req.grammar_key, plan)
        else:
            plan.tokens = self._ending_anew(grammar, req.grammar_key, plan.tokens, token)
        if plan.tokens is not None:
            plan.length = len(plan.tokens)

    def _stale_ending_anew(
        self, grammar: BaseGrammarObject, key: GrammarKey | None, plan: EndingPlan
    ) -> list[int] | None:
        """A stale plan within ``WATCH``: a suffix of the path it held when it went stale, an ending known for
        ``key``, else (the first time) a bounded search that goes on with the walk of first moves where its steps run
        out (inside many open brackets, or an object of many required fields, where a bounded breadth-first search
        finds nothing)."""
        last = plan.last_tokens
        found = self.search.replay(grammar, last, len(last) + MAX_GROWTH, respell=True) if last else None
        if found is None:
            found = self._known_ending(grammar, key)
        if found is None and not plan.search_failed:
            self.num_searches += 1
            found = self.search.find(  # any ending will do: the walk of first moves where the steps run out
                grammar, MAX_CHECK_STEPS, ascii_only=True, max_seconds=SEARCH_SAFETY_SECONDS
            )
            plan.search_failed = found is None
            if found is not None:
                self._remember(key, found)
        return found

    def _ending_anew(
        self, grammar: BaseGrammarObject, key: GrammarKey | None, ending: list[int], token: int
    ) -> list[int] | None:
        """An ending from ``grammar``'s state after ``token`` left ``ending``, or None."""
        search = self.search
        if search.finishes(grammar, ending):
            return ending
        found = search.replay(grammar, ending, len(ending) + MAX_GROWTH, search.piece(token), respell=True)
        if found is not None:
            return found
        found = self._known_ending(grammar, key)
        if found is None:
            found = search.rejoin(grammar, ending)
        if found is None:
            self.num_searches += 1
            found = search.find(
                grammar, MAX_CHECK_STEPS, ascii_only=True, max_seconds=SEARCH_SAFETY_SECONDS, first_moves=False
            )
            if found is None:
                self.num_stale += 1
            else:
                self._remember(key, found)
        return found

    def _plan(self, req: Req) -> EndingPlan | None:
        """``req``'s plan, made current if it went stale and the budget is near; None where nothing is steered."""
        plan = req.ending
        grammar = req.ready_grammar
        if plan is None or grammar is None or grammar.finished or grammar.is_terminated() or not _is_answering(grammar):
            return None
        if plan.tokens is None and self._remaining(req) - plan.length < HORIZON:
            plan.tokens = self.search.find(grammar)
            if plan.tokens is None:
                req.ending = None  # no ending within the search's reach: this request is not steered
                return None
            plan.length = len(plan.tokens)
            self._remember(req.grammar_key, plan.tokens)
        return plan

    def _close_thinking_in_time(self, req: Req, think_end_id: int, row: torch.Tensor) -> None:
        """Force the think-end token where one token more of thinking would leave the answer's shortest ending no
        room (the thinking spends the budget first, but never the answer's last tokens)."""
        plan = req.ending
        if plan is None or plan.tokens is None or self._remaining(req) > len(plan.tokens) + 1:
            return
        logits, is_view = _host_values(row)
        value = float(logits[think_end_id])
        logits.fill(-numpy.inf)
        logits[think_end_id] = 0.0 if value == -numpy.inf else value
        if not is_view:
            row.copy_(torch.from_numpy(logits))
        if not plan.is_steered:
            plan.is_steered = True
            self.on_steered()

    def _remaining(self, req: Req) -> int:
        """Tokens ``req`` may still output, the next one included."""
        limit = min(req.sampling_params.max_new_tokens, self.max_seq_len - len(req.prompt_ids))
        return limit - len(req.output_ids)

    def _steer_row(
        self,
        grammar: BaseGrammarObject,
        key: GrammarKey | None,
        plan: EndingPlan,
        remaining: int,
        row: torch.Tensor,
        wanted: int,
    ) -> None:
        """Keep in ``row`` the most likely tokens after which an ending fits ``remaining - 1`` tokens (at most
        ``wanted`` of them), and the plan's next token. A greedy row (``wanted`` 1) whose choice fits is left as it
        is (its log-probabilities too)."""
        assert plan.tokens is not None
        if not plan.tokens:
            return  # the grammar has ended: the request finishes without another token
        logits, is_view = _host_values(row)
        if wanted == 1:
            choice = int(numpy.argmax(logits))  # the first largest, as the greedy sampler takes it
            if logits[choice] != -numpy.inf:
                ending = self._choice_ending(grammar, key, plan.tokens, choice, remaining - 1)
                if ending is not None:
                    plan.after = {choice: ending}
                    return
        num_checked = min(MAX_CHECKED, logits.shape[0])
        order = numpy.argpartition(-logits, num_checked - 1)[:num_checked]
        order = order[numpy.argsort(-logits[order], kind="stable")].tolist()
        num_searches = 0
        passed: dict[int, list[int]] = {}
        for token in order:
            if logits[token] == -numpy.inf or len(passed) >= wanted:
                break
            ending, searched = self._ending_after(grammar, plan.tokens, token, remaining - 1, num_searches)
            num_searches += searched
            if ending is not None:
                passed[token] = ending
        passed.setdefault(plan.tokens[0], plan.tokens[1:])
        if order[0] not in passed and not plan.is_steered:
            plan.is_steered = True
            self.on_steered()
        plan.after = passed
        kept = numpy.fromiter(passed, dtype=numpy.int64)
        values = numpy.where(numpy.isneginf(logits[kept]), 0.0, logits[kept])  # a banned plan token: the ending wins
        logits.fill(-numpy.inf)
        logits[kept] = values
        if not is_view:
            row.copy_(torch.from_numpy(logits))

    def _choice_ending(
        self, grammar: BaseGrammarObject, key: GrammarKey | None, ending: list[int], token: int, budget: int
    ) -> list[int] | None:
        """An ending of at most ``budget`` tokens after the model's choice ``token`` (which the grammar allows), found
        as ``record`` would keep the plan current after it (``_ending_anew``), or None. The grammar ends where it
        started."""
        if token == ending[0]:
            return ending[1:]
        grammar.accept_token(token)
        try:
            if grammar.is_terminated():
                return []
            found = self._ending_anew(grammar, key, ending, token)
            return found if found is not None and len(found) <= budget else None
        finally:
            grammar.rollback(1)

    def _ending_after(
        self, grammar: BaseGrammarObject, ending: list[int], token: int, budget: int, num_searches: int
    ) -> tuple[list[int] | None, int]:
        """An ending of at most ``budget`` tokens after ``token`` (which the grammar allows), or None; and whether a
        new search was run. The grammar ends where it started."""
        if token == ending[0]:
            return ending[1:], 0
        grammar.accept_token(token)
        try:
            if grammar.is_terminated():
                return [], 0
            after = self.search.replay(grammar, ending, budget, self.search.piece(token))
            if after is None and len(ending) < budget:  # one byte more and the ending: "]" after one more "["
                after = self.search.bridge(grammar, ending)
            if after is not None or num_searches >= MAX_SEARCHES:
                return after, 0
            found = self.search.find(
                grammar, MAX_CHECK_STEPS, ascii_only=True, max_seconds=SEARCH_SAFETY_SECONDS, first_moves=False
            )
            return (found if found is not None and len(found) <= budget else None), 1
        finally:
            grammar.rollback(1)

    def _known_ending(self, grammar: BaseGrammarObject, key: GrammarKey | None) -> list[int] | None:
        """The shortest ending searched for ``key``'s requests that ends ``grammar`` from its state, or None."""
        return next((known for known in self._known_for(key) if self.search.finishes(grammar, known)), None)

    def _known_for(self, key: GrammarKey | None) -> list[list[int]]:
        """The endings searched for ``key``'s requests, shortest first."""
        return self._known_endings.get(key, []) if key is not None else []

    def _remember(self, key: GrammarKey | None, ending: list[int]) -> None:
        """Keep ``ending`` (found by a search) for ``key``'s other requests."""
        if key is None or not ending:
            return
        known = self._known_endings.setdefault(key, [])
        self._known_endings.move_to_end(key)
        if len(self._known_endings) > MAX_CACHED_STARTS:
            self._known_endings.popitem(last=False)
        if ending not in known:
            known.append(ending)
            known.sort(key=len)
            del known[MAX_KNOWN_ENDINGS:]


def _host_values(row: torch.Tensor) -> tuple[numpy.ndarray, bool]:
    """``row`` as a NumPy array, and whether it is a view: on the CPU steering writes through it (single-threaded
    NumPy over one row, where each torch op wakes its thread team: milliseconds on a busy machine), elsewhere it is a
    copy the caller writes back."""
    if row.device.type == "cpu" and row.is_contiguous():
        return row.numpy(), True
    return row.cpu().numpy(), False


def _answer_grammar(grammar: BaseGrammarObject) -> BaseGrammarObject:
    """The grammar the answer must satisfy (inside a reasoning gate, the gated one)."""
    return grammar.grammar if isinstance(grammar, ReasonerGrammarObject) else grammar


def _is_answering(grammar: BaseGrammarObject | None, counting_last: bool = False) -> bool:
    """Whether ``grammar`` constrains the answer now (not thinking); with ``counting_last``, whether its last token
    was the answer's (not the think-end token)."""
    if not isinstance(grammar, ReasonerGrammarObject):
        return grammar is not None
    if counting_last:
        return grammar.tokens_after_think_end > 0
    return grammar.is_answering
