"""Soundness by random walks: whatever a grammar's own mask lets through must parse and validate.

Each walk samples among the tokens the mask allows, biased toward control characters, quotes, backslashes and
non-ASCII, then toward closing (``sglang_constrained.testing.random_walk``); every finished walk is judged by an
independent oracle (strict ``json.loads`` and jsonschema with format checks and ECMA-262 patterns, ``re.fullmatch``,
membership). Probes cover every place a JSON string is produced; a seeded MaskBench sample covers every folder;
hypothesis builds schemas from the features each backend claims. The whole sweep is a column of
``scripts/conformance_report.py``.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import GrammarKey, make_grammar_key
from sglang_constrained.testing.maskbench import load_case
from sglang_constrained.testing.random_walk import Judge, choice_judge, json_judge, regex_judge, walk_and_judge
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import compile_grammar, item_parameters

BACKENDS = ("xgrammar", "llguidance", "outlines")
WALKS_PER_PROBE = 6
MIN_FINISHED_SHARE = 0.5
MASKBENCH_ROOT = Path(__file__).parents[1] / "data" / "maskbench"
MASKBENCH_PER_FOLDER = 3
WALKS_PER_MASKBENCH_CASE = 3
COMPILES_AHEAD = 2

S = {"type": "string"}


def in_object(value_schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": value_schema}, "required": ["s"], "additionalProperties": False}


def legacy_tag(schema: dict[str, Any]) -> dict[str, Any]:
    return {"structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}], "triggers": ["<f>"]}


def tagged_json_judge(schema: dict[str, Any]) -> Judge:
    """Free text around ``<f>...</f>`` bodies, each of which must be valid JSON for ``schema``."""
    body_judge = json_judge(schema)

    def judge(text: str) -> str | None:
        for body in re.findall(r"<f>(.*?)</f>", text, flags=re.DOTALL):
            problem = body_judge(body)
            if problem is not None:
                return f"a tag's body {problem}"
        return None

    return judge


PROBED_FORMATS = (
    "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
    "uri-template", "uuid", "json-pointer", "relative-json-pointer",
)  # fmt: skip
STRING_PROBES: dict[str, dict[str, Any]] = {
    "plain string": in_object(S),
    "minLength": in_object({**S, "minLength": 3}),
    "maxLength": in_object({**S, "maxLength": 12}),
    "min and maxLength": in_object({**S, "minLength": 2, "maxLength": 8}),
    "pattern with .": in_object({**S, "pattern": "^a.b$"}),
    "pattern with a negated class": in_object({**S, "pattern": "^[^x]{1,5}$"}),
    "pattern with \\s and \\S": in_object({**S, "pattern": "^\\s\\S$"}),
    "pattern with \\w \\W \\d \\D": in_object({**S, "pattern": "^\\w+\\W\\d\\D$"}),
    "pattern .*": in_object({**S, "pattern": "^.*$"}),
    "optional group with a repetition": in_object({**S, "pattern": "^a(bc+)?Z$"}),
    "enum with escapes": in_object({"enum": ['a"b', "c\\d", "tab\there", "\u0001x", "ü€😀", "/"]}),
    "const with escapes": in_object({"const": 'q"\\\n'}),
    "property names with escapes": {
        "type": "object",
        "properties": {'a"b': S, "c\\d": S, "e\nf": S, "ü": S},
        "required": ['a"b', "c\\d", "e\nf", "ü"],
        "additionalProperties": False,
    },
    "additionalProperties": {"type": "object", "additionalProperties": S},
    "bounded additionalProperties": {"type": "object", "additionalProperties": {**S, "maxLength": 5}},
    "patternProperties": {"type": "object", "patternProperties": {"^a": S}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 4}, "additionalProperties": {"type": "integer"}},
    "array of bounded strings": {"type": "array", "items": {**S, "maxLength": 6}},
    "any JSON value": {},
    **{f"format {name}": in_object({**S, "format": name}) for name in PROBED_FORMATS},
}
"""Every place a JSON string is produced: plain, bounded, patterned, formatted, enum and const values with escapes,
property names, additional and pattern properties, property-name constraints, array items, any JSON."""

EXPECTED_REFUSALS: dict[tuple[str, str], str] = {
    ("xgrammar", "patternProperties"): "'patternProperties'",
    ("llguidance", "propertyNames"): "propertyNames",
    ("llguidance", "format uri-reference"): "Unknown format",
    ("llguidance", "format uri-template"): "Unknown format",
    ("outlines", "property names with escapes"): "property names with a quote",
    ("outlines", "patternProperties"): "'patternProperties'",
    ("outlines", "propertyNames"): "'propertyNames'",
    **{
        ("outlines", f"format {name}"): f"'format': '{name}'"
        for name in ("duration", "hostname", "ipv6", "uri", "uri-reference", "uri-template")
    },
}
"""Probes a backend refuses up front, with the words its message gives."""

OTHER_PROBES: list[tuple[str, str, Any, Judge]] = [
    ("json_object", "json_object", None, json_judge({"type": "object"})),
    ("regex", "regex", r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)", regex_judge(r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)")),
    ("regex with classes", "regex", r"[0-9]{3}-[^ ,]{2,4}( [A-Z]+)?", regex_judge(r"[0-9]{3}-[^ ,]{2,4}( [A-Z]+)?")),
    ("choice", "choice", ["yes", 'say "hi"', "a\\b", "tab\tx"], choice_judge(["yes", 'say "hi"', "a\\b", "tab\tx"])),
    (
        "strings in a structural tag",
        "structural_tag",
        legacy_tag(in_object({**S, "maxLength": 6})),
        tagged_json_judge(in_object({**S, "maxLength": 6})),
    ),
]
OTHER_UNSUPPORTED = {("outlines", "strings in a structural tag"): "does not support structural_tag"}
OUTLINES_ANY_JSON_AT_QWEN35 = "outlines-core takes ~30 s to index any-JSON at 248k tokens; smollm2 walks this grammar"
SKIPPED = {
    ("outlines", "qwen35", "any JSON value"): OUTLINES_ANY_JSON_AT_QWEN35,
    ("outlines", "qwen35", "json_object"): OUTLINES_ANY_JSON_AT_QWEN35,
}


def walk_verdicts(
    backend: GrammarPipeline, setup: TokenizerSetup, kind: str, spec: Any, judge: Judge, walks: int, seed: int
) -> tuple[int, list[str]]:
    """How many of ``walks`` walks finished, and what was wrong with each invalid one (a structural tag's text
    outside its tags is free, so it need not be UTF-8 there)."""
    grammar = compile_grammar(backend, kind, spec)
    assert not isinstance(grammar, InvalidGrammarObject), grammar.error_message
    tally = walk_and_judge(grammar, setup, judge, walks, seed, free_text=kind == "structural_tag")
    return tally.num_finished, tally.invalid_outputs


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> Any:
    return build_backend(request.param, tokenizer_case)


@pytest.fixture(autouse=True)
def compile_ahead(request: pytest.FixtureRequest) -> None:
    """Queues this test's constraint, then the next tests' on the same backend and tokenizer, on the backend's
    compile slot: they compile on the other core while this test walks. Only ``COMPILES_AHEAD`` at a time, as
    ``MaskBenchSweep`` does: a compile that waits for the slot past its deadline fails."""
    if "backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("backend")
    items = request.session.items
    mine = item_parameters(request.node)
    upcoming = (
        key
        for item in items[items.index(request.node) :]
        if item.module is request.module
        and ((params := item_parameters(item)).get("backend"), params.get("tokenizer_case"))
        == (mine["backend"], mine["tokenizer_case"])
        and (key := planned_key(params)) is not None
    )
    for key, _ in zip(upcoming, range(1 + COMPILES_AHEAD), strict=False):
        backend.get_cached_or_future_value(key)


def planned_key(params: dict[str, Any]) -> GrammarKey | None:
    """The constraint a test of this module with ``params`` compiles; None for one it skips."""
    if (params["backend"], params["tokenizer_case"], params.get("probe", params.get("name"))) in SKIPPED:
        return None
    if "probe" in params:
        return make_grammar_key("json", STRING_PROBES[params["probe"]])
    if "kind" in params:
        return make_grammar_key(params["kind"], params["spec"])
    return make_grammar_key("json", load_case(params["path"]).schema)


@pytest.mark.parametrize("probe", STRING_PROBES)
def test_every_json_string_the_mask_allows_is_valid(backend: Any, tokenizer_case: TokenizerSetup, probe: str) -> None:
    if (backend.name, tokenizer_case.name, probe) in SKIPPED:
        pytest.skip(SKIPPED[backend.name, tokenizer_case.name, probe])
    schema = STRING_PROBES[probe]
    refusal = EXPECTED_REFUSALS.get((backend.name, probe))
    if refusal is not None:
        grammar = compile_grammar(backend, "json", schema)
        assert isinstance(grammar, InvalidGrammarObject) and refusal in grammar.error_message
        return
    finished, problems = walk_verdicts(backend, tokenizer_case, "json", schema, json_judge(schema), WALKS_PER_PROBE, 0)
    assert problems == []
    assert finished >= MIN_FINISHED_SHARE * WALKS_PER_PROBE, "too few walks finished to judge anything"


@pytest.mark.parametrize(("name", "kind", "spec", "judge"), OTHER_PROBES, ids=[probe[0] for probe in OTHER_PROBES])
def test_every_output_of_other_kinds_is_valid(
    backend: Any, tokenizer_case: TokenizerSetup, name: str, kind: str, spec: Any, judge: Judge
) -> None:
    if (backend.name, tokenizer_case.name, name) in SKIPPED:
        pytest.skip(SKIPPED[backend.name, tokenizer_case.name, name])
    unsupported = OTHER_UNSUPPORTED.get((backend.name, name))
    if unsupported is not None:
        grammar = compile_grammar(backend, kind, spec)
        assert isinstance(grammar, InvalidGrammarObject) and unsupported in grammar.error_message
        return
    finished, problems = walk_verdicts(backend, tokenizer_case, kind, spec, judge, WALKS_PER_PROBE, 1)
    assert problems == []
    assert finished >= MIN_FINISHED_SHARE * WALKS_PER_PROBE


def maskbench_sample() -> list[Path]:
    """A fixed sample of every folder (seeded): the soundness walks' share of the vendored schemas."""
    rng = random.Random(17)
    paths: list[Path] = []
    for folder in sorted(path for path in MASKBENCH_ROOT.iterdir() if path.is_dir()):
        paths += rng.sample(sorted(folder.glob("*.json")), MASKBENCH_PER_FOLDER)
    return paths


