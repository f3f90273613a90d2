"""A JSON Schema ``pattern`` rewritten so that no engine can produce an invalid JSON string from it.

Measured with random walks through the engines' own masks (``tests/backends/test_soundness.py``): xgrammar writes a
pattern's quotes, backslashes and control characters raw into the JSON text, and takes ``\\S`` to include no-break
spaces; outlines-core pastes the pattern between quotes, so ``.`` or ``[^x]`` emit raw quotes and control characters,
and its ``\\d``/``\\w`` match non-ASCII digits and letters; llguidance turns a class that holds every control
character into ``\\"`` and ``\\\\``. The pattern is therefore parsed (ECMA-262 and Python's syntax agree on what
schemas use) and written back, for every backend, as a regex over the string's characters in which:

* ``\\d``, ``\\w``, ``\\s``, their negations and ``.`` are explicit classes with ECMA-262's meaning;
* ``X?`` is written ``(X|)``: xgrammar 0.2.8 drops the first element of an optional group holding a repetition;
* every class, ``.`` and negation leaves out ``"``, ``\\`` and U+0000-U+001F, so the engines only ever emit
  characters a JSON string holds as they are (a deliberate narrowing: a pattern never produces those);
* a pattern that needs one of them (a literal quote, a class of nothing else) is refused, as are constructs with no
  regular equivalent (back-references, look-around, word boundaries, inner anchors, flags);
* anchors stay where they are meaningful (the ends of the pattern or of its top-level alternatives); when only some
  alternatives are anchored, all are (a narrowing: the engines anchor every pattern anyway, or search otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

try:
    import re._constants as sre_constants
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants
    import sre_parse

from sglang_constrained.errors import GrammarSpecError

MAX_CODEPOINT = 0x10FFFF
_UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
_SPACE = (
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
)
_LINE_TERMINATORS = ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029))
_CATEGORIES = {
    sre_constants.CATEGORY_DIGIT: (_DIGIT, False),
    sre_constants.CATEGORY_NOT_DIGIT: (_DIGIT, True),
    sre_constants.CATEGORY_WORD: (_WORD, False),
    sre_constants.CATEGORY_NOT_WORD: (_WORD, True),
    sre_constants.CATEGORY_SPACE: (_SPACE, False),
    sre_constants.CATEGORY_NOT_SPACE: (_SPACE, True),
}
_CLASS_SPECIAL = frozenset('\\]^-["')
_REGEX_SPECIAL = frozenset("\\.^$|?*+()[]{}")


@dataclass(frozen=True)
class Charset:
    """A set of code points as sorted, disjoint, non-adjacent inclusive ranges."""

    ranges: tuple[tuple[int, int], ...]

    @staticmethod
    def of(ranges: Iterable[tuple[int, int]]) -> Charset:
        merged: list[tuple[int, int]] = []
        for low, high in sorted(ranges):
            if merged and low <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], high))
            else:
                merged.append((low, high))
        return Charset(tuple(merged))

    def complement(self) -> Charset:
        gaps, start = [], 0
        for low, high in self.ranges:
            if low > start:
                gaps.append((start, low - 1))
            start = high + 1
        if start <= MAX_CODEPOINT:
            gaps.append((start, MAX_CODEPOINT))
        return Charset(tuple(gaps))

    def union(self, other: Charset) -> Charset:
        return Charset.of((*self.ranges, *other.ranges))

    def intersect(self, other: Charset) -> Charset:
        return self.complement().union(other.complement()).complement()

    def contains(self, codepoint: int) -> bool:
        return any(low <= codepoint <= high for low, high in self.ranges)


SAFE = Charset.of(_UNSAFE).complement()
"""What a pattern may produce: every character a JSON string holds as it is."""


def json_safe_pattern(pattern: str) -> str:
    """``pattern`` rewritten as described in the module doc; raises ``GrammarSpecError`` naming what cannot be."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as e:
        raise GrammarSpecError(f"cannot read the pattern: {e}") from e
    if parsed.state.flags & (re.IGNORECASE | re.MULTILINE | re.DOTALL | re.VERBOSE):
        raise GrammarSpecError("a pattern with inline flags such as (?i) is not supported")
    items, anchored_start, anchored_end = _without_edge_anchors(list(parsed), True, True)
    return ("^" if anchored_start else "") + _sequence(items) + ("$" if anchored_end else "")


_END_ANCHORS = ((sre_constants.AT, sre_constants.AT_END), (sre_constants.AT, sre_constants.AT_END_STRING))
Node = tuple[object, object]


def _without_edge_anchors(items: list[Node], at_start: bool, at_end: bool) -> tuple[list[Node], bool, bool]:
    """``items`` with the anchors at its edges removed (into groups and alternatives that sit at an edge), and
    whether a start and an end anchor were found."""
    saw_start = saw_end = False
    if at_start and items and items[0] == (sre_constants.AT, sre_constants.AT_BEGINNING):
        items, saw_start = items[1:], True
    if at_end and items and items[-1] in _END_ANCHORS:
        items, saw_end = items[:-1], True
    for index in sorted({0, len(items) - 1}) if items else ():
        node_start = at_start and index == 0
        node_end = at_end and index == len(items) - 1
        node, found_start, found_end = _node_without_edge_anchors(items[index], node_start, node_end)
        items = [*items[:index], node, *items[index + 1 :]]
        saw_start, saw_end = saw_start or found_start, saw_end or found_end
    return items, saw_start, saw_end


