"""Each constraint's shortest output, searched off the scheduler's loop.

A budget-aware constraint needs the ending from its grammar's start before its first request is admitted (a budget
below it is refused; the plan steers the output's last tokens). That search walks the grammar's masks: 0.1-0.7 s of
CPU for the serving bench's schema and regex (where xgrammar's exact search runs to its step bound), 1-2 s more on a
vocabulary's first search (the exact search's piece trie). In the loop it stalled every running request that long,
once per new constraint. It now runs on a thread of its own, at the compiles' CPU priority, chained onto the compile
(``after_compile``): a request waits for it in the grammar queue as it waits for its compile, and the loop keeps
stepping the others meanwhile.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.cache.vocabulary import TokenizerVocabulary
from sglang_constrained.compile.futures import relay, settle
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.cpu_priority import COMPILE_NICENESS, set_nice, thread_nice
from sglang_constrained.endings.search import MAX_SEARCH_SECONDS, EndingSearch

MAX_CACHED_STARTS = 1024
"""Constraint keys whose start ending is kept (the grammar cache's default entries: a cached grammar's ending is
normally known); the steering keeps as many keys' endings found later."""
START_SEARCH_SECONDS = 2 * MAX_SEARCH_SECONDS
"""The time bound of a start's search (``EndingSearch.find``'s safety net, in the searching thread's CPU time): twice
the loop's. The search's step bounds are the same on every machine, its time bound is not. MaskBench's schemas
searched from their start on a quiet Intel Xeon found the same endings at 1, 4 and 8 s (376 on xgrammar, 385 on
llguidance), but at 0.5 s, as a machine half as fast would at 1 s, 8 of 396 came out longer on xgrammar (29 tokens
where 1 s found 27) and 1 of 382 on llguidance: a budget between the two would be refused on the slower machine only.
Off the loop the longer bound holds up only that constraint's first request, and only where masks are slow enough
that the search runs to it (xgrammar inside a string of ``maxLength`` 255: MaskBench's o26589 and o58909)."""


class StartEndings:
    """The start endings of constraint keys (``EndingSearch.find`` from a grammar at its start), searched one at a
    time on a thread of their own over ``vocabulary``, each once while it is kept."""

    def __init__(self, vocabulary: TokenizerVocabulary) -> None:
        self._vocabulary = vocabulary
        self._nice = thread_nice()
        self._worker = ThreadPoolExecutor(1, "start-endings", initializer=self._lower_priority)
        self._search: EndingSearch | None = None
        """The worker's own (a search is not thread-safe); built on its first search."""
        self._endings: OrderedDict[GrammarKey, Future[list[int] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def ending(self, key: GrammarKey, grammar: BaseGrammarObject) -> Future[list[int] | None]:
        """``key``'s start ending: known, being searched, or searched now from a copy of ``grammar`` (at its start)."""
        with self._lock:
            found = self._endings.get(key)
            if found is not None:
                self._endings.move_to_end(key)
                return found
            start = grammar.copy()
            found = self._worker.submit(self._find, start)
            self._endings[key] = found
            if len(self._endings) > MAX_CACHED_STARTS:
                self._endings.popitem(last=False)
            return found

    def after_compile(
        self,
        key: GrammarKey,
        compiling: Future[BaseGrammarObject],
        answer_grammar: Callable[[BaseGrammarObject], BaseGrammarObject],
    ) -> Future[BaseGrammarObject]:
        """``compiling``'s grammar once ``key``'s start ending is known too (searched from ``answer_grammar`` of it);
        a compile that fails, is cancelled or finds the constraint invalid settles it at once, the same way."""
        ready: Future[BaseGrammarObject] = Future()

        def compiled(done: Future[BaseGrammarObject]) -> None:
            if done.cancelled() or done.exception() is not None or isinstance(done.result(), InvalidGrammarObject):
                relay(done, ready)
                return
            grammar = done.result()
            try:
                searching = self.ending(key, answer_grammar(grammar))
            except Exception as e:  # a callback's error would be logged and the request left waiting
                settle(ready, error=e)
                return
            searching.add_done_callback(lambda _: settle(ready, grammar))

        compiling.add_done_callback(compiled)
        return ready

    def shutdown(self) -> None:
        """Drop the searches not started; one running ends within its bounds."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _find(self, grammar: BaseGrammarObject) -> list[int] | None:
        if self._search is None:
            self._search = EndingSearch(self._vocabulary)
        return self._search.find(grammar, max_seconds=START_SEARCH_SECONDS)

    def _lower_priority(self) -> None:
        if sys.platform == "linux":  # elsewhere a native thread id is no process id
            set_nice(threading.get_native_id(), self._nice + COMPILE_NICENESS)
