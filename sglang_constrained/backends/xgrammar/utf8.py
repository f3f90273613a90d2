"""xgrammar grammars whose terminals produce only well-formed UTF-8 (RFC 3629).

xgrammar 0.2.8 matches a character against its grammar's terminals by code point, decoding the text's UTF-8
leniently (measured with byte-level walks; ``tests/backends/test_engine_faults.py`` keeps the reproductions):

* a character class decodes ``ED A0..BF xx`` as U+D800-U+DFFF, so a class that spans the UTF-16 surrogates (every
  negated class, hence every JSON string's characters, a regex's ``.`` or ``[^x]``) lets one through as bytes;
* a ``Regex(...)`` of the grammar (a JSON Schema ``pattern``, or one an EBNF grammar writes) is built from byte
  ranges that also take overlong forms (``E0 80..9F xx``, ``F0 80..8F xx xx``) where a range crosses the start of
  the three- or four-byte characters, which every negated class and ``.`` does;
* a string literal or a regex escape may name a surrogate (``"\\ud800"``), which it spells ``ED A0 80``.

So every grammar is rewritten before it is compiled, exactly, through xgrammar's own serialised form (its printed
EBNF does not read back as it was: ``\\xfc`` followed by ``a`` reads as U+0FCA, and a literal stops at a NUL):
every character class leaves out the surrogates (a negated one gains the range ``\\ud800-\\udfff``: one more range to
test, nothing more per token); inside a ``Regex``, every class, ``.`` and negated escape that reaches past ASCII
becomes an alternation of classes that each hold characters of one UTF-8 length and no surrogate, which xgrammar
builds exactly; a literal or class that can only produce a surrogate is refused. Nothing valid is left out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import xgrammar

from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.string_patterns import MAX_CODEPOINT, SAFE, Charset

GRAMMAR_FORMAT_VERSION = "v16"
"""The version of xgrammar's serialised ``Grammar`` whose layout this module edits (xgrammar 0.2.8)."""
BYTE_STRING, CHARACTER_CLASS, CHARACTER_CLASS_STAR, REGEX = 0, 1, 2, 12
"""Expression types of that layout: each expression is ``[type, data length, data...]``; a class's data is
``[is_negated, low, high, low, high, ...]``, a literal's its UTF-8 bytes and a regex's ``[is_json_string, UTF-8
bytes...]``, bytes as signed chars."""

SURROGATES = Charset.of([(0xD800, 0xDFFF)])
ENCODABLE = SURROGATES.complement()
"""Every code point UTF-8 can encode."""
UTF8_LENGTHS = (Charset.of([(0, 0x7F)]), Charset.of([(0x80, 0x7FF)]), Charset.of([(0x800, 0xFFFF)]))
FOUR_BYTES = Charset.of([(0x10000, MAX_CODEPOINT)])
_SURROGATES_TEXT = "UTF-16 surrogates (U+D800-U+DFFF), which UTF-8 cannot encode"


def check_grammar_format() -> None:
    """Raise ``RuntimeError`` unless xgrammar serialises grammars in the layout this module edits (called when a
    backend is built: an xgrammar release that changes it must be looked at before it serves)."""
    version = json.loads(xgrammar.Grammar.from_ebnf('root ::= "a"').serialize_json()).get("__VERSION__")
    if version != GRAMMAR_FORMAT_VERSION:
        raise RuntimeError(
            f"xgrammar serialises grammars as {version}, not {GRAMMAR_FORMAT_VERSION}: check whether its character "
            "matching is still lenient (tests/backends/test_engine_faults.py) and update "
            "sglang_constrained/backends/xgrammar/utf8.py"
        )


def well_formed_utf8_grammar(grammar: xgrammar.Grammar) -> xgrammar.Grammar:
    """``grammar`` with every terminal limited to well-formed UTF-8 (see the module doc); raises
    ``GrammarSpecError`` when a literal or class can only produce a surrogate."""
    serialized = json.loads(grammar.serialize_json())
    data, starts = serialized["grammar_expr_data"], serialized["grammar_expr_indptr"]
    rewritten: list[int] = []
    new_starts: list[int] = []
    for start, end in zip(starts, [*starts[1:], len(data)], strict=True):
        new_starts.append(len(rewritten))
        rewritten += _well_formed_expression(data[start:end])
    serialized["grammar_expr_data"], serialized["grammar_expr_indptr"] = rewritten, new_starts
    return xgrammar.Grammar.deserialize_json(json.dumps(serialized))


