"""One conformance suite for every backend and both real tokenizers.

A valid text, tokenised and walked token by token, is allowed by the mask at every step, accepted, and the
grammar can end right after it; an invalid text is rejected at some step. At every step no special token
(other than the stop token where the grammar may end) and no padding id is allowed. A schema a backend refuses
must fail with a short message giving the reason ``known_refusals.json`` records for it; valid instances an
engine rejects must be listed in ``known_deviations.json``; both lists are checked both ways, so that an entry
that stops happening fails too. The default run takes a fixed sample of MaskBench; the whole of it runs with
``python -m pytest -m conformance_full tests/backends/test_conformance.py``, and
``scripts/conformance_report.py`` prints the figures.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import KnownOutcomes, MaskBenchSweep, check_constraint
from sglang_constrained.testing.maskbench import load_case
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup
from tests.backends.conftest import new_backend
from tests.helpers import item_parameters

BACKENDS = ("xgrammar", "llguidance", "outlines")
MASKBENCH_ROOT = Path(__file__).parents[1] / "data" / "maskbench"
MASKBENCH_PATHS = sorted(MASKBENCH_ROOT.glob("*/*.json"))
KNOWN = KnownOutcomes.load(MASKBENCH_ROOT)

COSTLY_CASES = {
    "Github_trivial---o71844": "outlines+qwen35 22 s, outlines+smollm2 8 s",
    "Github_trivial---o9933": "xgrammar+qwen35 19 s, xgrammar+smollm2 3 s",
    "Github_trivial---o4050": "outlines+qwen35 21 s",
    "Github_trivial---o9912": "xgrammar+qwen35 19 s, xgrammar+smollm2 3 s",
    "Github_trivial---o70290": "outlines+qwen35 21 s",
    "Github_trivial---o79589": "outlines+qwen35 17 s, outlines+smollm2 2 s",
    "Github_trivial---o76554": "outlines+qwen35 17 s, outlines+smollm2 2 s",
    "Github_easy---o76476": "outlines+qwen35 17 s, outlines+smollm2 1 s",
    "Github_trivial---o48167": "xgrammar+qwen35 14 s, xgrammar+smollm2 3 s",
    "Github_easy---o12619": "outlines+qwen35 14 s",
    "Github_trivial---o9790": "xgrammar+qwen35 13 s, xgrammar+smollm2 2 s",
    "Github_trivial---o72207": "xgrammar+qwen35 13 s, xgrammar+smollm2 2 s",
    "Github_trivial---o9948": "xgrammar+qwen35 11 s, xgrammar+smollm2 2 s",
    "Github_trivial---o44010": "xgrammar+qwen35 10 s, xgrammar+smollm2 2 s",
    "Github_trivial---o9827": "xgrammar+qwen35 10 s, xgrammar+smollm2 2 s",
    "Github_easy---o58909": "xgrammar+qwen35 11 s, xgrammar+smollm2 1 s",
    "Github_trivial---o48162": "xgrammar+qwen35 10 s, xgrammar+smollm2 2 s",
    "Github_trivial---o26589": "xgrammar+qwen35 10 s, xgrammar+smollm2 2 s",
    "Github_easy---o9910": "xgrammar+qwen35 10 s, xgrammar+smollm2 1 s",
    "Github_trivial---o6269": "xgrammar+qwen35 10 s, xgrammar+smollm2 2 s",
    "Github_trivial---o64546": "outlines+qwen35 10 s",
    "Github_trivial---o65598": "outlines+qwen35 10 s",
    "Github_easy---o40346": "outlines+qwen35 5 s",
    "Glaiveai2K---generate_invoice_ade9b710": "outlines+qwen35 5 s",
    "Glaiveai2K---search_hotels_6e14cb73": "outlines+qwen35 6 s",
    "Github_easy---o70014": "outlines+qwen35 5 s",
    "Github_trivial---o67212": "outlines+qwen35 5 s",
    "Github_trivial---o83137": "outlines+qwen35 5 s",
    "Github_trivial---o65544": "outlines+qwen35 5 s",
    "Glaiveai2K---find_hotel_cd6e97f8": "outlines+qwen35 5 s",
}
"""Cases kept out of the default sample: each costs more than 5 s summed over the six backend x tokenizer pairs
(most of it one engine compiling at qwen35's 248k vocabulary), as ``scripts/conformance_report.py`` measured
them on 2 shared cores. Together they are about two thirds of the whole sweep's time; the full sweep runs them.
"""
SAMPLE_SEED = 0
SAMPLE_STRIDE = 4
SAMPLE_MIN_PER_FOLDER = 8
SAMPLE_MIN_LISTED = 2


def default_sample() -> list[Path]:
    """The default run's MaskBench cases: a fixed share of every folder, topped up with listed outcomes.

    A seeded shuffle fixes the order. Each folder gives its first quarter (``SAMPLE_STRIDE``, at least
    ``SAMPLE_MIN_PER_FOLDER``); then, for every backend and tokenizer, cases listed as refused or as deviating
    there are added in that order until the sample holds ``SAMPLE_MIN_LISTED`` of each, so that the both-ways
    checks of both files run by default.
    """
    order = [path for path in MASKBENCH_PATHS if path.stem not in COSTLY_CASES]
    random.Random(SAMPLE_SEED).shuffle(order)
    sample: list[Path] = []
    for folder in sorted({path.parent.name for path in order}):
        in_folder = [path for path in order if path.parent.name == folder]
        sample += in_folder[: max(SAMPLE_MIN_PER_FOLDER, len(in_folder) // SAMPLE_STRIDE)]
    for backend in BACKENDS:
        for tokenizer in TOKENIZER_SETUPS:
            refused = [path for path in order if KNOWN.refusal(backend, path.stem) is not None]
            deviating = [path for path in order if KNOWN.deviation(backend, tokenizer, path.stem) is not None]
            for listed in (refused, deviating):
                missing = SAMPLE_MIN_LISTED - sum(path in sample for path in listed)
                sample += [path for path in listed if path not in sample][: max(0, missing)]
    return sorted(sample)


SAMPLE_PATHS = default_sample()

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY_TAG = {"structures": [{"begin": "<f=weather>", "schema": WEATHER_SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
FORMAT_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f="],
        "tags": [
            {"begin": "<f=weather>", "content": {"type": "json_schema", "json_schema": WEATHER_SCHEMA}, "end": "</f>"}
        ],
    },
}
CHOICES_WITH_METACHARACTERS = ["a.b", "(x|y)", "1+1=2", "C:\\path\\to", 'say "hi"', "tab\tand\nnewline", "[*]^$"]

OWN_CASES = [
    ("phone regex", "regex", r"\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567"], ["555-123-4567", "(555) 123-456"]),
    ("date regex", "regex", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", ["2026-11-21"], ["2026-13-01", "26-1-1"]),
    ("email regex", "regex", r"[a-z0-9._]+@[a-z0-9]+\.(com|org)", ["ada.l@example.com"], ["ada@example", "A@b.com"]),
    ("unicode regex", "regex", "(café|naïve|日本語)+", ["café日本語naïve"], ["cafe", "日本"]),
    ("choice", "choice", ["yes", "no", "maybe so"], ["maybe so", "no"], ["yes!", "Yes", "maybe"]),
    ("choice with metacharacters", "choice", CHOICES_WITH_METACHARACTERS, CHOICES_WITH_METACHARACTERS, ["axb", "x"]),
    # A prefix of another option (outlines-core's leftmost-first automaton stopped at "Java"), and a control
    # character (xgrammar read "\x01f" as one escape).
    (
        "choice with prefixes",
        "choice",
        ["Java", "JavaScript", "a\u0001f"],
        ["JavaScript", "Java", "a\u0001f"],
        ["Jav", "JavaScripts", "af"],
    ),
    (
        "arithmetic ebnf",
        "ebnf",
        'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+',
        ["1+22+333", "7"],
        ["1++2", "+1", "1+"],
    ),
    (
        "key-value ebnf",
        "ebnf",
        'root ::= "{" ws "\\"ok\\"" ws ":" ws ("true" | "false") ws "}"\nws ::= [ \\t\\n]*',
        ['{"ok": true}', '{ "ok" :false }'],
        ['{"ok": yes}', '{"ok": true'],
    ),
    (
        "lark ebnf",
        "ebnf",
        'start: item ("," item)*\nitem: NAME | INT | "[" D~2 "]"\nNAME: /[a-z]+/\nD: "0".."9"\n%import common.INT',
        ["ab,12,[07]", "x"],
        ["ab,", "[7]", "A", ""],
    ),
    (
        "legacy structural tag",
        "structural_tag",
        LEGACY_TAG,
        ['Let me check. <f=weather>{"city": "Paris"}</f> Done.', "No call at all."],
        ['<f=weather>{"town": "Paris"}</f>', '<f=weather>{"city": 3}</f>'],
    ),
    (
        "structural tag format",
        "structural_tag",
        FORMAT_TAG,
        ['Let me check. <f=weather>{"city": "Paris"}</f> Done.', "No call at all."],
        ['<f=weather>{"town": "Paris"}</f>', '<f=weather>{"city": 3}</f>'],
    ),
    (
        "json_object",
        "json_object",
        None,
        ['{"a": [1, 2.5, {"b": null}], "c": "ü"}', "{}"],
        ["[1, 2]", '{"a": }', '"text"'],
    ),
]

UNSUPPORTED = {
    ("outlines", "ebnf"): "does not support ebnf",
    ("outlines", "structural_tag"): "does not support structural_tag",
}
SKIPPED = {
    ("outlines", "json_object"): "an any-JSON index takes 10-36 s and 26-154 MB; test_outlines_backend covers it",
}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tokenizer_case: TokenizerSetup) -> Iterator[GrammarPipeline]:
    built = new_backend(GrammarArgs(grammar_backend=request.param, grammar_compile_threads=2), tokenizer_case)
    yield built
    built.shutdown()


@pytest.fixture(scope="module")
def maskbench_sweep(
    request: pytest.FixtureRequest, backend: GrammarPipeline, tokenizer_case: TokenizerSetup
) -> MaskBenchSweep:
    """The MaskBench cases this run selected for this backend and tokenizer, in run order, compiled ahead.

    Planned from the session's selected items, so that only the sample's (or a ``-k`` selection's) schemas
    are compiled.
    """
    planned = [
        load_case(params["path"])
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and "path" in (params := item_parameters(item))
        and (params["backend"], params["tokenizer_case"]) == (backend.name, tokenizer_case.name)
    ]
    return MaskBenchSweep(backend, tokenizer_case, planned)


def check_maskbench_case(sweep: MaskBenchSweep, path: Path) -> None:
    problems = KNOWN.problems(sweep.backend.name, sweep.setup.name, sweep.check(load_case(path)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SAMPLE_PATHS, ids=[path.stem for path in SAMPLE_PATHS])
def test_maskbench_sample(maskbench_sweep: MaskBenchSweep, path: Path) -> None:
    check_maskbench_case(maskbench_sweep, path)


@pytest.mark.conformance_full
@pytest.mark.parametrize("path", MASKBENCH_PATHS, ids=[path.stem for path in MASKBENCH_PATHS])
def test_maskbench_full(maskbench_sweep: MaskBenchSweep, path: Path) -> None:
    check_maskbench_case(maskbench_sweep, path)


def test_known_outcomes_name_swept_cases() -> None:
    """An entry for no vendored case, backend or tokenizer would never be checked, not even by the full sweep."""
    names = {path.stem for path in MASKBENCH_PATHS}
    entries = [(backend, None, case) for backend, cases in KNOWN.refusals.items() for case in cases]
    entries += [
        (backend, tokenizer, case)
        for backend, per_tokenizer in KNOWN.deviations.items()
        for tokenizer, cases in per_tokenizer.items()
        for case in cases
    ]
    assert [
        (backend, tokenizer, case)
        for backend, tokenizer, case in entries
        if backend not in BACKENDS or tokenizer not in (None, *TOKENIZER_SETUPS) or case not in names
    ] == []


@pytest.mark.parametrize(
    ("name", "kind", "spec", "valid", "invalid"), OWN_CASES, ids=[case[0].replace(" ", "-") for case in OWN_CASES]
)
def test_own_constraint(
    backend: GrammarPipeline,
    tokenizer_case: TokenizerSetup,
    name: str,
    kind: str,
    spec: object,
    valid: list[str],
    invalid: list[str],
) -> None:
    if (backend.name, kind) in SKIPPED:
        pytest.skip(SKIPPED[backend.name, kind])
    result = check_constraint(backend, tokenizer_case, name, make_grammar_key(kind, spec), valid, invalid)
    expected_refusal = UNSUPPORTED.get((backend.name, kind)) or UNSUPPORTED.get((backend.name, name))
    if expected_refusal is not None:
        assert result.compile_error is not None and expected_refusal in result.compile_error
        return
    assert result.compile_error is None
    assert result.wrongly_rejected == []
    assert result.wrongly_accepted == []
