"""Check a backend against cases of known answer: valid texts are accepted to their end, invalid ones rejected.

Shared by the conformance test suite and ``scripts/conformance_report.py``, so that the figures the script
prints are the ones the tests assert on, and both judge a MaskBench case against the same recorded outcomes:
``known_refusals.json`` (schemas a backend refuses, with the reason its message must give) and
``known_deviations.json`` (valid instances an engine wrongly rejects, with the measured reason). What ``auto`` must
do is derived from the other backends' records (``KnownOutcomes.with_auto``), not recorded again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from sglang_constrained.backends.auto import (
    MAX_REFUSED_BY_ALL_CHARS,
    STILL_COMPILING,
    AutoGrammarBackend,
    describe_refusals,
)
from sglang_constrained.backends.base import BaseGrammarBackend, BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import AUTO_GRAMMAR_BACKEND
from sglang_constrained.constraint_spec import GrammarKey, make_grammar_key
from sglang_constrained.errors import CompileProcessError, CompileTimeoutError, refusal_reason
from sglang_constrained.testing.maskbench import MaskBenchCase
from sglang_constrained.testing.random_walk import Judge, WalkTally, json_judge, walk_and_judge
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup

KNOWN_REFUSALS_FILE = "known_refusals.json"
KNOWN_DEVIATIONS_FILE = "known_deviations.json"
MAX_REFUSAL_CHARS = 400
"""A refusal's message is shown to the user as the request's error: it must name the reason, briefly."""


@dataclass
class ConformanceResult:
    """Outcome of one constraint: did it compile, and which texts were wrongly rejected or accepted.

    ``seconds`` is what the constraint cost the backend (compile plus walks), whatever ran alongside it.
    ``chosen_backend`` and ``fallback_reasons`` are ``auto``'s choice (``GrammarStats``).
    """

    name: str
    compile_error: str | None = None
    num_valid: int = 0
    num_valid_accepted: int = 0
    num_invalid: int = 0
    num_invalid_rejected: int = 0
    wrongly_rejected: list[str] = field(default_factory=list)
    wrongly_accepted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    walks: WalkTally = field(default_factory=WalkTally)
    chosen_backend: str | None = None
    fallback_reasons: tuple[tuple[str, str], ...] = ()

    @property
    def compiled(self) -> bool:
        return self.compile_error is None

    def is_fully_right(self, is_known_narrowing: bool) -> bool:
        """Compiled, no invalid text or walk output let through, and every valid text accepted (unless the valid
        texts it rejects are a recorded narrowing: ``is_known_narrowing``)."""
        return (
            self.compiled
            and not self.wrongly_accepted
            and not self.walks.invalid_outputs
            and (not self.wrongly_rejected or is_known_narrowing)
        )


def compile_grammar(backend: GrammarPipeline, key: GrammarKey) -> BaseGrammarObject:
    """The grammar for ``key``, waiting for its compile (a fresh object each call); a compile past its deadline or
    whose process failed is an invalid grammar saying so, as a request would be told."""
    value, _ = backend.get_cached_or_future_value(key)
    if isinstance(value, BaseGrammarObject):
        return value
    try:
        return value.result()
    except (CompileTimeoutError, CompileProcessError) as e:
        return InvalidGrammarObject(str(e))


def check_constraint(
    backend: GrammarPipeline,
    setup: TokenizerSetup,
    name: str,
    key: GrammarKey,
    valid_texts: tuple[str, ...] | list[str],
    invalid_texts: tuple[str, ...] | list[str],
    judge: Judge | None = None,
    num_walks: int = 0,
) -> ConformanceResult:
    """Compile ``key`` once, then walk every text through a fresh copy of the grammar; with a ``judge``, also
    ``num_walks`` random walks through its own masks (``random_walk``), whose outputs the judge must accept."""
    result = ConformanceResult(name, num_valid=len(valid_texts), num_invalid=len(invalid_texts))
    grammar = compile_grammar(backend, key)
    if grammar.grammar_stats is not None:
        result.seconds = grammar.grammar_stats.compile_time_s
        result.chosen_backend = grammar.grammar_stats.chosen_backend
        result.fallback_reasons = grammar.grammar_stats.fallback_reasons
    if isinstance(grammar, InvalidGrammarObject):
        result.compile_error = grammar.error_message
        return result
    start = time.perf_counter()
    forbidden = setup.forbidden_token_ids
    for text in valid_texts:
        walk = walk_tokens(grammar.copy(), setup.encode(text), setup.vocab_size, setup.eos_token_ids, forbidden)
        if walk.is_accepted:
            result.num_valid_accepted += 1
        else:
            result.wrongly_rejected.append(text)
    for text in invalid_texts:
        walk = walk_tokens(grammar.copy(), setup.encode(text), setup.vocab_size, setup.eos_token_ids, forbidden)
        if walk.is_accepted:
            result.wrongly_accepted.append(text)
        else:
            result.num_invalid_rejected += 1
    if judge is not None and num_walks:
        result.walks = walk_and_judge(grammar, setup, judge, num_walks, seed=len(name))
    result.seconds += time.perf_counter() - start
    return result


class MaskBenchSweep:
    """Checks MaskBench cases on one backend in a planned order, with the next compiles already queued.

    The backend's compile threads then work while this thread walks. Only ``ahead`` compiles are queued at a
    time: a compile that waits for a slot until its deadline fails, so queuing a whole sweep at once would fail
    the later ones before a thread takes them up.
    """

    def __init__(
        self,
        backend: GrammarPipeline,
        setup: TokenizerSetup,
        planned: Sequence[MaskBenchCase],
        ahead: int = 2,
        num_walks: int = 0,
    ) -> None:
        """``num_walks``: random walks per compiled case, each output judged by the case's schema."""
        self.backend = backend
        self.setup = setup
        self.ahead = ahead
        self.num_walks = num_walks
        self._keys = [make_grammar_key("json", case.schema) for case in planned]
        self._positions = {case.name: position for position, case in enumerate(planned)}

    def check(self, case: MaskBenchCase) -> ConformanceResult:
        """``check_constraint`` for ``case``'s schema and instances; the compile is not kept in the cache."""
        key = make_grammar_key("json", case.schema)
        self.backend.get_cached_or_future_value(key)  # first in the queue, before the ones it makes room for
        position = self._positions.get(case.name)
        if position is not None:
            for upcoming in self._keys[position + 1 : position + 1 + self.ahead]:
                self.backend.get_cached_or_future_value(upcoming)
        judge = json_judge(case.schema) if self.num_walks else None
        result = check_constraint(
            self.backend,
            self.setup,
            case.name,
            key,
            case.valid_instances,
            case.invalid_instances,
            judge,
            self.num_walks,
        )
        self.backend.discard_pending(key)
        return result


