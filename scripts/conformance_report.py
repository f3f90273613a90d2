"""Conformance figures per backend and tokenizer over MaskBench: the same checks the conformance tests run.

    python scripts/conformance_report.py                    # the suite's cases (tests/data/maskbench), all of them
    python scripts/conformance_report.py --data ../shared/data/jsonschemabench/maskbench --limit 200
    python scripts/conformance_report.py --write-known-refusals   # re-record the suite's known_refusals.json

Prints, per backend and tokenizer and then per folder: schemas compiled / total, schemas fully right / total
(compiled, every invalid instance and walk output rejected, every valid instance accepted but for a recorded
narrowing), schemas exact / total (the same, no narrowing excused: the coverage), valid instances fully accepted
/ total and invalid instances rejected / total (over compiled schemas), invalid outputs / finished random walks
through each compiled schema's own masks (``--walks`` per schema, each output's raw bytes judged as strict UTF-8
before its JSON; must be 0), and the seconds compiles and walks took; then, per tokenizer and folder, ``auto``'s
coverage against each backend's and the best single backend's; then the refusals grouped by reason, which backend
``auto`` chose and why, each invalid output (its case, walk and reason: for bytes that are not UTF-8, the tokens
that spelled them), and the cases that cost the backends most (the conformance test keeps those out of its default
sample). Where the data folder holds known_refusals.json and known_deviations.json (the suite's does), every case is
judged as the conformance test judges it (``auto`` against what the other backends' records and its backends'
narrowings imply): each disagreement is printed on a line starting with "!!" and the exit status is 1. Details go to
results/conformance.json.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import Counter
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path

from scheduler.server_args import GrammarArgs, ModelArgs
from sglang_constrained.backends.auto import AutoGrammarBackend, describe_refusals
from sglang_constrained.backends.registry import AUTO_GRAMMAR_BACKEND, create_grammar_backend
from sglang_constrained.errors import refusal_reason
from sglang_constrained.testing.conformance import (
    KNOWN_DEVIATIONS_FILE,
    KNOWN_REFUSALS_FILE,
    ConformanceResult,
    KnownOutcomes,
    MaskBenchSweep,
    exact_mode_narrowings,
    known_refusals_from,
)
from sglang_constrained.testing.maskbench import MaskBenchCase, iter_case_paths, load_case
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDED_BACKENDS = ("xgrammar", "llguidance", "outlines")
"""The backends whose refusals known_refusals.json records; ``auto``'s outcomes follow from theirs."""
BACKENDS = (*RECORDED_BACKENDS, AUTO_GRAMMAR_BACKEND)
ROW = "{:<11} {:<9} {:<15} {:>13} {:>13} {:>13} {:>16} {:>18} {:>16} {:>7}"


def versus_row(num_singles: int) -> str:
    """The coverage table's row format: tokenizer, folder, each single backend, auto, the best, auto less the best."""
    return "{:<9} {:<15} " + "{:>13} " * (num_singles + 1) + "{:>24} {:>9}"


_POINTER = re.compile(r" \(at [^)]*\)")


@dataclass
class Tally:
    num_schemas: int = 0
    num_compiled: int = 0
    num_fully_right: int = 0
    num_exact: int = 0
    num_valid: int = 0
    num_valid_accepted: int = 0
    num_invalid: int = 0
    num_invalid_rejected: int = 0
    num_walks_finished: int = 0
    num_invalid_outputs: int = 0
    seconds: float = 0.0

    def add(self, result: ConformanceResult, is_fully_right: bool) -> None:
        self.num_schemas += 1
        self.seconds += result.seconds
        if not result.compiled:
            return
        self.num_compiled += 1
        self.num_fully_right += is_fully_right
        self.num_exact += result.is_fully_right(is_known_narrowing=False)
        self.num_valid += result.num_valid
        self.num_valid_accepted += result.num_valid_accepted
        self.num_invalid += result.num_invalid
        self.num_invalid_rejected += result.num_invalid_rejected
        self.num_walks_finished += result.walks.num_finished
        self.num_invalid_outputs += len(result.walks.invalid_outputs)

    def __add__(self, other: Tally) -> Tally:
        return Tally(*(mine + theirs for mine, theirs in zip(astuple(self), astuple(other), strict=True)))

    def row(self, backend: str, tokenizer: str, folder: str) -> str:
        return ROW.format(
            backend,
            tokenizer,
            folder,
            f"{self.num_compiled}/{self.num_schemas}",
            f"{self.num_fully_right}/{self.num_schemas}",
            f"{self.num_exact}/{self.num_schemas}",
            f"{self.num_valid_accepted}/{self.num_valid}",
            f"{self.num_invalid_rejected}/{self.num_invalid}",
            f"{self.num_invalid_outputs}/{self.num_walks_finished}",
            f"{self.seconds:.1f}s",
        )


