"""``--grammar-backend auto``: each constraint is compiled by the first backend of ``--grammar-backend-order`` that
enforces it exactly, or by whichever exact one compiles it first once the first choice turns out slow.

Every backend refuses up front, naming it, what it would otherwise ignore (``*_schema_rules.py``), and here also
what it would narrow (``require_exact``: xgrammar writes an open object's default out and refuses arrays its
strict mode would close, outlines refuses objects it would close). With ``--grammar-auto-allow-narrowing`` (the
default) every backend first closes a JSON schema as xgrammar's strict mode would (``closes_open_schemas``; a
schema whose closing JSON Schema cannot say, ``closing_is_exact``, is left as written), then enforces that exactly:
the language is the same whichever backend wins (the choice, which a slow compile changes, changes at most how a
token may split a key: llguidance allows fewer splits than xgrammar); the grammar's stats
name the narrowing. A refusal, or any other failure to compile, sends the constraint on to the next backend; so
does slowness: a backend still compiling after ``--grammar-compile-slow-after`` seconds has the next one start
beside it, and the first exact grammar to arrive wins (earlier backends first when both are in), the others being
cancelled (an xgrammar compile process is killed). So ``auto`` never fails a constraint that
one of its backends compiles within the deadline.

The choice is made once, at compile time: the grammar object cached and handed to requests is the chosen backend's
own, so its masks and token steps cost what that backend's cost, and one batch mixes backends because they all
fill the contract's int32 bitmask (``triton_ops.bitmask_format``). Each grammar's ``GrammarStats`` records the
choice and the backends passed over with why, the log says why at INFO, and ``choice_counts()`` feeds metrics.

The backends of the order are built at start-up with the server's settings, so their start-up costs add up (each
decodes the vocabulary). Each compiles in the slots of its own pipeline's compile service (``submit``: outside
their caches), under this compile's deadline; the grammar goes into the one cache of the pipeline around ``auto``,
keyed by ``(type, spec)``, and into the disk cache as the winner exported it (an xgrammar compile process's export
as it came: ``build_exportable``), so that the disk cache keeps under ``auto`` what it keeps under the winner alone.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from sglang_constrained.backends.base import BaseGrammarObject, GrammarBackend, GrammarBackendArgs, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import (
    AUTO_GRAMMAR_BACKEND,
    check_grammar_backend_order,
    grammar_backend_factory,
)
from sglang_constrained.cache.compiled import GrammarExport, GrammarStats
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.errors import COMPILE_TIMEOUT_PREFIX, CompileTimeoutError, bounded_message, refusal_reason

logger = logging.getLogger(__name__)

STILL_COMPILING = "still compiling"
"""How the reason of a backend passed over for slowness starts (``GrammarStats.fallback_reasons``)."""


@dataclass(frozen=True)
class AutoChoiceCounts:
    """Compiles so far (cache hits are not compiles): per backend, how many it was chosen for and how many it
    refused; and how many every backend refused."""

    num_chosen: dict[str, int]
    num_refused: dict[str, int]
    num_refused_by_all: int


class AutoGrammarBackend(GrammarBackend):
    """Asks the backends of ``server_args.grammar_backend_order`` in turn (those that take a constraint as written
    first: llguidance for Lark), the next one beside a slow one; the first exact grammar wins.

    ``backends`` maps each name of the order to the pipeline of its backend, in order (whose compile slots it uses,
    not its cache); ``handover_s``: how long a backend compiles alone before the next one starts beside it.
    """

    name = AUTO_GRAMMAR_BACKEND

    def __init__(
        self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        check_grammar_backend_order(server_args.grammar_backend_order)
        super().__init__(server_args, vocab_size)
        self.backends: dict[str, GrammarPipeline] = {}
        try:
            for name in server_args.grammar_backend_order:
                backend = _build_backend(name, server_args, tokenizer, vocab_size, eos_token_ids)
                self.backends[name] = GrammarPipeline(backend)
                if self.backends[name].mask_layout != self.mask_layout:
                    raise ValueError(
                        f"--grammar-backend auto cannot mix {name}'s masks ({self.backends[name].mask_layout}) with "
                        f"the others' ({self.mask_layout}) in one batch; leave it out of --grammar-backend-order"
                    )
        except Exception:
            self.shutdown()
            raise
        for pipeline in self.backends.values():
            pipeline.backend.require_exact = True
            pipeline.backend.closes_open_schemas = server_args.grammar_auto_allow_narrowing
        self.handover_s = server_args.grammar_compile_slow_after
        self._counts_lock = threading.Lock()
        self._num_chosen: Counter[str] = Counter()
        self._num_refused: Counter[str] = Counter()
        self._num_refused_by_all = 0

    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """The own grammar object of the backend that wins ``key`` (see the class), the choice in its stats; when
        every backend refuses or fails, an ``InvalidGrammarObject`` naming each one's reason. ``control``: this
        compile's deadline and cancellation, which the backends' compiles share (a deadline from now without)."""
        return self.build_exportable(key, control)[0]

    def build_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        """``build_grammar``, and the winner's own way to export its grammar, with this backend's stats: an xgrammar
        compile process's export as it came, not serialised again (which for a small grammar takes about as long as
        its compile, so the disk cache's keep rule would not write it; for a large one, seconds)."""
        start = time.perf_counter()
        control = control or CompileControl(self.server_args.compile_timeout_s)
        exports: dict[str, Callable[[], GrammarExport]] = {}
        chosen_name, chosen, passed_over = self._race(key, control, exports)
        result = chosen if chosen is not None else InvalidGrammarObject(refused_by_all_message(key[0], passed_over))
        stats = GrammarStats(
            dispatch_type=key[0],
            compile_time_s=time.perf_counter() - start,
            chosen_backend=chosen_name,
            fallback_reasons=tuple(passed_over),
            narrowing=chosen.grammar_stats.narrowing if chosen is not None and chosen.grammar_stats else None,
        )
        result.grammar_stats = stats
        self._record(key[0], chosen_name, passed_over)
        if chosen_name is None:
            return result, lambda: self.export_grammar(result)
        chosen_export = exports[chosen_name]
        return result, lambda: replace(chosen_export(), stats=stats)

    def _race(
        self, key: GrammarKey, control: CompileControl, exports: dict[str, Callable[[], GrammarExport]]
    ) -> tuple[str | None, BaseGrammarObject | None, list[tuple[str, str]]]:
        """``(winner, its grammar, [(backend, why passed over)])``; no winner when every backend refused or failed.
        ``exports`` receives, by backend, how to export each grammar compiled (``build_exportable``).

        The backends start in order, each when the ones before have refused or have compiled ``handover_s``
        alone; the compiles still running when one wins (or at the deadline: ``CompileTimeoutError``) are cancelled.
        """
        waiting = self._in_preferred_order(key)
        order = [name for name, _ in waiting]
        running: dict[str, Future[BaseGrammarObject]] = {}
        started_at: dict[str, float] = {}
        passed_over: list[tuple[str, str]] = []
        next_start = time.monotonic()
        try:
            while waiting or running:
                now = time.monotonic()
                if waiting and (not running or now >= next_start):
                    name, pipeline = waiting.pop(0)
                    compile_value = _exportable(pipeline.backend, name, exports)
                    running[name] = pipeline.compile_service.submit(key, control, compile_value)
                    started_at[name] = next_start = now
                    next_start += self.handover_s
                until = min(next_start, control.deadline) if waiting else control.deadline
                futures.wait(running.values(), timeout=max(0.0, until - now), return_when=futures.FIRST_COMPLETED)
                if control.remaining_s() <= 0 and not any(future.done() for future in running.values()):
                    raise CompileTimeoutError(f"{COMPILE_TIMEOUT_PREFIX} after {control.timeout_s:g} s")
                for name, future in list(running.items()):  # in the order's order: earlier backends win ties
                    if not future.done():
                        continue
                    del running[name]
                    grammar, failure = _outcome(future)
                    if grammar is not None:
                        for other in running:
                            elapsed = time.monotonic() - started_at[other]
                            passed_over.append((other, f"{STILL_COMPILING} after {elapsed:.1f} s when {name} was done"))
                        return name, grammar, passed_over
                    passed_over.append((name, failure))
        finally:
            for future in running.values():
                future.cancel()
        passed_over.sort(key=lambda refusal: order.index(refusal[0]))  # the message must not depend on timing
        return None, None, passed_over

    def choose_in_order(self) -> None:
        """Never start the next backend beside a slow one: the first backend of the order that compiles a constraint
        wins it, however long it takes within the deadline. For ranks in lockstep that each compile every
        constraint (a backend of the order cannot export its grammars, so rank 0 cannot compile for them): by
        timing, two of them could choose two engines for one request, whose grammars then disagree on a token one
        of them allowed (seen: rank 1 took llguidance for a schema while xgrammar compiled 1.0 s on it and rank 0
        took xgrammar). Refusals and compile errors do not depend on timing, so the ranks choose alike."""
        self.handover_s = math.inf

    def _in_preferred_order(self, key: GrammarKey) -> list[tuple[str, GrammarPipeline]]:
        """The backends of the order, those that take ``key`` as written first (``takes_as_written``)."""
        return sorted(self.backends.items(), key=lambda item: not item[1].backend.takes_as_written(key))

    @property
    def can_share_grammars(self) -> bool:
        return all(backend.can_share_grammars for backend in self.backends.values())

    def compile_identity(self) -> dict[str, Any]:
        """Its own and each backend's of the order, in order (their ``require_exact`` with them). The hand-over time
        is left out: it decides which exact backend wins a race, not what any of them compiles."""
        backends = [[name, backend.compile_identity()] for name, backend in self.backends.items()]
        return {**super().compile_identity(), "backends": backends}

    def export_grammar(self, grammar: BaseGrammarObject) -> GrammarExport:
        """The chosen backend's export; its stats name the chosen backend, which ``import_grammar`` asks."""
        if isinstance(grammar, InvalidGrammarObject) or grammar.grammar_stats is None:
            return super().export_grammar(grammar)
        chosen = self.backends[str(grammar.grammar_stats.chosen_backend)]
        return chosen.export_grammar(grammar)

    def import_grammar(self, export: GrammarExport) -> BaseGrammarObject:
        chosen = export.stats.chosen_backend if export.stats is not None else None
        if export.payload is None or chosen is None:
            return super().import_grammar(export)
        return self.backends[chosen].import_grammar(export)

    def choice_counts(self) -> AutoChoiceCounts:
        """A snapshot of the counters (safe to call from any thread)."""
        with self._counts_lock:
            return AutoChoiceCounts(dict(self._num_chosen), dict(self._num_refused), self._num_refused_by_all)

    def wait_until_ready(self) -> None:
        for backend in self.backends.values():
            backend.wait_until_ready()

    def shutdown(self) -> None:
        for backend in self.backends.values():
            backend.shutdown()

    def _record(self, key_type: str, chosen_name: str | None, refusals: list[tuple[str, str]]) -> None:
        with self._counts_lock:
            self._num_refused.update(name for name, _ in refusals)
            if chosen_name is None:
                self._num_refused_by_all += 1
            else:
                self._num_chosen[chosen_name] += 1
        if chosen_name is None:
            logger.info("auto: no backend compiles a %s constraint: %s", key_type, describe_refusals(refusals))
        elif refusals:
            logger.info(
                "auto chose %s for a %s constraint because %s", chosen_name, key_type, describe_refusals(refusals)
            )
        else:
            logger.debug("auto chose %s for a %s constraint", chosen_name, key_type)