@pytest.mark.parametrize("path", maskbench_sample(), ids=lambda path: path.stem)
def test_maskbench_walks_are_valid(backend: Any, tokenizer_case: TokenizerSetup, path: Path) -> None:
    case = load_case(path)
    grammar = compile_grammar(backend, "json", case.schema)
    if isinstance(grammar, InvalidGrammarObject):
        pytest.skip(f"refused (test_conformance checks the reason): {grammar.error_message[:80]}")
    judge = json_judge(case.schema)
    _, problems = walk_verdicts(backend, tokenizer_case, "json", case.schema, judge, WALKS_PER_MASKBENCH_CASE, 2)
    assert problems == []


SAFE_PATTERNS = ("^[a-z]+$", "^\\d{2,4}$", "^[A-Z][a-z]*( [A-Z][a-z]*)*$", "^.{1,3}$", "^[^,]*$", "^\\w+(-\\w+)?$")
NAME_TEXT = st.text(alphabet=st.sampled_from(list('ab_Z9 é"\\\t')), min_size=1, max_size=4)
STRING_VALUES = st.text(alphabet=st.sampled_from(list('ab "\\\n\u0001é😀')), max_size=5)
CLAIMED_FORMATS = {
    "xgrammar": ("date-time", "date", "time", "email", "ipv4", "uuid", "hostname", "json-pointer"),
    "llguidance": ("date-time", "date", "time", "email", "ipv4", "uuid", "hostname", "json-pointer"),
    "outlines": ("date-time", "date", "time", "email", "ipv4", "uuid", "json-pointer"),
}
"""The formats each backend claims to enforce exactly (the rest are refused or left to their own tests)."""