def exact_mode_narrowings(auto: AutoGrammarBackend, cases: Sequence[MaskBenchCase]) -> dict[str, dict[str, str]]:
    """Backend -> case -> the short reason (``refusal_reason``) why ``auto``'s backend would narrow the case's
    schema (as it takes it: closed first where narrowing is allowed), so that ``auto`` refuses it there
    (``KnownOutcomes.with_auto``). Looks at the schemas only."""
    narrowed: dict[str, dict[str, str]] = {}
    for name, pipeline in auto.backends.items():
        backend = pipeline.backend
        if not isinstance(backend, BaseGrammarBackend) or not backend.require_exact:
            continue
        for case in cases:
            narrowing = backend.json_schema_narrowing(backend.closed_schema(case.schema))
            if narrowing is not None:
                narrowed.setdefault(name, {})[case.name] = refusal_reason(narrowing)
    return narrowed


def known_refusals_from(messages: Mapping[str, Mapping[str, Mapping[str, str]]]) -> dict[str, dict[str, str]]:
    """``known_refusals.json``'s content from a whole sweep's refusal messages, backend -> tokenizer -> case.

    Refusals are recorded per backend only: every refusal so far depends on the schema alone, not on the
    vocabulary. A backend that refuses a case at one tokenizer but not (or otherwise) at another is an error.
    """
    recorded: dict[str, dict[str, str]] = {}
    for backend, per_tokenizer in messages.items():
        reasons = {
            tokenizer: {case: refusal_reason(m) for case, m in cases.items()}
            for tokenizer, cases in per_tokenizer.items()
        }
        first = next(iter(reasons.values()))
        for tokenizer, other in reasons.items():
            if other != first:
                differing = sorted(set(first.items()) ^ set(other.items()))[:3]
                raise ValueError(
                    f"{backend} refuses differently at {tokenizer}: {differing}; known_refusals.json keys refusals "
                    "by backend alone"
                )
        recorded[backend] = dict(sorted(first.items()))
    return recorded