def _well_formed_expression(expression: list[int]) -> list[int]:
    kind, payload = expression[0], expression[2:]
    if kind == BYTE_STRING:
        if _holds_surrogate(_bytes(payload)):
            raise GrammarSpecError(f"the grammar has a literal that holds {_SURROGATES_TEXT}")
        return expression
    if kind in (CHARACTER_CLASS, CHARACTER_CLASS_STAR):
        data = [*_well_formed_class(bool(payload[0]), _pairs(payload[1:]))]
    elif kind == REGEX:
        regex = well_formed_regex(_regex_text(_bytes(payload[1:])), bool(payload[0]))
        data = [payload[0], *(byte - 256 if byte > 0x7F else byte for byte in regex.encode())]
    else:
        return expression
    return [kind, len(data), *data]


def _bytes(data: list[int]) -> bytes:
    """The bytes of a literal's or regex's data (stored as signed chars)."""
    return bytes(value & 0xFF for value in data)


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _well_formed_class(is_negated: bool, ranges: list[tuple[int, int]]) -> Iterator[int]:
    """A class's data (``is_negated`` first) that takes no surrogate: a negated class excludes them as well, a
    positive one loses them (and anything past U+10FFFF)."""
    yield int(is_negated)
    if is_negated:
        for low, high in ranges:
            yield from (low, high)
        yield from (0xD800, 0xDFFF)
        return
    allowed = Charset.of(ranges).intersect(ENCODABLE)
    if not allowed.ranges:
        raise GrammarSpecError(f"the grammar has a character class that holds only {_SURROGATES_TEXT}")
    for low, high in allowed.ranges:
        yield from (low, high)


def _holds_surrogate(literal: bytes) -> bool:
    return any(literal[i] == 0xED and 0xA0 <= literal[i + 1] <= 0xBF for i in range(len(literal) - 1))


def _regex_text(regex: bytes) -> str:
    try:
        return regex.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GrammarSpecError(f"the grammar has a regex that is not UTF-8 (it holds {_SURROGATES_TEXT})") from e


# xgrammar's regex dialect (its ``RegexFSMBuilder``): the escapes, class escapes and ``.`` it knows.
_SINGLE_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07, "e": 0x1B, "0": 0x00}
_CLASS_ESCAPES = {
    "d": Charset.of([(0x30, 0x39)]),
    "w": Charset.of([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]),
    "s": Charset.of([(0x09, 0x0D), (0x20, 0x20)]),
}
_EVERY_CHARACTER = Charset.of([(0, MAX_CODEPOINT)])


def well_formed_regex(regex: str, is_json_string: bool = False) -> str:
    """``regex`` (xgrammar's dialect) with every class, ``.`` and negated class escape that reaches past ASCII
    written as an alternation of classes of one UTF-8 length each and no surrogate; the rest is kept as written.

    ``is_json_string``: the regex is a JSON string's (``Regex(..., json_string=true)``), whose classes xgrammar
    keeps from quotes, backslashes and control characters; the rewritten ones keep from them too.
    """
    pieces, position = [], 0
    while position < len(regex):
        char = regex[position]
        if char == "\\":
            end = _escape_end(regex, position)
            escape = regex[position:end]
            members = _escape_members(escape, in_class=False)
            if len(escape) == 2 and escape[1] in "DWS":
                pieces.append(_alternation(members, is_json_string))
            else:
                if members.intersect(SURROGATES).ranges:
                    raise GrammarSpecError(
                        f"the grammar has a regex escape {escape} that names one of the {_SURROGATES_TEXT}"
                    )
                pieces.append(escape)
            position = end
        elif char == "[":
            end = _class_end(regex, position)
            text = regex[position:end]
            members = _class_members(text) if text.endswith("]") else Charset(())  # unclosed: xgrammar refuses
            is_ascii = not members.ranges or members.ranges[-1][1] < 0x80
            pieces.append(text if is_ascii else _alternation(members, is_json_string))
            position = end
        elif char == ".":
            pieces.append(_alternation(_EVERY_CHARACTER, is_json_string))
            position += 1
        else:
            pieces.append(char)
            position += 1
    return "".join(pieces)