@dataclass
class PairReport:
    """One backend at one tokenizer: totals per folder, refusal messages, the cases it got wrong, costs; for ``auto``
    the backend chosen per case and the ``(backend, message)`` refusals before the choice."""

    backend: str
    tokenizer: str
    seconds: float = 0.0
    folders: dict[str, Tally] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)
    wrongly_rejected_cases: list[str] = field(default_factory=list)
    wrongly_accepted_cases: list[str] = field(default_factory=list)
    invalid_outputs: dict[str, list[str]] = field(default_factory=dict)
    case_seconds: dict[str, float] = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)
    choices: dict[str, str | None] = field(default_factory=dict)
    fallbacks: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def add(self, case: MaskBenchCase, result: ConformanceResult, known: KnownOutcomes | None) -> None:
        """Count ``result``, judged against ``known`` when the data folder records outcomes."""
        if known is not None:
            problems = known.problems(self.backend, self.tokenizer, result)
            if problems:
                self.problems[case.name] = problems
        is_known_narrowing = known is not None and known.deviation(self.backend, self.tokenizer, case.name) is not None
        self.folders.setdefault(case.folder, Tally()).add(result, result.is_fully_right(is_known_narrowing))
        self.case_seconds[case.name] = result.seconds
        if self.backend == AUTO_GRAMMAR_BACKEND:
            self.choices[case.name] = result.chosen_backend
            if result.fallback_reasons:
                self.fallbacks[case.name] = result.fallback_reasons
        if result.compile_error is not None:
            self.refusals[case.name] = result.compile_error
        if result.wrongly_rejected:
            self.wrongly_rejected_cases.append(case.name)
        if result.wrongly_accepted:
            self.wrongly_accepted_cases.append(case.name)
        if result.walks.invalid_outputs:
            self.invalid_outputs[case.name] = result.walks.invalid_outputs

    def refusal_reasons(self, case: str) -> str:
        """The short reason of a refused case: each backend's, for ``auto``."""
        if case in self.fallbacks:
            return describe_refusals(self.fallbacks[case])
        return refusal_reason(self.refusals[case])


