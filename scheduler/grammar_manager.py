"""Admission of constrained requests: compile off the loop, admit when ready, fail with a clear reason.

Requests whose grammar is a cache hit (or who have none) are admitted at once; the others wait in
``grammar_queue`` while the backend's compile service compiles (and enforces the compile deadline), and, with
budget-aware constraints, while the constraint's shortest output is searched (``BudgetSteering.after_compile``).
Nothing here sleeps: the loop asks ``get_ready_grammar_requests`` each turn, and a compile that finishes or times out
wakes the idle loop through ``wakeup_fd``. On several ranks the verdicts are agreed through ``RankSync``: ready on every
rank, failed on any rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from scheduler.budget_steering import BudgetSteering
from scheduler.io_struct import CONSTRAINT_FIELDS, AbortCause
from scheduler.rank_sync import GrammarFailure, RankSync
from scheduler.request import CLIENT_ABORT, Abort, Req
from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.errors import CompileNotStartedError, CompileTimeoutError

logger = logging.getLogger(__name__)

NO_GRAMMAR_BACKEND = Abort(
    AbortCause.BAD_REQUEST,
    f"constrained generation ({', '.join(CONSTRAINT_FIELDS)}) is not available: "
    "the server was launched with --grammar-backend none",
)
FAILURE_LABELS = {
    AbortCause.INVALID_CONSTRAINT: "invalid",
    AbortCause.COMPILE_TIMEOUT: "timeout",
    AbortCause.COMPILE_NOT_STARTED: "not_started",
}
"""The ``sglang:grammar_failures`` label of a failed compile's cause; any other cause is an ``engine_failure``."""


