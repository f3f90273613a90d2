"""Our format regexes and rewritten patterns, against their own oracles (no engine involved): every string a regex
matches passes jsonschema's format checker, and a rewritten pattern only matches what the user's pattern matches,
never a character a JSON string must escape."""

from __future__ import annotations

import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.soundness import sound_json_schema, user_patterns_in
from sglang_constrained.schema.string_formats import FORMAT_PATTERNS, format_pattern
from sglang_constrained.schema.string_patterns import json_safe_pattern
from sglang_constrained.testing.random_walk import ecma_regex

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
UNSAFE = re.compile(r'["\\\x00-\x1f]')


@pytest.mark.parametrize("name", sorted(FORMAT_PATTERNS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_string_of_a_format_regex_passes_the_format_checker(name: str, data: st.DataObject) -> None:
    pattern = format_pattern(name)
    assert pattern is not None
    text = data.draw(st.from_regex(pattern, fullmatch=True), label="text")
    assert CHECKER.conforms(text, name), f"{text!r} is not a {name}"
    assert not UNSAFE.search(text)


FORMAT_EDGES = [
    ("date", "2024-02-29", True),
    ("date", "2023-02-29", False),
    ("date", "1900-02-29", False),
    ("date", "2000-02-29", True),
    ("date", "0000-01-01", False),
    ("date", "2024-09-31", False),
    ("time", "23:59:59.5+01:00", True),
    ("time", "12:00:60Z", False),
    ("time", "12:00:00", False),
    ("date-time", "2024-09-30t22:16:48z", True),
    ("date-time", "2024-09-31T22:16:48Z", False),
    ("ipv4", "192.168.0.1", True),
    ("ipv4", "054.1.1.1", False),
    ("ipv4", "256.1.1.1", False),
    ("hostname", "a-b.example.com", True),
    ("hostname", "-a.com", False),
    ("hostname", "a" * 64, False),
    ("email", "ada.lovelace@example.org", True),
    ("json-pointer", "/a~1b/0", True),
    ("json-pointer", "a/b", False),
    ("relative-json-pointer", "0#", True),
    ("relative-json-pointer", "01/a", False),
]


@pytest.mark.parametrize(("name", "text", "matches"), FORMAT_EDGES)
def test_format_regexes_on_edge_cases(name: str, text: str, matches: bool) -> None:
    pattern = format_pattern(name)
    assert pattern is not None
    assert bool(re.fullmatch(pattern, text)) is matches
    if matches:
        assert CHECKER.conforms(text, name)


USER_PATTERNS = [
    "^a.b$",
    "^[^x]{1,5}$",
    "^\\s\\S$",
    "^\\w+\\W\\d\\D$",
    "^(ab|c)+?$",
    "[a-z\\d_-]+",
    "^[\\u00e9\\u00a0]+$",
    "^\\d{3}-\\d{4}$",
    "^abc$|^def$",
    "^a(bc+)?Z$",
    "^[A-Z]{2,}(-[0-9]+)*$",
    "^[^,]*$",
]


@pytest.mark.parametrize("pattern", USER_PATTERNS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_rewritten_pattern_only_matches_safe_strings_the_original_matches(pattern: str, data: st.DataObject) -> None:
    rewritten = json_safe_pattern(pattern)
    text = data.draw(st.from_regex(rewritten, fullmatch=True), label="text")
    assert not UNSAFE.search(text), f"{rewritten!r} produced {text!r}"
    assert ecma_regex(pattern).search(text), f"{text!r} does not match {pattern!r}"


REFUSED_PATTERNS = [
    ('^a"b$', "requires the character '\"'"),
    ("^\\t$", "requires the character '\\t'"),
    ("^[\\x00-\\x1f]$", "holds only quotes, backslashes or control characters"),
    ("(a)\\1", "back-reference"),
    ("(?=a)b", "look-around"),
    ("\\bword", "word boundary"),
    ("(?i)abc", "inline flags"),
    ("a^b", "anchor inside"),
    ("[", "cannot read the pattern"),
]


@pytest.mark.parametrize(("pattern", "words"), REFUSED_PATTERNS)
def test_patterns_that_cannot_be_made_safe_are_refused_by_reason(pattern: str, words: str) -> None:
    with pytest.raises(GrammarSpecError, match=re.escape(words)):
        json_safe_pattern(pattern)


def test_the_schema_rewrite_keeps_the_users_patterns_for_messages() -> None:
    schema = {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}, "code": {"type": "string", "pattern": "^.{2}$"}},
        "patternProperties": {"^x.$": {"type": "integer"}},
    }
    originals: dict[str, str] = {}
    rewritten = sound_json_schema(schema, originals)
    assert schema["properties"]["when"] == {"type": "string", "format": "date"}  # the request's own is untouched
    assert rewritten["properties"]["when"] == {"type": "string", "pattern": format_pattern("date")}
    code_pattern = rewritten["properties"]["code"]["pattern"]
    assert originals[code_pattern] == "^.{2}$"
    assert user_patterns_in(f"bad regex /{code_pattern}/", originals) == "bad regex /^.{2}$/"
    (name_pattern,) = rewritten["patternProperties"]
    assert originals[name_pattern] == "^x.$"


def test_a_rewritten_format_next_to_a_pattern_is_refused() -> None:
    with pytest.raises(GrammarSpecError, match="'format': 'date' together with 'pattern'"):
        sound_json_schema({"type": "string", "format": "date", "pattern": "^2"})