@st.composite
def claimed_string_schemas(draw: st.DrawFn, backend_name: str) -> dict[str, Any]:
    """A string schema using one family of what ``backend_name`` claims: lengths, a pattern, a format, or values."""
    family = draw(st.sampled_from(("lengths", "pattern", "format", "enum", "const")))
    if family == "lengths":
        low = draw(st.integers(0, 4))
        high = draw(st.integers(low, 12 if backend_name == "outlines" else 30))
        return {"type": "string", "minLength": low, "maxLength": high}
    if family == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(SAFE_PATTERNS))}
    if family == "format":
        return {"type": "string", "format": draw(st.sampled_from(CLAIMED_FORMATS[backend_name]))}
    values = draw(st.lists(STRING_VALUES, min_size=1, max_size=3, unique=True))
    return {"type": "string", "enum": values} if family == "enum" else {"type": "string", "const": values[0]}


@st.composite
def claimed_schemas(draw: st.DrawFn, backend_name: str, depth: int = 2) -> dict[str, Any]:
    """Objects and arrays (to ``depth``) of claimed strings, integers, booleans and nulls."""
    leaves = st.one_of(
        claimed_string_schemas(backend_name),
        st.just({"type": "integer"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
    )
    if depth == 0:
        return draw(leaves)
    shape = draw(st.sampled_from(("object", "array", "leaf")))
    if shape == "leaf":
        return draw(leaves)
    if shape == "array":
        return {"type": "array", "items": draw(claimed_schemas(backend_name, depth - 1)), "maxItems": 3}
    names = draw(st.lists(NAME_TEXT, min_size=1, max_size=3, unique=True))
    if backend_name == "outlines":  # it refuses names that need escapes (see its refusal table)
        names = [name for name in names if not any(char in '"\\' or ord(char) < 0x20 for char in name)] or ["n"]
    properties = {name: draw(claimed_schemas(backend_name, depth - 1)) for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_schemas_of_claimed_features_walk_validly(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, backend_name: str, data: st.DataObject
) -> None:
    schema = data.draw(claimed_schemas(backend_name), label="schema")
    backend = build_backend(backend_name, smollm2_tokenizer)
    _, problems = walk_verdicts(backend, smollm2_tokenizer, "json", schema, json_judge(schema), 2, 3)
    assert problems == [], json.dumps(schema)
