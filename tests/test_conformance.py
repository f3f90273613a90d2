"""One conformance suite for every backend and both real tokenizers.

A valid text, tokenised and walked token by token, is allowed by the mask at every step, accepted, and the
grammar can end right after it; an invalid text is rejected at some step. At every step no special token
(other than the stop token where the grammar may end) and no padding id is allowed. Schemas a backend cannot
compile must fail with a message, never an exception. ``scripts/conformance_report.py`` prints the figures.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.base_grammar_backend import BaseGrammarBackend, create_grammar_backend
from sglang_constrained.conformance import check_constraint
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.maskbench import load_case
from sglang_constrained.tokenizer_loading import TokenizerSetup

BACKENDS = ("xgrammar", "llguidance", "outlines")
MASKBENCH_ROOT = Path(__file__).parent / "data" / "maskbench"
MASKBENCH_PATHS = sorted(MASKBENCH_ROOT.glob("*/*.json"))

KNOWN_DEVIATIONS = json.loads((MASKBENCH_ROOT / "known_deviations.json").read_text())
"""Valid instances an engine rejects for reasons of its own, per backend and tokenizer, each with its measured reason.

The test checks the list both ways: an unlisted case must conform, and a listed case must still deviate.
"""

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
        ['<f=weather>{"town": "Paris"}</f>'],
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
    ("llguidance", "structural tag format"): "supports only the structures/triggers form",
}
SKIPPED = {
    ("outlines", "json_object"): "an any-JSON index takes 10-36 s and 26-154 MB; test_outlines_backend covers it",
}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, tokenizer_case: TokenizerSetup) -> Iterator[BaseGrammarBackend]:
    """The backend, with every MaskBench schema already queued on its compile pool (compiles overlap walks)."""
    args = ServerArgs(grammar_backend=request.param, grammar_compile_threads=2)
    built = create_grammar_backend(
        args, tokenizer_case.tokenizer, tokenizer_case.vocab_size, tokenizer_case.eos_token_ids
    )
    assert built is not None
    for path in MASKBENCH_PATHS:
        built.get_cached_or_future_value(make_grammar_key("json", json.loads(path.read_text())["schema"]))
    yield built
    built.shutdown()


@pytest.mark.parametrize("path", MASKBENCH_PATHS, ids=[p.stem for p in MASKBENCH_PATHS])
def test_maskbench_schema(backend: BaseGrammarBackend, tokenizer_case: TokenizerSetup, path: Path) -> None:
    case = load_case(path)
    key = make_grammar_key("json", case.schema)
    result = check_constraint(backend, tokenizer_case, case.name, key, case.valid_instances, case.invalid_instances)
    backend.discard_pending(key)
    if not result.compiled:
        assert result.compile_error and len(result.compile_error) <= 400
        return
    deviation = KNOWN_DEVIATIONS["deviations"].get(backend.name, {}).get(tokenizer_case.name, {}).get(case.name)
    if deviation is not None:
        assert deviation in KNOWN_DEVIATIONS["reasons"]
        assert result.wrongly_rejected, "a known deviation no longer happens: remove it from known_deviations.json"
    else:
        assert result.wrongly_rejected == []
    assert result.wrongly_accepted == []


@pytest.mark.parametrize(
    ("name", "kind", "spec", "valid", "invalid"), OWN_CASES, ids=[case[0].replace(" ", "-") for case in OWN_CASES]
)
def test_own_constraint(
    backend: BaseGrammarBackend,
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