COMPILE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class GrammarMetrics:
    """The grammar manager's Prometheus metrics; the scheduler sends ``render()`` to the frontend in its ``Pong``."""

    def __init__(self, queue_length: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.compile_time = Histogram(
            "sglang:grammar_compile_time_seconds",
            "Grammar compiles (cache misses), valid or not, by constraint kind",
            ["constraint"],
            buckets=COMPILE_TIME_BUCKETS,
            registry=self.registry,
        )
        self.cache_lookups = Counter(
            "sglang:grammar_cache_lookups",
            "Constrained requests, by constraint kind and whether their grammar was cached (hit) or compiled (miss)",
            ["constraint", "result"],
            registry=self.registry,
        )
        self.disk_cache_loads = Counter(
            "sglang:grammar_disk_cache_loads",
            "Cache misses whose grammar was read from the grammar disk cache rather than compiled (written there by "
            "this server, another replica or rank, or an earlier start), by constraint kind",
            ["constraint"],
            registry=self.registry,
        )
        self.failures = Counter(
            "sglang:grammar_failures",
            "Constrained requests refused: invalid constraint, compile timeout, compile not started (it waited for a "
            "slot until its deadline), or engine failure",
            ["constraint", "reason"],
            registry=self.registry,
        )
        self.budget_steered = Counter(
            "sglang:budget_steered_requests",
            "Constrained requests whose ending was steered to fit their token budget (the model's first choice "
            "overruled at least once)",
            registry=self.registry,
        )
        queue = Gauge("sglang:grammar_compile_queue_length", "Requests waiting for a compile", registry=self.registry)
        queue.set_function(queue_length)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class GrammarManager:
    def __init__(
        self,
        grammar_backend: GrammarPipeline | None,
        rank_sync: RankSync | None = None,
        budget: BudgetSteering | None = None,
    ) -> None:
        """``budget``: plans each ready grammar's ending and refuses budgets below its shortest (None: off)."""
        self.grammar_backend = grammar_backend
        self.rank_sync = rank_sync
        self.budget = budget
        self.grammar_queue: list[Req] = []
        self.metrics = GrammarMetrics(lambda: len(self.grammar_queue))
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_read, False)
        os.set_blocking(self._wakeup_write, False)
        self._wakeup_lock = threading.Lock()

    @property
    def wakeup_fd(self) -> int:
        """A file descriptor that becomes readable when a compile finishes (for the loop's poller)."""
        return self._wakeup_read

    def process_req_with_grammar(self, req: Req) -> bool:
        """Attach the grammar (or its compile) to ``req``; True if it must wait in ``grammar_queue``.

        A request that cannot be served (``--grammar-backend none``, a cached invalid grammar) is finished
        with an abort and not queued. The hit-or-miss decision depends only on the cache, which every rank
        fills in the same order, so every rank queues the same requests.
        """
        if req.grammar_key is None:
            return False
        if self.grammar_backend is None:
            req.abort(NO_GRAMMAR_BACKEND)
            return False
        value, cache_hit = self.grammar_backend.get_cached_or_future_value(
            req.grammar_key, req.sampling_params.require_reasoning
        )
        req.grammar = value
        req.grammar_cache_hit = cache_hit
        self.metrics.cache_lookups.labels(req.grammar_key[0], "hit" if cache_hit else "miss").inc()
        if isinstance(value, Future):
            if self.budget is not None:  # its start ending is searched off the loop too
                value = self.budget.after_compile(req.grammar_key, value)
                req.grammar = value
            req.grammar_queued_at = time.monotonic()
            value.add_done_callback(self._wake_up)
            self.grammar_queue.append(req)
            return True
        if isinstance(value, InvalidGrammarObject):
            self.metrics.failures.labels(req.grammar_key[0], "invalid").inc()
            req.abort(_compile_error(req, value))
        else:
            self._check_budget(req)
        return False

    def get_ready_grammar_requests(self) -> list[Req]:
        """Requests leaving ``grammar_queue`` this turn, in arrival order: ready ones, and failed ones (finished)."""
        self._drain_wakeups()
        if not self.grammar_queue:
            return []
        ready, failures = self._local_verdicts()
        if self.rank_sync is not None:
            ready, failures = self.rank_sync.agree_grammars(ready, failures)
        leaving: list[Req] = []
        waiting: list[Req] = []
        for req in self.grammar_queue:
            if req.rid in failures:
                self._fail(req, failures[req.rid])
                leaving.append(req)
            elif req.rid in ready:
                self._admit(req)
                leaving.append(req)
            else:
                waiting.append(req)
        self.grammar_queue = waiting
        return leaving

    def abort_requests(self, rids: set[str]) -> list[Req]:
        """Remove queued requests in ``rids`` and finish them as aborted; returns them."""
        aborted = [req for req in self.grammar_queue if req.rid in rids]
        self.grammar_queue = [req for req in self.grammar_queue if req.rid not in rids]
        for req in aborted:
            req.abort(CLIENT_ABORT)
        return aborted

    def close(self) -> None:
        """Close the wake-up pipe; compiles that finish afterwards (a killed compile fails late) wake nobody."""
        if self.budget is not None:
            self.budget.shutdown()
        with self._wakeup_lock:
            if self._wakeup_write < 0:
                return
            os.close(self._wakeup_read)
            os.close(self._wakeup_write)
            self._wakeup_read = self._wakeup_write = -1

    def _local_verdicts(self) -> tuple[set[str], dict[str, GrammarFailure]]:
        """This rank's view: compiled and valid, failed (invalid, cancelled, past the deadline), or pending."""
        ready: set[str] = set()
        failures: dict[str, GrammarFailure] = {}
        for req in self.grammar_queue:
            future = _compiling(req)
            if not future.done():
                continue
            if future.cancelled():
                reset = Abort(AbortCause.GRAMMAR_RESET, "the grammar backend was reset while compiling")
                failures[req.rid] = GrammarFailure(reset, False)
            elif (error := future.exception()) is not None:
                failures[req.rid] = GrammarFailure(_compile_failure(error), False)
            elif isinstance(grammar := future.result(), InvalidGrammarObject):
                failures[req.rid] = GrammarFailure(_compile_error(req, grammar), True)
            else:
                ready.add(req.rid)
        return ready, failures

    def _admit(self, req: Req) -> None:
        assert req.grammar_key is not None and self.grammar_backend is not None
        grammar = _compiling(req).result()
        self._observe_compile(req.grammar_key[0], grammar)
        self.grammar_backend.set_cache(req.grammar_key, grammar.copy())
        req.grammar = grammar
        self._check_budget(req)
        if req.grammar_queued_at is not None:
            waited = time.monotonic() - req.grammar_queued_at
            logger.info("rid=%s constraint=%s grammar_ready_after_s=%.2f", req.rid, req.grammar_key[0], waited)

    def _check_budget(self, req: Req) -> None:
        """Refuse ``req`` (its grammar ready) if its token budget is below its constraint's shortest output."""
        refusal = self.budget.refusal(req) if self.budget is not None else None
        if refusal is not None:
            req.abort(refusal)

    def _fail(self, req: Req, failure: GrammarFailure) -> None:
        assert req.grammar_key is not None and self.grammar_backend is not None
        future = _compiling(req)
        if failure.is_compile_error:
            self._observe_compile(req.grammar_key[0], future.result())
            self.grammar_backend.set_cache(req.grammar_key, future.result())
        else:
            self.grammar_backend.discard_pending(req.grammar_key)
        kind = req.grammar_key[0]
        label = FAILURE_LABELS.get(failure.abort.cause, "engine_failure")
        self.metrics.failures.labels(kind, label).inc()
        logger.info("rid=%s constraint=%s grammar_failed=%s message=%s", req.rid, kind, label, failure.abort.message)
        req.grammar = None
        req.abort(failure.abort)

    def _observe_compile(self, kind: str, grammar: BaseGrammarObject) -> None:
        if grammar.grammar_stats is not None:
            self.metrics.compile_time.labels(kind).observe(grammar.grammar_stats.compile_time_s)
            if grammar.grammar_stats.is_disk_cache_hit:
                self.metrics.disk_cache_loads.labels(kind).inc()

    def _wake_up(self, _: Future[BaseGrammarObject]) -> None:
        # Under the lock: once closed, the pipe's fd numbers may belong to another file. A full pipe means the loop
        # wakes anyway.
        with self._wakeup_lock, contextlib.suppress(BlockingIOError):
            if self._wakeup_write >= 0:
                os.write(self._wakeup_write, b"\0")

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wakeup_read, 4096):
                pass


def _compile_failure(error: BaseException) -> Abort:
    """Why a compile failed without a verdict on the constraint, by the type of its error."""
    if isinstance(error, CompileNotStartedError):
        return Abort(AbortCause.COMPILE_NOT_STARTED, str(error))
    if isinstance(error, CompileTimeoutError):
        return Abort(AbortCause.COMPILE_TIMEOUT, str(error))
    return Abort(AbortCause.COMPILE_FAILED, f"the grammar backend failed: {error}")


def _compiling(req: Req) -> Future[BaseGrammarObject]:
    if not isinstance(req.grammar, Future):
        raise TypeError(f"request {req.rid} is in the grammar queue without a compile in flight")
    return req.grammar


def _compile_error(req: Req, grammar: InvalidGrammarObject) -> Abort:
    kind = req.grammar_key[0] if req.grammar_key else "grammar"
    return Abort(AbortCause.INVALID_CONSTRAINT, f"Failed to compile {kind} grammar: {grammar.error_message}")