def _exportable(
    backend: GrammarBackend, name: str, exports: dict[str, Callable[[], GrammarExport]]
) -> Callable[[GrammarKey, CompileControl], BaseGrammarObject]:
    """A compile in ``backend``'s slot that keeps in ``exports[name]`` how to export its grammar. (The backends of
    the order have no disk cache of their own: this is their pipelines' ``compile_or_load``.)"""

    def compile_value(key: GrammarKey, control: CompileControl) -> BaseGrammarObject:
        grammar, exports[name] = backend.build_exportable(key, control)
        return grammar

    return compile_value


def _outcome(future: Future[BaseGrammarObject]) -> tuple[BaseGrammarObject | None, str]:
    """A settled attempt as ``(valid grammar, "")`` or ``(None, why not)``."""
    if future.cancelled():
        return None, "its compile was cancelled"
    error = future.exception()
    if error is not None:
        return None, f"failed: {error}"
    grammar = future.result()
    if isinstance(grammar, InvalidGrammarObject):
        return None, grammar.error_message
    return grammar, ""


def describe_refusals(refusals: Sequence[tuple[str, str]]) -> str:
    """``"xgrammar refused: <reason>; llguidance, outlines refused: <reason>"`` for ``(backend, message)`` pairs in
    order, each message cut to its short reason (``refusal_reason``), backends with the same reason together."""
    grouped: dict[str, list[str]] = {}
    for name, message in refusals:
        grouped.setdefault(refusal_reason(message), []).append(name)
    return "; ".join(f"{', '.join(names)} refused: {reason}" for reason, names in grouped.items())


MAX_REFUSED_BY_ALL_CHARS = 640
"""The longest error of a constraint no backend compiles (each backend's reason, and the first one's whole)."""


def refused_by_all_message(key_type: str, refusals: Sequence[tuple[str, str]]) -> str:
    """The error of a constraint no backend of the order compiles: each backend's short reason, then the first
    backend's whole message as far as it fits (what a user of that backend alone would read: a regex's or grammar's
    parse error, say, where it is and what is wrong, which a short reason cuts)."""
    summary = f"no grammar backend of --grammar-backend-order compiles this {key_type} constraint"
    summary += f" ({describe_refusals(refusals)})"
    first, message = refusals[0]
    room = MAX_REFUSED_BY_ALL_CHARS - len(summary) - len(first) - 5
    if refusal_reason(message) == message or room < 40:
        return summary
    return f"{summary}; {first}: {bounded_message(message, limit=room)}"


def _build_backend(
    name: str, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> GrammarBackend:
    try:
        return grammar_backend_factory(name)(server_args, tokenizer, vocab_size, eos_token_ids)
    except ValueError as e:
        raise ValueError(
            f"--grammar-backend auto cannot build {name} (from --grammar-backend-order): {e}; leave it out of the order"
        ) from e
