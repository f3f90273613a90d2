"""Inside JSON strings, regexes and EBNF terminals every backend's mask admits only well-formed UTF-8 (RFC 3629), and
every valid code point stays reachable.

One way, byte by byte: inside a string, after each proper prefix of a multi-byte character spelled with byte-fallback
tokens (lead bytes at the edges of each length and those whose second byte is restricted, then the edges of that second
byte), the mask must allow no token that spells malformed UTF-8 from there (a surrogate ``ED A0..BF``, an overlong ``E0
80..9F`` or ``F0 80..8F``, ``F4 90..`` past U+10FFFF, a byte that is no continuation) and must allow every single-byte
token that continues the character well. The other way, texts of every kind of code point (the edges of each UTF-8
length, emoji as four bytes, escapes, surrogate pairs written as escapes), as the tokenizer writes them, are taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.schema.string_patterns import Charset
from sglang_constrained.testing.random_walk import token_traits
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import accepts_text, allowed_tokens, compile_valid

S = {"type": "string"}
STRING_IN_OBJECT = {"type": "object", "properties": {"s": S}, "required": ["s"], "additionalProperties": False}


def in_object(value_schema: dict[str, Any]) -> dict[str, Any]:
    return {**STRING_IN_OBJECT, "properties": {"s": value_schema}}


PROBES: dict[str, tuple[str, Any, str, str]] = {
    "JSON string": ("json", STRING_IN_OBJECT, '{"s": "', '"}'),
    "length-bounded string": ("json", in_object({**S, "maxLength": 12}), '{"s": "', '"}'),
    "pattern string": ("json", in_object({**S, "pattern": "^[^,]*$"}), '{"s": "', '"}'),
    "property name": ("json", {"type": "object", "additionalProperties": S}, '{"', '": "x"}'),
    "regex": ("regex", "[^,]*,", "", ","),
    "EBNF class": ("ebnf", 'root ::= [^,]* ","', "", ","),
    "EBNF regex": ("ebnf", 'root ::= Regex("[^,]*,")', "", ","),
}
"""Each: constraint kind and spec, the text that enters a string (a terminal of free characters), the text that
ends it. One probe per way a backend makes a string's characters (xgrammar: its JSON string rule, a ``Regex`` for
bounds and patterns, EBNF classes for regexes and grammars, a ``Regex`` an EBNF grammar writes); any JSON and
structural tags reuse these, and the soundness walks (``test_soundness``) judge their bytes."""

UNSUPPORTED = {  # the reasons are the backends' (test_soundness and test_conformance check them)
    ("outlines", "EBNF class"): "outlines-core has no EBNF",
    ("outlines", "EBNF regex"): "outlines-core has no EBNF",
    ("llguidance", "EBNF regex"): "Regex(...) is xgrammar's EBNF",
}

OUTLINES_C1_CONTROLS = Charset.of([(0x7F, 0x9F)])
NARROWINGS = {
    (backend, probe): OUTLINES_C1_CONTROLS
    for backend in ("outlines",)
    for probe in ("JSON string", "length-bounded string", "property name")
}
"""Code points an engine's own string leaves out, known before this test: outlines-core's JSON string regex is
``[^"\\\\\\x00-\\x1F\\x7F-\\x9F]`` (and it has no ``\\uXXXX`` escapes)."""


def skip_unless_supported(backend_name: str, probe: str) -> None:
    if (backend_name, probe) in UNSUPPORTED:
        pytest.skip(UNSUPPORTED[backend_name, probe])


SECOND_BYTES = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
"""RFC 3629's second-byte ranges that differ from ``80..BF``: no overlong form, no surrogate, nothing past U+10FFFF."""


def is_utf8_prefix(data: bytes) -> bool:
    """Whether ``data`` is well-formed UTF-8 or a proper prefix of it, by RFC 3629's table (Python's incremental
    decoder takes ``ED A0`` as a prefix, and refuses the surrogate only at its third byte)."""
    position = 0
    while position < len(data):
        lead = data[position]
        length = 1 if lead < 0x80 else 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4
        if 0x80 <= lead < 0xC2 or lead > 0xF4:
            return False
        for offset, byte in enumerate(data[position + 1 : position + length], start=1):
            low, high = SECOND_BYTES.get(lead, (0x80, 0xBF)) if offset == 1 else (0x80, 0xBF)
            if not low <= byte <= high:
                return False
        position += length
    return True


LEADS = (0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4)
"""Lead bytes: the edges of each UTF-8 length, and every one whose second byte is restricted (E0, ED, F0, F4)."""


def partial_characters(single_byte_tokens: dict[int, int]) -> list[bytes]:
    """Proper prefixes of well-formed multi-byte characters that single-byte tokens spell: each of ``LEADS``;
    a three- or four-byte lead with the lowest and highest second byte it takes; a four-byte one with a third."""
    prefixes = []
    for lead in (lead for lead in LEADS if lead in single_byte_tokens):
        prefixes.append(bytes([lead]))
        if lead in SECOND_BYTES or lead == 0xE1:
            low, high = SECOND_BYTES.get(lead, (0x80, 0xBF))
            for second in (low, high):
                if second in single_byte_tokens:
                    prefixes.append(bytes([lead, second]))
            if lead >= 0xF0 and {low, 0x80} <= single_byte_tokens.keys():
                prefixes.append(bytes([lead, low, 0x80]))
    return prefixes


def entered(grammar: BaseGrammarObject, setup: TokenizerSetup, text: str) -> BaseGrammarObject:
    for token in setup.encode(text):
        grammar.accept_token(token)
    return grammar


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's token bytes, its single-byte tokens by byte, and the tokens that are malformed UTF-8 from a
    character boundary on (a continuation byte first, a byte UTF-8 never uses, a surrogate, ...)."""

    decoded: tuple[bytes, ...]
    single_byte_tokens: dict[int, int]
    misspelled: frozenset[int]


@pytest.fixture(scope="module")
def vocabulary(tokenizer_case: TokenizerSetup) -> Vocabulary:
    decoded = token_traits(tokenizer_case).decoded
    return Vocabulary(
        decoded=decoded,
        single_byte_tokens={
            token_bytes[0]: token for token, token_bytes in enumerate(decoded) if len(token_bytes) == 1
        },
        misspelled=frozenset(token for token, token_bytes in enumerate(decoded) if not is_utf8_prefix(token_bytes)),
    )


@pytest.fixture(scope="module", params=("xgrammar", "llguidance", "outlines"))
def backend(request: pytest.FixtureRequest, build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> Any:
    return build_backend(request.param, tokenizer_case)


@pytest.mark.parametrize("probe", PROBES)
def test_masks_admit_only_well_formed_utf8(
    backend: Any, tokenizer_case: TokenizerSetup, vocabulary: Vocabulary, probe: str
) -> None:
    skip_unless_supported(backend.name, probe)
    kind, spec, opening, _ = PROBES[probe]
    decoded, single_byte_tokens = vocabulary.decoded, vocabulary.single_byte_tokens
    narrowed = NARROWINGS.get((backend.name, probe), Charset(()))
    grammar = entered(compile_valid(backend, kind, spec), tokenizer_case, opening)
    stops = set(tokenizer_case.eos_token_ids)
    misspelled = sorted(allowed_tokens(grammar, tokenizer_case.vocab_size) & vocabulary.misspelled)
    assert misspelled == [], f"at a character boundary: {[decoded[t] for t in misspelled[:8]]}"
    for prefix in partial_characters(single_byte_tokens):
        for byte in prefix:
            grammar.accept_token(single_byte_tokens[byte])
        allowed = allowed_tokens(grammar, tokenizer_case.vocab_size) - stops
        grammar.rollback(len(prefix))
        misspelled = sorted(token for token in allowed if not is_utf8_prefix(prefix + decoded[token]))
        assert misspelled == [], f"after {prefix!r}: {[decoded[t] for t in misspelled[:8]]}"
        wanted = [
            byte
            for byte in range(0x80, 0xC0)
            if byte in single_byte_tokens
            and is_utf8_prefix(prefix + bytes([byte]))
            and not _is_in(narrowed, prefix + bytes([byte]))
        ]
        missing = [hex(byte) for byte in wanted if single_byte_tokens[byte] not in allowed]
        assert missing == [], f"after {prefix!r} the mask refuses continuation bytes {missing}"


def _is_in(chars: Charset, data: bytes) -> bool:
    """Whether ``data`` spells one whole character, and ``chars`` holds it."""
    text = data.decode("utf-8", errors="ignore")
    return len(text) == 1 and text.encode() == data and chars.contains(ord(text))


EDGE_CHARACTERS = (
    "\u0080", "\u00e9", "\u07ff", "\u0800", "\u20ac", "\ud7ff", "\ue000", "\ufffd", "\uffff", "\U00010000",
    "\U0001f600", "\U0001f469\u200d\U0001f4bb", "\U000e0001", "\U0010ffff",
)  # fmt: skip
"""The first and last code point of each UTF-8 length past ASCII, around the surrogates, emoji (one a ZWJ
sequence), the last code point of all."""
CHARACTERS = st.one_of(
    st.sampled_from(EDGE_CHARACTERS),
    st.characters(min_codepoint=0x80, codec="utf-8"),
    st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters=',"\\'),
)
"""Multi-byte characters (what the UTF-8 limits touch) among printable ASCII."""
ANY_ESCAPE = {("xgrammar", "JSON string"), ("xgrammar", "property name")}
"""Strings that take every character as a ``\\uXXXX`` escape too (surrogate pairs for those past U+FFFF). Known before
this test: llguidance escapes only control characters, outlines-core only ``\\"\\\\/bfnrt``, and patterns (ours, also
xgrammar's length bounds) never produce an escape."""


def reachable_text(backend_name: str, setup: TokenizerSetup, probe: str, text: str) -> str:
    """``text`` without what the backend's known narrowing leaves out, nor what the tokenizer cannot write (SmolLM2
    has no token for the bytes F1 and F2: U+40000-U+BFFFF), at most 12 characters (the length-bounded probe's)."""
    narrowed = NARROWINGS.get((backend_name, probe), Charset(()))
    kept = "".join(
        char for char in text if not narrowed.contains(ord(char)) and setup.tokenizer.decode(setup.encode(char)) == char
    )
    return kept[:12]


@pytest.mark.parametrize("probe", PROBES)
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.lists(CHARACTERS, min_size=1, max_size=6).map("".join))
def test_every_code_point_stays_reachable(backend: Any, tokenizer_case: TokenizerSetup, probe: str, text: str) -> None:
    skip_unless_supported(backend.name, probe)
    kind, spec, opening, closing = PROBES[probe]
    grammar = compile_valid(backend, kind, spec)
    kept = reachable_text(backend.name, tokenizer_case, probe, text)
    assert accepts_text(grammar, tokenizer_case, opening + kept + closing), f"{kept!r} refused"
    if (backend.name, probe) in ANY_ESCAPE:
        escaped = json.dumps(kept)[1:-1]
        assert accepts_text(grammar, tokenizer_case, opening + escaped + closing), f"{escaped!r} refused"
