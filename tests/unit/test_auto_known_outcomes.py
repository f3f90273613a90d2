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
NARROWED = {
    "first": {"narrowed-by-first": "narrows 'array items' (at /a)"},
    "second": {"narrowed-by-first": "narrows 'unlisted properties' (at /)"},
}
AUTO = RECORDED.with_auto(["first", "second"], NARROWED)


def test_a_case_every_backend_refuses_or_would_narrow_is_refused_with_each_reason() -> None:
    assert AUTO.refusals["auto"] == {
        "both": "first refused: feature 'not' (at /); second refused: x",
        "narrowed-by-first": "first refused: narrows 'array items' (at /a); second refused: narrows 'unlisted "
        "properties' (at /)",
    }


def test_auto_enforces_what_it_compiles_exactly() -> None:
    assert AUTO.deviations["auto"] == {}
    narrowing = ConformanceResult("only-first", chosen_backend="second", wrongly_rejected=["{}"])
    assert AUTO.problems("auto", "tok", narrowing) == ["valid instances rejected (not listed in "
                                                      "known_deviations.json): ['{}']"]  # fmt: skip


def test_auto_must_choose_the_first_backend_the_records_have_compile_it() -> None:
    chosen_right = ConformanceResult("only-first", chosen_backend="second")
    chosen_wrong = ConformanceResult("only-first", chosen_backend="first")
    assert AUTO.problems("auto", "tok", chosen_right) == []
    assert AUTO.problems("auto", "tok", chosen_wrong) == ["auto chose first, but the records have second compile it"]


def test_a_backend_passed_over_as_still_compiling_lets_the_next_one_win() -> None:
    handed_over = ConformanceResult(
        "compiled-by-both",
        chosen_backend="second",
        fallback_reasons=(("first", "still compiling after 1.0 s when second was done"),),
    )
    not_handed_over = ConformanceResult("compiled-by-both", chosen_backend="second")
    assert AUTO.problems("auto", "tok", handed_over) == []
    assert AUTO.problems("auto", "tok", not_handed_over) == ["auto chose second, but the records have first compile it"]
