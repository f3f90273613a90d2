"""What a compiled xgrammar grammar costs to send out of its compile process, predicted before it is serialised.

A compile process sends its grammar back serialised (``CompiledGrammar.serialize_json``; the disk cache and shared
grammars keep that form too), and xgrammar 0.2.8 writes each rule's FSM with a copy of the whole grammar's FSM: the
serialised grammar grows with the grammar's rules times its size, quadratically in a schema's size, while the
compile itself takes milliseconds. The measure here, the rules times the expression entries of a grammar, predicts
that size, and the serialising process's peak memory and time grow in proportion to it (the constants are calibrated
by ``scripts/calibrate_xgrammar_export.py``; its figures are in docs/benchmarks.md).

A JSON schema is judged before its compile: xgrammar's compile barely changes a schema's grammar. A structural tag
or an EBNF grammar is judged after it (``GrammarMeasure.of_compiled``), before it is serialised: the compile merges
their rules, so that their measure before it overstates the size several times, and the compile takes well under the
serialising. The bytes per measure of schemas overstate tags' and EBNF's sizes: where the prediction errs, it errs on
the side of refusing (and ``auto`` then asks llguidance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xgrammar

from sglang_constrained.errors import GrammarSpecError

BYTES_PER_MEASURE = 6.0
"""Serialised bytes per rule x expression entry (measured 4.7-9.5, 5.9 on the largest). The token masks come on top
(a few MB, growing with the vocabulary: 200 properties serialise to 15 MB at 49k tokens, 25 MB at 248k)."""
PEAK_PER_BYTE = 14.5
"""The serialising process's growth per serialised byte (measured 11-15.5)."""
COMPILE_PROCESS_BASE_MIB = 300.0
"""A compile process's resident memory before it compiles (measured 216-228 MiB at 49k tokens, 255-281 at 248k)."""
SECONDS_PER_MB = 0.1
"""Serialising and reading back, per MB (measured 0.08-0.11 on 100-290 MB)."""


@dataclass(frozen=True)
class ExportCost:
    """A compiled grammar's predicted serialised size, the compile process's resident memory at its peak while it
    serialises it, and the time to serialise it and read it back."""

    num_bytes: int
    peak_mib: float
    seconds: float


@dataclass(frozen=True)
class GrammarMeasure:
    """The size of an xgrammar ``Grammar`` before compiling: its rules and its expression entries."""

    num_rules: int
    num_expression_entries: int

    @classmethod
    def of(cls, grammar: xgrammar.Grammar) -> GrammarMeasure:
        serialized = json.loads(grammar.serialize_json())
        return cls(len(serialized["rules"]), len(serialized["grammar_expr_data"]))

    @classmethod
    def of_compiled(cls, compiled: xgrammar.CompiledGrammar) -> GrammarMeasure | None:
        """The measure of the grammar xgrammar compiled, after the compile's optimisations, read from its printed
        form (serialising it would cost what is predicted); None if that form does not parse back."""
        try:
            return cls.of(xgrammar.Grammar.from_ebnf(str(compiled.grammar), root_rule_name="root"))
        except RuntimeError:
            return None

    @property
    def product(self) -> int:
        return self.num_rules * self.num_expression_entries

    def predicted_export(self) -> ExportCost:
        num_bytes = int(BYTES_PER_MEASURE * self.product)
        peak_mib = COMPILE_PROCESS_BASE_MIB + PEAK_PER_BYTE * num_bytes / 2**20
        return ExportCost(num_bytes, peak_mib, SECONDS_PER_MB * num_bytes / 1e6)


def refuse_costly_export(
    measure: GrammarMeasure, max_memory_mib: int | None, deadline_s: float, what: str, compiled: bool = False
) -> None:
    """Raise ``GrammarSpecError`` when ``measure`` predicts that sending the compiled grammar out of a compile
    process needs more than ``max_memory_mib`` (None: no bound) or takes longer than ``deadline_s``, naming the
    measure, the prediction and the bound; ``compiled``: the measure is the compiled grammar's (``of_compiled``),
    not the grammar's before its compile."""
    cost = measure.predicted_export()
    if max_memory_mib is not None and cost.peak_mib > max_memory_mib:
        bound = f"the memory bound of {max_memory_mib:,} MiB (--grammar-compile-max-memory)"
        beyond = f"about {cost.peak_mib:,.0f} MiB, over {bound}"
    elif cost.seconds > deadline_s:
        beyond = (
            f"about {cost.seconds:.0f} s, beyond the compile deadline of {deadline_s:g} s (--grammar-compile-timeout)"
        )
    else:
        return
    size = f"{measure.num_rules:,} rules over {measure.num_expression_entries:,} expression entries"
    grammar = f"compiles to a grammar of {size}" if compiled else f"has a grammar of {size}"
    llguidance = "such schemas in milliseconds" if what == "JSON schema" else "such grammars without this cost"
    raise GrammarSpecError(
        f"the {what} {grammar}, which predict an xgrammar compiled grammar of about {cost.num_bytes / 1e6:,.0f} MB "
        f"(xgrammar writes every rule with the whole grammar's FSM); a compile process sending it back would take "
        f"{beyond}; llguidance compiles {llguidance} (--grammar-backend llguidance or auto)"
    )
