"""Minimal reproductions of the engine faults our workarounds cover.

Each test asserts that the engine, called directly, still has the fault. When an engine release fixes one, its test
fails: remove the workaround the test names (and this test), then check that the soundness walks still pass.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import outlines_core
import pytest
import xgrammar
from llguidance import LLMatcher
from outlines_core.json_schema import build_regex_from_schema

from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder

BYTE_VOCABULARY = outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


@pytest.fixture(scope="module")
def xgrammar_compiler(build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup) -> xgrammar.GrammarCompiler:
    compiler: xgrammar.GrammarCompiler = build_backend("xgrammar", smollm2_tokenizer).backend.compiler
    return compiler


def xgrammar_accepts(compiler: xgrammar.GrammarCompiler, schema: dict[str, Any], json_text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    return bool(matcher.accept_string(json_text) and matcher.is_completed())


XGRAMMAR_FAULTS = [
    pytest.param(
        {"type": "string", "maxLength": 5}, '"a\tb"', "xgrammar_backend._length_bounds_as_patterns",
        id="raw control character in a length-bounded string",
    ),
    pytest.param(
        {"type": "string", "pattern": "^a(bc+)?Z$"}, '"accccZ"', "json_string_patterns: X? written (X|)",
        id="optional group with a repetition loses its first element",
    ),
    pytest.param(
        {"type": "string", "pattern": '^a"b$'}, '"a"b"', "json_string_patterns: patterns never produce quotes",
        id="pattern's quote written raw",
    ),
    pytest.param(
        {"type": "string", "pattern": "^\\S$"}, '"\u00a0"', "json_string_patterns: explicit ECMA classes",
        id="\\S takes a no-break space",
    ),
    pytest.param(
        {"type": "string", "format": "date-time"}, '"2024-09-31T00:00:00Z"', "json_string_formats",
        id="date-time on a day that does not exist",
    ),
    pytest.param({"type": "string", "format": "time"}, '"12:00:60Z"', "json_string_formats", id="leap second"),
    pytest.param({"type": "string", "format": "ipv4"}, '"054.1.1.1"', "json_string_formats", id="ipv4 leading zero"),
    pytest.param(
        {"type": "string", "format": "hostname"}, '"' + "a" * 70 + '.com"', "json_string_formats",
        id="hostname label over 63 characters",
    ),
    pytest.param(
        {"type": "string", "format": "json-pointer"}, '"/a"b"', "json_string_formats", id="json-pointer's quote raw"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "invalid_json", "workaround"), XGRAMMAR_FAULTS)
def test_xgrammar_still_accepts(
    xgrammar_compiler: xgrammar.GrammarCompiler, schema: dict[str, Any], invalid_json: str, workaround: str
) -> None:
    assert xgrammar_accepts(xgrammar_compiler, schema, invalid_json), f"xgrammar fixed this: remove {workaround}"


XGRAMMAR_GRAMMARS: dict[str, Callable[[str], xgrammar.Grammar]] = {
    "json": xgrammar.Grammar.from_json_schema,
    "regex": xgrammar.Grammar.from_regex,
    "ebnf": xgrammar.Grammar.from_ebnf,
}
XGRAMMAR_UTF8_FAULTS = [
    pytest.param("json", '{"type": "string"}', b'"\xed\xa0\x80"', id="JSON string takes a UTF-16 surrogate"),
    pytest.param("json", "{}", b'{"\xed\xbf\xbf": 1}', id="property name takes a UTF-16 surrogate"),
    pytest.param(
        "json", '{"type": "string", "pattern": "^.*$"}', b'"\xe0\x80\x80"', id="pattern takes an overlong form"
    ),
    pytest.param("regex", "[^,]*", b"\xed\xba\xb7", id="regex class takes a UTF-16 surrogate"),
    pytest.param("ebnf", "root ::= [\\u0080-\\uffff]", b"\xed\xa0\x80", id="EBNF class spanning surrogates"),
    pytest.param("ebnf", 'root ::= Regex("[^,]")', b"\xf0\x80\x80\x80", id="EBNF Regex takes a 4-byte overlong"),
    pytest.param("ebnf", 'root ::= "\\ud800"', b"\xed\xa0\x80", id="literal spells a UTF-16 surrogate"),
]  # fmt: skip
"""Bytes that are not UTF-8 (RFC 3629) which xgrammar takes (``ED A0..BF xx`` spells a lone surrogate; ``E0 80..9F``
and ``F0 80..8F`` start overlong forms), as token masks do: the byte-fallback tokens ``\\xed``, ``\\xba``, ``\\xb7``
of SmolLM2 made ``\\xed\\xba\\xb7`` inside JSON strings of the held-out MaskBench schemas JME_56 and JME_79."""


@pytest.mark.parametrize(("kind", "spec", "malformed"), XGRAMMAR_UTF8_FAULTS)
def test_xgrammar_still_takes_malformed_utf8(
    xgrammar_compiler: xgrammar.GrammarCompiler, kind: str, spec: str, malformed: bytes
) -> None:
    matcher = xgrammar.GrammarMatcher(xgrammar_compiler.compile_grammar(XGRAMMAR_GRAMMARS[kind](spec)))
    taken = matcher.accept_string(malformed) and matcher.is_completed()
    assert taken, "xgrammar fixed this: remove xgrammar_utf8.well_formed_utf8_grammar"


LLGUIDANCE_FAULTS = [
    pytest.param(
        {"type": "string", "pattern": "^[\\x00-\\x1f]$"}, '"\\""', "json_string_patterns: classes leave out controls",
        id="class of every control character takes an escaped quote",
    ),
    pytest.param(
        {"type": "string", "format": "date-time"}, '"2024-01-01T00:00:60Z"', "json_string_formats", id="leap second"
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "invalid_json", "workaround"), LLGUIDANCE_FAULTS)
def test_llguidance_still_accepts(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, schema: Any, invalid_json: str, workaround: str
) -> None:
    ll_tokenizer = build_backend("llguidance", smollm2_tokenizer).backend.ll_tokenizer
    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_json_schema(schema), log_level=0)
    tokens = smollm2_tokenizer.encode(invalid_json)
    assert matcher.consume_tokens(tokens) and matcher.is_accepting(), f"llguidance fixed this: remove {workaround}"


def outlines_matches(regex: str, text: str) -> bool:
    """Whether outlines-core's automaton for ``regex`` takes ``text`` whole (walked byte by byte)."""
    index = outlines_core.Index(regex, BYTE_VOCABULARY)
    state: int | None = index.get_initial_state()
    for byte in text.encode():
        state = index.get_next_state(state, byte)
        if state is None:
            return False
    return bool(index.is_final_state(state))


OUTLINES_FAULTS = [
    pytest.param({"type": "string", "pattern": "^.$"}, '"""', "json_string_patterns", id="pattern's . takes a quote"),
    pytest.param(
        {"type": "string", "pattern": "^[^x]$"}, '"\x01"', "json_string_patterns", id="negated class takes a control"
    ),
    pytest.param(
        {"type": "string", "format": "date"}, '"٢٠٢٤-01-01"', "json_string_formats", id="date takes non-ASCII digits"
    ),
    pytest.param(
        {"type": "object", "properties": {'a"b': {"type": "integer"}}, "required": ['a"b']}, '{"a"b":1}',
        "outlines_schema_rules: property names with a quote", id="property name pasted raw",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "invalid_json", "workaround"), OUTLINES_FAULTS)
def test_outlines_core_still_accepts(schema: Any, invalid_json: str, workaround: str) -> None:
    regex = build_regex_from_schema(json.dumps(schema), "")
    assert outlines_matches(regex, invalid_json), f"outlines-core fixed this: remove {workaround}"