def _alternation(members: Charset, is_json_string: bool) -> str:
    allowed = members.intersect(ENCODABLE)
    if is_json_string:
        allowed = allowed.intersect(SAFE)
    if not allowed.ranges:
        raise GrammarSpecError(f"the grammar has a regex class that holds only {_SURROGATES_TEXT}")
    classes = []
    for length in (*UTF8_LENGTHS, FOUR_BYTES):
        part = allowed.intersect(length)
        if part.ranges:
            classes.append("[" + "".join(_class_range(low, high) for low, high in part.ranges) + "]")
    return "(" + "|".join(classes) + ")"


def _class_range(low: int, high: int) -> str:
    return _class_char(low) if low == high else f"{_class_char(low)}-{_class_char(high)}"


def _class_char(codepoint: int) -> str:
    """A code point as a class member: ASCII as ``\\xHH`` (exactly two digits in this dialect), the rest raw."""
    return f"\\x{codepoint:02x}" if codepoint < 0x80 else chr(codepoint)


def _escape_end(regex: str, position: int) -> int:
    """Where the escape starting at ``position`` (a backslash) ends."""
    if position + 1 >= len(regex):
        return len(regex)
    escaped = regex[position + 1]
    if escaped == "x":
        return min(position + 4, len(regex))
    if escaped == "u":
        if regex.startswith("{", position + 2):
            close = regex.find("}", position + 2)
            return len(regex) if close < 0 else close + 1
        return min(position + 6, len(regex))
    if escaped == "c":
        return min(position + 3, len(regex))
    return position + 2


def _escape_members(escape: str, in_class: bool) -> Charset:
    """What an escape matches, as xgrammar reads it (an unknown escape matches its character; a malformed one,
    which xgrammar refuses, nothing)."""
    escaped, argument = escape[1:2], escape[2:].strip("{}")
    if escaped.lower() in _CLASS_ESCAPES:
        members = _CLASS_ESCAPES[escaped.lower()]
        return members.complement() if escaped.isupper() else members
    if escaped in _SINGLE_ESCAPES:
        return _single(_SINGLE_ESCAPES[escaped])
    if escaped == "b" and in_class:
        return _single(0x08)
    if escaped in ("x", "u"):
        try:
            return _single(int(argument, 16))
        except ValueError:
            return Charset(())
    if escaped == "c":
        return _single(ord(argument) & 0x1F) if argument else Charset(())
    return _single(ord(escaped)) if escaped else Charset(())


def _single(codepoint: int) -> Charset:
    return Charset(((codepoint, codepoint),))


def _class_end(regex: str, position: int) -> int:
    """Where the class starting at ``position`` (a ``[``) ends: after its first unescaped ``]``, as xgrammar reads."""
    index = position + 1
    if index < len(regex) and regex[index] == "^":
        index += 1
    while index < len(regex):
        if regex[index] == "\\":
            index += 2
        elif regex[index] == "]":
            return index + 1
        else:
            index += 1
    return len(regex)


def _class_members(text: str) -> Charset:
    """The code points a class such as ``[^a-z\\d]`` matches, as xgrammar's ``ParseCharacterClassLeaf`` reads it: a
    dash between a character and another makes a range, any other dash is itself."""
    body = text[1:-1]
    is_negated = body.startswith("^")
    position, members = int(is_negated), []
    while position < len(body):
        low, position = _class_unit(body, position)
        is_single = len(low.ranges) == 1 and low.ranges[0][0] == low.ranges[0][1]
        if is_single and position + 1 < len(body) and body[position] == "-":
            high, position = _class_unit(body, position + 1)
            if not high.ranges or high.ranges[-1][1] < low.ranges[0][0]:
                raise GrammarSpecError(f"the grammar has a regex class with an invalid range: {text[:60]}")
            members.append((low.ranges[0][0], high.ranges[-1][1]))
        else:
            members += low.ranges
    charset = Charset.of(members)
    return charset.complement() if is_negated else charset


def _class_unit(body: str, position: int) -> tuple[Charset, int]:
    """The escape or character at ``position`` of a class body, and where it ends."""
    if body[position] == "\\":
        end = _escape_end(body, position)
        return _escape_members(body[position:end], in_class=True), end
    return _single(ord(body[position])), position + 1