def run(
    server_args: GrammarArgs,
    setup: TokenizerSetup,
    cases: list[MaskBenchCase],
    num_walks: int,
    recorded: KnownOutcomes | None,
) -> PairReport:
    """``server_args.grammar_backend`` over ``cases``, judged against ``recorded`` (``auto``: against what it
    implies)."""
    backend_name = server_args.grammar_backend
    backend = create_grammar_backend(server_args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert backend is not None
    backend.wait_until_ready()
    known = recorded
    if recorded is not None and isinstance(backend.backend, AutoGrammarBackend):
        auto = backend.backend
        known = recorded.with_auto(tuple(auto.backends), exact_mode_narrowings(auto, cases))
    sweep = MaskBenchSweep(backend, setup, cases, num_walks=num_walks)
    report = PairReport(backend_name, setup.name)
    start = time.perf_counter()
    for case in cases:
        report.add(case, sweep.check(case), known)
    report.seconds = time.perf_counter() - start
    backend.shutdown()
    return report


def print_table(report: PairReport) -> None:
    total = sum(report.folders.values(), Tally())
    print(total.row(report.backend, report.tokenizer, "(all)"))
    for folder, tally in sorted(report.folders.items()):
        print(tally.row("", "", folder))


def print_auto_versus_best(reports: list[PairReport]) -> None:
    """Per tokenizer and folder: each backend's coverage (schemas exact), ``auto``'s, and ``auto`` less the best
    single backend's (never below 0 is the aim)."""
    by_pair = {(report.backend, report.tokenizer): report for report in reports}
    singles = [name for name in RECORDED_BACKENDS if any(name == backend for backend, _ in by_pair)]
    tokenizers = [tokenizer for backend, tokenizer in by_pair if backend == AUTO_GRAMMAR_BACKEND]
    if not tokenizers or not singles:
        return
    print("coverage (schemas exact / total): auto against each backend alone and the best of them")
    row = versus_row(len(singles))
    print(row.format("tokenizer", "folder", *(f"{name:.13}" for name in singles), "auto", "best", "auto-best"))
    for tokenizer in tokenizers:
        auto = by_pair[AUTO_GRAMMAR_BACKEND, tokenizer]
        for folder in [*sorted(auto.folders), "(all)"]:
            tallies = {name: _folder_tally(by_pair[name, tokenizer], folder) for name in singles}
            auto_tally = _folder_tally(auto, folder)
            best = max(tallies, key=lambda name: tallies[name].num_exact)
            cells = [f"{tally.num_exact}/{tally.num_schemas}" for tally in tallies.values()]
            versus = auto_tally.num_exact - tallies[best].num_exact
            best_cell = f"{best} {tallies[best].num_exact}/{tallies[best].num_schemas}"
            print(row.format(tokenizer, folder, *cells, f"{auto_tally.num_exact}/{auto_tally.num_schemas}", best_cell,
                             f"{versus:+d}"))  # fmt: skip


def _folder_tally(report: PairReport, folder: str) -> Tally:
    return sum(report.folders.values(), Tally()) if folder == "(all)" else report.folders.get(folder, Tally())


def print_refusals(reports: list[PairReport]) -> None:
    """The refusals grouped by reason (leaving out where the feature was); once per backend if its tokenizers agree."""
    printed: dict[str, PairReport] = {}
    for report in reports:
        same = printed.get(report.backend)
        if same is not None and same.refusals == report.refusals:
            print(
                f"{report.backend} at {report.tokenizer} refuses the same {len(report.refusals)} as at {same.tokenizer}"
            )
            continue
        printed.setdefault(report.backend, report)
        reasons = Counter(_POINTER.sub("", report.refusal_reasons(case)) for case in report.refusals)
        print(f"{report.backend} at {report.tokenizer} refuses {len(report.refusals)} schemas:")
        for reason, count in reasons.most_common():
            print(f"  {count:>4}  {reason}")


def print_auto_choices(reports: list[PairReport]) -> None:
    """Which backend ``auto`` chose, and why it passed over the ones before it (reasons without their pointers)."""
    for report in reports:
        if report.backend != AUTO_GRAMMAR_BACKEND:
            continue
        chosen = Counter(backend for backend in report.choices.values() if backend is not None)
        print(
            f"auto at {report.tokenizer} chose "
            + ", ".join(f"{backend} for {count}" for backend, count in chosen.most_common())
            + f"; every backend refused {len(report.refusals)} of {len(report.choices)}"
        )
        fell_back = Counter(
            f"{report.choices[case]} because {_POINTER.sub('', describe_refusals(reasons))}"
            for case, reasons in report.fallbacks.items()
            if report.choices[case] is not None
        )
        for reason, count in fell_back.most_common():
            print(f"  {count:>4}  {reason}")


def print_invalid_outputs(reports: list[PairReport]) -> None:
    """Every invalid output of the random walks, with its case, walk and what was wrong (the tokens, for bytes)."""
    for report in reports:
        for case, outputs in report.invalid_outputs.items():
            for output in outputs:
                print(f"invalid output: {report.backend} {report.tokenizer} {case} {output}")


def print_costliest(reports: list[PairReport], slow_s: float) -> None:
    """Cases whose cost summed over the backends and tokenizers run exceeds ``slow_s``, costliest first."""
    costs: Counter[str] = Counter()
    for report in reports:
        costs.update(report.case_seconds)
    costly = [(name, seconds) for name, seconds in costs.most_common() if seconds > slow_s]
    print(f"{len(costly)} cases cost more than {slow_s:g} s summed over the backends and tokenizers run:")
    for name, seconds in costly:
        parts = sorted(((r.case_seconds[name], f"{r.backend}+{r.tokenizer}") for r in reports), reverse=True)
        print(f"  {name:<45} {seconds:>5.0f} s  ({', '.join(f'{pair} {s:.0f} s' for s, pair in parts if s >= 1)})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=REPO_ROOT / "tests" / "data" / "maskbench")
    parser.add_argument("--limit", type=int, default=None, help="at most this many schemas per folder")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS))
    parser.add_argument("--tokenizers", nargs="+", default=list(TOKENIZER_SETUPS))
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "results" / "conformance.json")
    parser.add_argument("--slow", type=float, default=5.0, help="list cases costing more seconds than this")
    parser.add_argument(
        "--walks", type=int, default=3, help="random walks per compiled schema, each output judged (0: none)"
    )
    parser.add_argument(
        "--compile-timeout",
        type=float,
        default=None,
        help="seconds a compile may take (default: the server's); a compile past it counts as a refusal",
    )
    parser.add_argument(
        "--write-known-refusals",
        action="store_true",
        help=f"record this run's refusals in DATA/{KNOWN_REFUSALS_FILE} (needs every backend, tokenizer and case)",
    )
    options = parser.parse_args()
    is_whole_sweep = (
        options.limit is None
        and set(options.backends) >= set(RECORDED_BACKENDS)
        and set(options.tokenizers) == set(TOKENIZER_SETUPS)
    )
    if options.write_known_refusals and not is_whole_sweep:
        parser.error(
            f"--write-known-refusals needs the whole sweep: {', '.join(RECORDED_BACKENDS)}, every tokenizer, no --limit"
        )
    recorded = None
    if (options.data / KNOWN_REFUSALS_FILE).exists() and (options.data / KNOWN_DEVIATIONS_FILE).exists():
        recorded = KnownOutcomes.load(options.data)

    folders = sorted(p.name for p in options.data.iterdir() if p.is_dir())
    cases = [load_case(p) for folder in folders for p in iter_case_paths(options.data, folder, options.limit)]
    print(f"{len(cases)} schemas from {options.data} ({', '.join(folders)})")
    print(
        ROW.format(
            "backend",
            "tokenizer",
            "folder",
            "compiled",
            "fully right",
            "exact",
            "valid accepted",
            "invalid rejected",
            "invalid outputs",
            "time",
        )
    )
    reports: list[PairReport] = []
    for tokenizer_name in options.tokenizers:
        setup = load_tokenizer_setup(tokenizer_name, ModelArgs().cache_path)
        for backend_name in options.backends:
            server_args = GrammarArgs(grammar_backend=backend_name, grammar_compile_timeout=options.compile_timeout)
            report = run(server_args, setup, cases, options.walks, recorded)
            reports.append(report)
            print_table(report)

    print_auto_versus_best(reports)
    print_refusals(reports)
    print_auto_choices(reports)
    print_invalid_outputs(reports)
    print_costliest(reports, options.slow)
    if options.write_known_refusals:
        messages: dict[str, dict[str, dict[str, str]]] = {}
        for report in reports:
            if report.backend in RECORDED_BACKENDS:
                messages.setdefault(report.backend, {})[report.tokenizer] = report.refusals
        refusals = known_refusals_from(messages)
        (options.data / KNOWN_REFUSALS_FILE).write_text(json.dumps(refusals, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {options.data / KNOWN_REFUSALS_FILE}: {', '.join(f'{b} {len(c)}' for b, c in refusals.items())}")

    num_problems = 0
    if recorded is not None:
        for report in reports:
            for name, problems in report.problems.items():
                for problem in problems:
                    print(f"!! {report.backend} {report.tokenizer} {name}: {problem}")
                num_problems += len(problems)
        print(f"{num_problems} disagreements with {KNOWN_REFUSALS_FILE} and {KNOWN_DEVIATIONS_FILE}")
    else:
        print(f"{options.data} has no {KNOWN_REFUSALS_FILE} and {KNOWN_DEVIATIONS_FILE}: cases not judged")

    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text(json.dumps([asdict(report) for report in reports], indent=2, ensure_ascii=False))
    print(f"details: {options.output}")
    return 1 if num_problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
