"""Grammars compiled once, on rank 0, for every rank: data-parallel replicas (``--dp-size``) and ranks in lockstep
(``--tp-size``, ``scheduler.turn_transport.LockstepRanks``).

Rank 0's ``GrammarStore`` compiles each constraint key on a compile service of its own (slots, deadline, in-flight
dedup, a bounded cache of exports) as soon as a request needs it (data-parallel: when it is routed, whichever
replica gets it; lockstep: when rank 0 misses it), and publishes each result in the next turn's exchange: the
export (the backend's serialised compiled grammar, or its compile error), or a timeout or engine failure (not
cached: the next request compiles anew). Each rank's ``SharedGrammars`` takes its backend's misses
(``compile_elsewhere``: the rank's cache, dedup and deadline stay) and settles them from the publications, and
caches every published grammar as it arrives, so that a grammar compiled for one replica is a cache hit on the
others and a compile error is one everywhere. A replica that misses a key no compile is running for (its cache
evicted it) asks for it, and the store answers from its cache. Ranks in lockstep receive each publication in the
same turn, so their caches stay alike and every rank holds the very grammar rank 0 chose (``auto``'s choice,
which a slow compile's hand-over makes by timing, is rank 0's alone). With a grammar disk cache, the store's
compiles read it first and write to it (``compile_or_load``), so a restarted server's rank 0 loads what an earlier
start compiled.

What is shared is each backend's ``export_grammar``: xgrammar's ``CompiledGrammar.serialize_json``, outlines-core's
index binary, llguidance's validated grammar text (it has no compiled form: each rank builds its matcher from the
text, quickly). A backend that cannot export (a registered one without ``can_share_grammars``) compiles on every
rank, as with one rank.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter as CountOf
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, generate_latest

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.cache.compiled import GrammarExport
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.service import CompileService
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.errors import CompileTimeoutError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedGrammar:
    """One publication: the export of a compiled (or invalid) grammar, or why its compile failed: a
    ``CompileTimeoutError`` (or ``CompileNotStartedError``) as the compile service raised it, else a ``RuntimeError``
    with the engine's message (what crosses the ranks is then a type the grammar manager knows)."""

    key: GrammarKey
    outcome: GrammarExport | Exception


