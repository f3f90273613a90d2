r"""xgrammar's JSON grammars with the default whitespace (``json_whitespace``): at most one line break, then at most
``MAX_INDENT`` spaces or tabs between tokens.

xgrammar 0.2.8 bounds whitespace only by a count (``max_whitespace_cnt``), which still lets blank lines through. Its
JSON grammar is built with a bound no schema writes, printed as EBNF, each use of its whitespace rules (written
``whitespace_N{0, bound}``) replaced by the default's rule, and compiled from that EBNF. The printer writes
U+0080..U+00FF as ``\xHH`` but the parser reads ``\x`` with every hex digit that follows (``"é9"`` came back as
U+0E99), so those escapes are rewritten as ``\u00HH``, which the parser reads as exactly four digits.
"""

from __future__ import annotations

import re

import xgrammar

from sglang_constrained.schema.whitespace import DEFAULT_JSON_WHITESPACE_EBNF

_BOUND = 7919
_WHITESPACE_USE = re.compile(rf"\bwhitespace(?:_\d+)?\{{0, {_BOUND}\}}")
_RULE = "json_whitespace"
_LATIN1_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")
r"""A ``\xHH`` escape, not an escaped backslash followed by ``xHH``."""


def json_schema_ebnf(schema: str) -> str:
    """The EBNF (root rule ``root``) of xgrammar's strict-mode grammar for ``schema``, with the default whitespace.
    Raises ``RuntimeError`` for a schema xgrammar cannot take."""
    grammar = xgrammar.Grammar.from_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=_BOUND, strict_mode=True
    )
    ebnf = _LATIN1_ESCAPE.sub(r"\1\\u00\2", _WHITESPACE_USE.sub(_RULE, str(grammar)))
    return f"{ebnf}\n{_RULE} ::= {DEFAULT_JSON_WHITESPACE_EBNF}\n"


def compact_json_schema_ebnf(schema: str) -> str:
    """The EBNF of xgrammar's strict-mode grammar for ``schema`` with no whitespace between tokens
    (``--constrained-json-disable-any-whitespace``), for a structural tag's JSON, whose own compile has no such
    option. Raises ``RuntimeError`` for a schema xgrammar cannot take."""
    grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":"), strict_mode=True)
    return _LATIN1_ESCAPE.sub(r"\1\\u00\2", str(grammar))