@dataclass(frozen=True)
class KnownOutcomes:
    """What the data files record a backend does with a MaskBench case, and the judgement of a result against it.

    ``refusals``: backend -> case -> the reason the refusal message must contain. ``deviations``: backend ->
    tokenizer -> case -> a key of ``deviation_reasons``. ``auto_order`` and ``auto_narrowed``: the order ``auto``'s
    outcomes were derived for, and the cases each backend of it would narrow (``with_auto``), empty until then.
    """

    refusals: dict[str, dict[str, str]]
    deviations: dict[str, dict[str, dict[str, str]]]
    deviation_reasons: dict[str, str]
    auto_order: tuple[str, ...] = ()
    auto_narrowed: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path) -> KnownOutcomes:
        """Read both files in ``root``; raises ``ValueError`` for a deviation whose reason is not described."""
        deviations_file = json.loads((root / KNOWN_DEVIATIONS_FILE).read_text(encoding="utf-8"))
        known = cls(
            refusals=json.loads((root / KNOWN_REFUSALS_FILE).read_text(encoding="utf-8")),
            deviations=deviations_file["deviations"],
            deviation_reasons=deviations_file["reasons"],
        )
        for backend, per_tokenizer in known.deviations.items():
            for tokenizer, cases in per_tokenizer.items():
                for case, reason in cases.items():
                    if reason not in known.deviation_reasons:
                        raise ValueError(
                            f"{KNOWN_DEVIATIONS_FILE}: {backend}/{tokenizer}/{case} has no reason {reason!r}"
                        )
        return known

    def with_auto(self, order: Sequence[str], narrowed: Mapping[str, Mapping[str, str]] | None = None) -> KnownOutcomes:
        """These outcomes plus what ``auto`` over ``order`` must do, derived from the backends' own records.

        ``auto`` compiles a case with the first backend of ``order`` that neither refuses it nor would narrow it
        (``narrowed``: backend -> case -> the reason, from ``exact_mode_narrowings``), and enforces it exactly (no
        deviations); a case every backend refuses or would narrow is refused with each one's reason
        (``describe_refusals``).
        """
        known = replace(self, auto_order=tuple(order), auto_narrowed=dict(narrowed or {}))
        candidates = set.union(*(set(self.refusals.get(backend, {})) for backend in order))
        candidates |= {case for cases in known.auto_narrowed.values() for case in cases}
        auto_refusals = {
            case: describe_refusals([(backend, str(known._passes_over(backend, case))) for backend in order])
            for case in sorted(candidates)
            if known._first_compiling(order, case) is None
        }
        return replace(
            known,
            refusals={**self.refusals, AUTO_GRAMMAR_BACKEND: auto_refusals},
            deviations={**self.deviations, AUTO_GRAMMAR_BACKEND: {}},
        )

    def _passes_over(self, backend: str, case: str) -> str | None:
        """Why ``auto`` passes ``case`` over on ``backend`` (its refusal, or its narrowing), or None."""
        return self.refusal(backend, case) or self.auto_narrowed.get(backend, {}).get(case)

    def _first_compiling(self, order: Sequence[str], case: str) -> str | None:
        return next((backend for backend in order if self._passes_over(backend, case) is None), None)

    def refusal(self, backend: str, case: str) -> str | None:
        return self.refusals.get(backend, {}).get(case)

    def deviation(self, backend: str, tokenizer: str, case: str) -> str | None:
        return self.deviations.get(backend, {}).get(tokenizer, {}).get(case)

    def problems(self, backend: str, tokenizer: str, result: ConformanceResult) -> list[str]:
        """Every way ``result`` disagrees with the record, both ways; empty when the backend behaved as recorded.

        A refusal must be listed with a reason its (bounded) message contains, and a listed refusal must still
        happen; a deviation must be listed, and a listed one must still happen; no invalid text may be accepted;
        ``auto`` must choose the first backend of its order that the record has compile the case (after those it
        passed over as still compiling when another was done).
        """
        expected_refusal = self.refusal(backend, result.name)
        deviation = self.deviation(backend, tokenizer, result.name)
        problems = []
        if backend == AUTO_GRAMMAR_BACKEND and self.auto_order:
            slow = {name for name, reason in result.fallback_reasons if reason.startswith(STILL_COMPILING)}
            expected = self._first_compiling([b for b in self.auto_order if b not in slow], result.name)
            if result.chosen_backend != expected:
                problems.append(f"auto chose {result.chosen_backend}, but the records have {expected} compile it")
        if result.compile_error is not None:
            message = result.compile_error
            limit = MAX_REFUSED_BY_ALL_CHARS if backend == AUTO_GRAMMAR_BACKEND else MAX_REFUSAL_CHARS
            if len(message) > limit:
                problems.append(f"the refusal message has {len(message)} characters (at most {limit})")
            if expected_refusal is None:
                problems.append(f"refused, and not listed in {KNOWN_REFUSALS_FILE}: {message}")
            elif expected_refusal not in message:
                problems.append(
                    f"refused for another reason than {KNOWN_REFUSALS_FILE} lists ({expected_refusal!r}): {message}"
                )
            if deviation is not None:
                problems.append(f"refused, so its deviation no longer happens: remove it from {KNOWN_DEVIATIONS_FILE}")
            return problems
        if expected_refusal is not None:
            problems.append(f"compiles now: remove it from {KNOWN_REFUSALS_FILE} (listed as {expected_refusal!r})")
        if deviation is None and result.wrongly_rejected:
            problems.append(
                f"valid instances rejected (not listed in {KNOWN_DEVIATIONS_FILE}): {result.wrongly_rejected}"
            )
        if deviation is not None and not result.wrongly_rejected:
            problems.append(
                f"a known deviation ({deviation}) no longer happens: remove it from {KNOWN_DEVIATIONS_FILE}"
            )
        if result.wrongly_accepted:
            problems.append(f"invalid instances accepted: {result.wrongly_accepted}")
        problems += [f"the mask let an invalid output through: {output}" for output in result.walks.invalid_outputs]
        return problems
