"""xgrammar grammars rewritten by ``well_formed_utf8_grammar`` take exactly the well-formed UTF-8 of what they say.

Checked on xgrammar itself, byte by byte, over a byte-level vocabulary: for character classes of any range (EBNF's
and a ``Regex``'s, positive and negated), ``.`` and negated escapes, every byte sequence at the edges of UTF-8
(surrogates, overlong forms, past U+10FFFF, stray continuation bytes) is taken exactly when it is one well-formed
character of the set. Literals and classes that can only spell a surrogate are refused; the rest of a grammar
(literals with NUL or Latin-1 letters, tags) is kept as it was.
"""

from __future__ import annotations

import pytest
import xgrammar
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.xgrammar.utf8 import well_formed_regex, well_formed_utf8_grammar
from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.string_patterns import MAX_CODEPOINT, SAFE, Charset

BYTE_VOCABULARY = xgrammar.TokenizerInfo([bytes([byte]) for byte in range(256)] + [b"</s>"], stop_token_ids=[256])
COMPILER = xgrammar.GrammarCompiler(BYTE_VOCABULARY, max_threads=1, cache_enabled=False)

LEADS = (0x00, 0x41, 0x7F, 0x80, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE, 0xEF)
LEADS += (0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF)
SECONDS = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0)
EDGE_SEQUENCES = (
    [bytes([lead]) for lead in LEADS]
    + [bytes([lead, second]) for lead in LEADS if lead >= 0xC0 for second in SECONDS]
    + [bytes([lead, second, third]) for lead in LEADS if lead >= 0xE0 for second in SECONDS for third in (0x80, 0xBF)]
    + [
        bytes([lead, second, 0x80, last])
        for lead in LEADS
        if lead >= 0xF0
        for second in SECONDS
        for last in (0x80, 0xBF)
    ]
)
"""Byte sequences at the edges of UTF-8: every kind of lead byte followed by the edges of each continuation range."""
EDGE_CODEPOINTS = (0, 0x7F, 0x80, 0x7FF, 0x800, 0xD7FF, 0xD800, 0xDFFF, 0xE000, 0xFFFF, 0x10000, MAX_CODEPOINT)
CODEPOINTS = st.one_of(
    st.sampled_from(EDGE_CODEPOINTS),
    st.sampled_from(EDGE_CODEPOINTS).flatmap(lambda edge: st.integers(max(edge - 2, 0), min(edge + 2, MAX_CODEPOINT))),
    st.integers(0, MAX_CODEPOINT),
)


def taken(grammar: xgrammar.Grammar, data: bytes) -> bool:
    matcher = xgrammar.GrammarMatcher(COMPILER.compile_grammar(grammar))
    return bool(matcher.accept_string(data) and matcher.is_completed())


