"""What ``auto`` must do with a MaskBench case, derived from the other backends' records (``with_auto``)."""

from __future__ import annotations

from sglang_constrained.testing.conformance import ConformanceResult, KnownOutcomes

RECORDED = KnownOutcomes(
    refusals={"first": {"both": "feature 'not' (at /)", "only-first": "feature 'if' (at /)"}, "second": {"both": "x"}},
    deviations={
        "first": {"tok": {"narrowed-by-first": "strict"}},
        "second": {"tok": {"only-first": "closed", "narrowed-by-first": "closed"}},
    },
    deviation_reasons={"strict": "...", "closed": "..."},
)
AUTO = RECORDED.with_auto(["first", "second"])


def test_a_case_every_backend_refuses_is_refused_with_each_reason() -> None:
    assert AUTO.refusals["auto"] == {"both": "first refused: feature 'not' (at /); second refused: x"}


def test_a_case_deviates_as_the_backend_that_compiles_it() -> None:
    assert AUTO.deviations["auto"] == {"tok": {"narrowed-by-first": "strict", "only-first": "closed"}}


def test_auto_must_choose_the_first_backend_the_records_have_compile_it() -> None:
    chosen_right = ConformanceResult("only-first", chosen_backend="second", wrongly_rejected=["{}"])
    chosen_wrong = ConformanceResult("only-first", chosen_backend="first", wrongly_rejected=["{}"])
    assert AUTO.problems("auto", "tok", chosen_right) == []
    assert AUTO.problems("auto", "tok", chosen_wrong) == ["auto chose first, but the records have second compile it"]
