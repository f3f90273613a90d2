"""``--grammar-backend auto``: each constraint is compiled by the first backend of ``--grammar-backend-order`` that
enforces it exactly.

Every backend refuses up front, naming it, what it would otherwise ignore (``*_schema_rules.py``); such a refusal,
or any other failure to compile, sends the constraint on to the next backend. The choice is made once, at compile
time: the grammar object cached and handed to requests is the chosen backend's own, so its masks and token steps
cost what that backend's cost, and one batch mixes backends because they all fill the contract's int32 bitmask
(``triton_ops.bitmask_format``). Each grammar's ``GrammarStats`` records the choice and the refusals before it,
the log says why at INFO, and ``choice_counts()`` feeds metrics.

The backends of the order are built at start-up with the server's settings, so their start-up costs add up (each
decodes the vocabulary). They compile on this backend's compile service, under its deadline and into its one
cache keyed by ``(type, spec)``; their own compile services stay idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
    GrammarExport,
    GrammarStats,
    InvalidGrammarObject,
)
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.errors import refusal_reason
from sglang_constrained.registry import AUTO_GRAMMAR_BACKEND, check_grammar_backend_order, grammar_backend_factory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoChoiceCounts:
    """Compiles so far (cache hits are not compiles): per backend, how many it was chosen for and how many it
    refused; and how many every backend refused."""

    num_chosen: dict[str, int]
    num_refused: dict[str, int]
    num_refused_by_all: int


class AutoGrammarBackend(BaseGrammarBackend):
    """Asks the backends of ``server_args.grammar_backend_order`` in turn; the first that compiles a key wins.

    ``backends`` maps each name of the order to its backend, in order.
    """

    name = AUTO_GRAMMAR_BACKEND

    def __init__(
        self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        check_grammar_backend_order(server_args.grammar_backend_order)
        super().__init__(server_args, vocab_size)
        self.backends: dict[str, BaseGrammarBackend] = {}
        try:
            for name in server_args.grammar_backend_order:
                self.backends[name] = _build_backend(name, server_args, tokenizer, vocab_size, eos_token_ids)
                if self.backends[name].mask_layout != self.mask_layout:
                    raise ValueError(
                        f"--grammar-backend auto cannot mix {name}'s masks ({self.backends[name].mask_layout}) with "
                        f"the others' ({self.mask_layout}) in one batch; leave it out of --grammar-backend-order"
                    )
        except Exception:
            self.shutdown()
            raise
        self._counts_lock = threading.Lock()
        self._num_chosen: Counter[str] = Counter()
        self._num_refused: Counter[str] = Counter()
        self._num_refused_by_all = 0

    def build_grammar(self, key: GrammarKey) -> BaseGrammarObject:
        """The own grammar object of the first backend that compiles ``key``, the choice in its stats; when every
        backend refuses, an ``InvalidGrammarObject`` naming each one's reason. A backend that raises (past its
        deadline, or crashed) did not refuse: the compile fails as it would on that backend alone."""
        start = time.perf_counter()
        refusals: list[tuple[str, str]] = []
        chosen: BaseGrammarObject | None = None
        chosen_name: str | None = None
        for name, backend in self._in_preferred_order(key):
            grammar = backend.build_grammar(key)
            if not isinstance(grammar, InvalidGrammarObject):
                chosen, chosen_name = grammar, name
                break
            refusals.append((name, grammar.error_message))
        result = chosen if chosen is not None else InvalidGrammarObject(refused_by_all_message(key[0], refusals))
        result.grammar_stats = GrammarStats(
            dispatch_type=key[0],
            compile_time_s=time.perf_counter() - start,
            chosen_backend=chosen_name,
            fallback_reasons=tuple(refusals),
        )
        self._record(key[0], chosen_name, refusals)
        return result

    def _in_preferred_order(self, key: GrammarKey) -> list[tuple[str, BaseGrammarBackend]]:
        """The backends of the order, those that take ``key`` as written first (``takes_as_written``)."""
        return sorted(self.backends.items(), key=lambda item: not item[1].takes_as_written(key))

    @property
    def can_share_grammars(self) -> bool:
        return all(backend.can_share_grammars for backend in self.backends.values())

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
        super().shutdown()

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


def describe_refusals(refusals: Sequence[tuple[str, str]]) -> str:
    """``"xgrammar refused: <reason>; llguidance, outlines refused: <reason>"`` for ``(backend, message)`` pairs in
    order, each message cut to its short reason (``refusal_reason``), backends with the same reason together."""
    grouped: dict[str, list[str]] = {}
    for name, message in refusals:
        grouped.setdefault(refusal_reason(message), []).append(name)
    return "; ".join(f"{', '.join(names)} refused: {reason}" for reason, names in grouped.items())


def refused_by_all_message(key_type: str, refusals: Sequence[tuple[str, str]]) -> str:
    """The error of a constraint no backend of the order compiles."""
    reasons = describe_refusals(refusals)
    return f"no grammar backend of --grammar-backend-order compiles this {key_type} constraint ({reasons})"


def _build_backend(
    name: str, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
) -> BaseGrammarBackend:
    try:
        return grammar_backend_factory(name)(server_args, tokenizer, vocab_size, eos_token_ids)
    except ValueError as e:
        raise ValueError(
            f"--grammar-backend auto cannot build {name} (from --grammar-backend-order): {e}; leave it out of the order"
        ) from e