class GrammarStore:
    """Rank 0's compiles for every rank; ``take_published`` hands over what finished since the last call.

    ``prefetch``/``ask`` may be called on the loop thread; compiles finish on the compile service's threads.
    """

    def __init__(self, backend: GrammarPipeline, grammar_args: GrammarArgs) -> None:
        self.backend = backend
        self.service: CompileService[GrammarKey, GrammarExport] = CompileService(
            self._compile,
            name="shared",
            threads=grammar_args.grammar_compile_threads,
            timeout_s=grammar_args.compile_timeout_s,
            cache_max_entries=grammar_args.grammar_cache_max_entries,
            cache_max_bytes=grammar_args.grammar_cache_max_bytes,
            size_of=lambda export: len(export.payload or export.error_message),
            copy=lambda export, _: export,
            slow_after_s=grammar_args.grammar_compile_slow_after,
            max_slow=grammar_args.grammar_max_slow_compiles,
        )
        self._lock = threading.Lock()
        self._pending: set[GrammarKey] = set()
        self._published: list[SharedGrammar] = []
        self._compiles_by_key: CountOf[int] = CountOf()
        self.metrics = CollectorRegistry()
        self._num_compiles = Counter(
            "sglang:grammar_shared_compiles",
            "Grammars rank 0 compiled for every rank (data-parallel replicas, ranks in lockstep), by constraint kind",
            ["constraint"],
            registry=self.metrics,
        )
        self._num_constraints = Counter(
            "sglang:grammar_shared_constraints",
            "Distinct constraints rank 0 compiled (compiles over this are compiles per distinct constraint: 1 unless "
            "a compile timed out or the cache evicted it)",
            ["constraint"],
            registry=self.metrics,
        )

    @property
    def is_compiling(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def prefetch(self, key: GrammarKey) -> None:
        """Compile ``key`` unless it is cached or compiling; the result is published when ready."""
        self._request(key, publish_cached=False)

    def ask(self, key: GrammarKey) -> None:
        """Publish ``key``'s grammar: at once if cached, else when its compile ends."""
        self._request(key, publish_cached=True)

    def take_published(self) -> list[SharedGrammar]:
        with self._lock:
            published, self._published = self._published, []
        return published

    def render_metrics(self) -> str:
        return generate_latest(self.metrics).decode()

    def shutdown(self) -> None:
        self.service.shutdown()

    def _request(self, key: GrammarKey, publish_cached: bool) -> None:
        with self._lock:
            if key in self._pending or any(shared.key == key for shared in self._published):
                return  # its compile publishes it, or it is about to be published
        value, _ = self.service.get(key)
        if isinstance(value, Future):
            with self._lock:
                self._pending.add(key)
            value.add_done_callback(lambda done: self._compiled(key, done))
        elif publish_cached:
            self._publish(SharedGrammar(key, value))

    def _compile(self, key: GrammarKey, control: CompileControl) -> GrammarExport:
        with self._lock:
            digest = hash(key)
            self._compiles_by_key[digest] += 1
            num_compiles = self._compiles_by_key[digest]
        self._num_compiles.labels(key[0]).inc()
        if num_compiles == 1:
            self._num_constraints.labels(key[0]).inc()
        logger.info("compiling a %s constraint for every rank (compile %d of it)", key[0], num_compiles)
        return self.backend.compile_or_load_exportable(key, control)[1]()

    def _compiled(self, key: GrammarKey, done: Future[GrammarExport]) -> None:
        with self._lock:
            self._pending.discard(key)
        if done.cancelled():
            self._publish(SharedGrammar(key, RuntimeError("the grammar backend was reset while compiling")))
        elif (error := done.exception()) is not None:
            self.service.forget(key)
            shared_error = error if isinstance(error, CompileTimeoutError) else RuntimeError(str(error))
            self._publish(SharedGrammar(key, shared_error))
        else:
            self.service.store(key, done.result())
            self._publish(SharedGrammar(key, done.result()))

    def _publish(self, shared: SharedGrammar) -> None:
        with self._lock:
            self._published.append(shared)


class SharedGrammars:
    """One rank's side: its backend compiles nothing, it takes the store's publications.

    ``ask``: what a miss does besides waiting (rank 0 in lockstep asks its store at once; ranks in lockstep with
    rank 0 ask nothing, rank 0 missing the same key in the same turn); None: keep it for ``take_asks``.
    Runs on the loop thread only (the backend asks ``_fetch`` from the loop's grammar manager).
    """

    def __init__(self, backend: GrammarPipeline, ask: Callable[[GrammarKey], None] | None = None) -> None:
        self.backend = backend
        self._ask = ask or self._asks_for_rank_0
        self._waiting: dict[GrammarKey, Future[BaseGrammarObject]] = {}
        self._asks: list[GrammarKey] = []
        backend.compile_elsewhere(self._fetch)

    def take_asks(self) -> list[GrammarKey]:
        """Keys this rank started waiting for since the last call (the store publishes each)."""
        asks, self._asks = self._asks, []
        return asks

    def receive(self, published: list[SharedGrammar]) -> None:
        """Cache each published grammar (and compile error) and settle whatever waits for it."""
        for shared in published:
            waiter = self._waiting.pop(shared.key, None)
            if isinstance(shared.outcome, Exception):
                if waiter is not None:
                    waiter.set_exception(shared.outcome)
                continue
            try:
                grammar = self.backend.import_grammar(shared.outcome)
            except Exception as e:  # a grammar that does not import fails its requests, not the loop
                logger.exception("failed to import a shared %s grammar", shared.key[0])
                if waiter is not None:
                    waiter.set_exception(e)
                continue
            self.backend.set_cache(shared.key, grammar)
            if waiter is not None:
                waiter.set_result(grammar)

    def cancel(self) -> None:
        for waiter in self._waiting.values():
            waiter.cancel()
        self._waiting.clear()

    def _fetch(self, key: GrammarKey) -> Future[BaseGrammarObject]:
        waiter: Future[BaseGrammarObject] = Future()
        self._waiting[key] = waiter
        self._ask(key)
        return waiter

    def _asks_for_rank_0(self, key: GrammarKey) -> None:
        self._asks.append(key)