def one_character(data: bytes) -> int | None:
    """The code point ``data`` spells when it is exactly one well-formed UTF-8 character."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return ord(text) if len(text) == 1 else None


def assert_takes_exactly(grammar: xgrammar.Grammar, members: Charset, extra: list[int]) -> None:
    """``grammar`` takes a sequence of :data:`EDGE_SEQUENCES` (and the UTF-8 of ``extra``) iff it is one
    well-formed character of ``members``."""
    matcher = xgrammar.GrammarMatcher(COMPILER.compile_grammar(grammar))
    sequences = EDGE_SEQUENCES + [
        chr(c).encode() for c in extra if not 0xD800 <= c <= 0xDFFF and 0 <= c <= MAX_CODEPOINT
    ]
    wrong = []
    for data in sequences:
        matcher.reset()
        codepoint = one_character(data)
        expected = codepoint is not None and members.contains(codepoint)
        if bool(matcher.accept_string(data) and matcher.is_completed()) != expected:
            wrong.append((data.hex(), expected))
    assert wrong == [], f"(bytes, should be taken) wrong: {wrong[:10]}"


def ebnf_char(codepoint: int) -> str:
    return f"\\U{codepoint:08x}"


def regex_char(codepoint: int) -> str:
    return f"\\\\u{{{codepoint:x}}}"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(low=CODEPOINTS, high=CODEPOINTS, is_negated=st.booleans(), in_regex=st.booleans())
def test_a_class_takes_exactly_its_well_formed_characters(
    low: int, high: int, is_negated: bool, in_regex: bool
) -> None:
    low, high = min(low, high), max(low, high)
    if in_regex:
        ebnf = f'root ::= Regex("[{"^" if is_negated else ""}{regex_char(low)}-{regex_char(high)}]")'
    else:
        ebnf = f"root ::= [{'^' if is_negated else ''}{ebnf_char(low)}-{ebnf_char(high)}]"
    members = Charset.of([(low, high)])
    members = members.complement() if is_negated else members
    if not is_negated and 0xD800 <= low <= high <= 0xDFFF:
        with pytest.raises(GrammarSpecError, match="surrogates"):
            well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf(ebnf))
        return
    grammar = well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf(ebnf))
    assert_takes_exactly(grammar, members, [low - 1, low, high, high + 1])


REGEX_SETS = [
    (".", Charset.of([(0, MAX_CODEPOINT)])),
    ("\\\\D", Charset.of([(0x30, 0x39)]).complement()),
    ("\\\\S", Charset.of([(0x09, 0x0D), (0x20, 0x20)]).complement()),
    ("[^a\\\\d]", Charset.of([(0x30, 0x39), (0x61, 0x61)]).complement()),
    ("[\\\\u0800-\\\\u0900\\\\ue000-\\\\uffff\\\\x80]", Charset.of([(0x80, 0x80), (0x800, 0x900), (0xE000, 0xFFFF)])),
]


@pytest.mark.parametrize(("regex", "members"), REGEX_SETS, ids=[regex for regex, _ in REGEX_SETS])
def test_dots_and_escapes_of_a_regex_take_exactly_their_well_formed_characters(regex: str, members: Charset) -> None:
    assert_takes_exactly(
        well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf(f'root ::= Regex("{regex}")')), members, []
    )


def test_a_json_strings_regex_keeps_from_what_a_json_string_escapes() -> None:
    grammar = well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf('root ::= Regex("[^a]", json_string=true)'))
    assert_takes_exactly(grammar, SAFE.intersect(Charset.of([(0x61, 0x61)]).complement()), [])


@pytest.mark.parametrize(
    "ebnf",
    [
        'root ::= "a\\ud800"',
        'root ::= Regex("\\\\ud800")',
        "root ::= [\\ud800-\\udfff]",
        'root ::= Regex("[\\\\ud800]")',
    ],
)
def test_what_can_only_spell_a_surrogate_is_refused(ebnf: str) -> None:
    with pytest.raises(GrammarSpecError, match="surrogates"):
        well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf(ebnf))


def test_the_rest_of_a_grammar_is_kept() -> None:
    """xgrammar's printed EBNF would lose both literals (``\\xfca`` reads back as U+0FCA; a literal ends at NUL)."""
    grammar = well_formed_utf8_grammar(xgrammar.Grammar.from_ebnf('root ::= "a\\0b" | "\\u00fca" | [x-z]+ "."'))
    assert taken(grammar, b"a\x00b") and taken(grammar, "üa".encode()) and taken(grammar, b"xyz.")
    assert not taken(grammar, "\u0fca".encode()) and not taken(grammar, b"a")


def test_ascii_classes_of_a_regex_are_kept_as_written() -> None:
    assert well_formed_regex("[a-z]+(\\.[0-9]{2})?\\d\\w") == "[a-z]+(\\.[0-9]{2})?\\d\\w"
    assert (
        well_formed_regex("[^a]")
        == "([\\x00-\\x60\\x62-\\x7f]|[\x80-\u07ff]|[\u0800-\ud7ff\ue000-\uffff]|[\U00010000-\U0010ffff])"
    )