def _node_without_edge_anchors(node: Node, at_start: bool, at_end: bool) -> tuple[Node, bool, bool]:
    op, argument = node
    if op is sre_constants.BRANCH and isinstance(argument, tuple):
        stripped = [_without_edge_anchors(list(branch), at_start, at_end) for branch in argument[1]]
        branches = [branch for branch, _, _ in stripped]
        return (op, (argument[0], branches)), any(s for _, s, _ in stripped), any(e for _, _, e in stripped)
    if op is sre_constants.SUBPATTERN and isinstance(argument, tuple):
        group, add_flags, del_flags, inner = argument
        inner_items, found_start, found_end = _without_edge_anchors(list(inner), at_start, at_end)
        return (op, (group, add_flags, del_flags, inner_items)), found_start, found_end
    return node, False, False


def _sequence(items: Iterable[tuple[object, object]]) -> str:
    return "".join(_node(op, argument) for op, argument in items)


def _node(op: object, argument: object) -> str:
    if op is sre_constants.LITERAL:
        assert isinstance(argument, int)
        if not SAFE.contains(argument):
            raise GrammarSpecError(
                f"the pattern requires the character {chr(argument)!r}, which a JSON string can only hold escaped; "
                "patterns here never produce quotes, backslashes or control characters"
            )
        return _literal(argument)
    if op is sre_constants.NOT_LITERAL:
        assert isinstance(argument, int)
        return _charset(Charset.of([(argument, argument)]).complement())
    if op is sre_constants.ANY:
        return _charset(Charset.of(_LINE_TERMINATORS).complement())
    if op is sre_constants.IN:
        assert isinstance(argument, list)
        return _charset(_class(argument))
    if op is sre_constants.BRANCH:
        assert isinstance(argument, tuple)
        return "(" + "|".join(_sequence(branch) for branch in argument[1]) + ")"
    if op is sre_constants.SUBPATTERN:
        assert isinstance(argument, tuple)
        _, add_flags, del_flags, inner = argument
        if add_flags or del_flags:
            raise GrammarSpecError("a pattern with inline flags such as (?i) is not supported")
        return "(" + _sequence(inner) + ")"
    if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
        assert isinstance(argument, tuple)
        low, high, inner = argument
        if (low, high) == (0, 1):  # xgrammar 0.2.8 drops the first element of "(X)?" when X holds a repetition
            return "(" + _sequence(inner) + "|)"
        return "(" + _sequence(inner) + ")" + _quantifier(low, high)
    raise GrammarSpecError(f"the pattern uses {_construct_name(op, argument)}, which has no regular equivalent here")


def _class(items: list[tuple[object, object]]) -> Charset:
    negated = bool(items) and items[0][0] is sre_constants.NEGATE
    members = Charset(())
    for op, argument in items[int(negated) :]:
        if op is sre_constants.LITERAL:
            assert isinstance(argument, int)
            members = members.union(Charset.of([(argument, argument)]))
        elif op is sre_constants.RANGE:
            assert isinstance(argument, tuple)
            members = members.union(Charset.of([argument]))
        elif op is sre_constants.CATEGORY and argument in _CATEGORIES:
            ranges, is_negated = _CATEGORIES[argument]
            category = Charset.of(ranges)
            members = members.union(category.complement() if is_negated else category)
        else:
            construct = _construct_name(op, argument)
            raise GrammarSpecError(f"the pattern uses {construct} in a class, which is not supported")
    return members.complement() if negated else members


def _charset(chars: Charset) -> str:
    """A class for ``chars`` minus the unsafe characters.

    Sets that run to the last code point are written as a negation: a positive range that spans the surrogates
    would let an engine that builds UTF-8 automata from code point ranges emit bytes that are not UTF-8.
    """
    allowed = chars.intersect(SAFE)
    if not allowed.ranges:
        raise GrammarSpecError(
            "a class of the pattern holds only quotes, backslashes or control characters, which a JSON string can "
            "only hold escaped; patterns here never produce them"
        )
    if allowed.ranges[-1][1] == MAX_CODEPOINT:
        return "[^" + "".join(_class_range(low, high) for low, high in allowed.complement().ranges) + "]"
    return "[" + "".join(_class_range(low, high) for low, high in allowed.ranges) + "]"


def _class_range(low: int, high: int) -> str:
    if low == high:
        return _class_char(low)
    return f"{_class_char(low)}-{_class_char(high)}"


def _class_char(codepoint: int) -> str:
    if 0x20 < codepoint < 0x7F and chr(codepoint) not in _CLASS_SPECIAL:
        return chr(codepoint)
    return _escape(codepoint)


def _literal(codepoint: int) -> str:
    char = chr(codepoint)
    if char in _REGEX_SPECIAL:
        return "\\" + char
    return char if 0x20 <= codepoint < 0x7F or codepoint > 0xFFFF else _escape(codepoint)


def _escape(codepoint: int) -> str:
    return f"\\u{codepoint:04x}" if codepoint <= 0xFFFF else chr(codepoint)


def _quantifier(low: int, high: int) -> str:
    unbounded = high is sre_constants.MAXREPEAT or high == sre_constants.MAXREPEAT
    if unbounded:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _construct_name(op: object, argument: object) -> str:
    names = {
        sre_constants.GROUPREF: "a back-reference",
        sre_constants.ASSERT: "look-around (a look-ahead or look-behind)",
        sre_constants.ASSERT_NOT: "look-around (a negative look-ahead or look-behind)",
        sre_constants.AT: "a word boundary or an anchor inside the pattern",
    }
    return names.get(op, f"'{str(op).lower()}'")
