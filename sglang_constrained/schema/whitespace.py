"""The whitespace allowed between JSON tokens, the same on every backend: by default what a reader would write.

The default allows at most one line break, then at most ``MAX_INDENT`` spaces or tabs: compact JSON, ``json.dumps``'s
``", "`` and ``": "``, and pretty-printed JSON indented up to 20 columns (depth 10 at indent 2, 5 at indent 4) pass;
blank lines and runs of spaces do not, so a model cannot wander off into whitespace until its token limit.
``--constrained-json-whitespace-pattern`` sets another regex (llguidance, outlines), and
``--constrained-json-disable-any-whitespace`` allows none.
"""

from __future__ import annotations

MAX_INDENT = 20
DEFAULT_JSON_WHITESPACE_PATTERN = rf"(\r?\n)?[ \t]{{0,{MAX_INDENT}}}"
DEFAULT_JSON_WHITESPACE_EBNF = f'("\\n" | "\\r\\n")? [ \\t]{{0,{MAX_INDENT}}}'
"""``DEFAULT_JSON_WHITESPACE_PATTERN`` in xgrammar's EBNF."""
OUTLINES_JSON_WHITESPACE_PATTERN = r"(\r?\n)?[ \t]*"
"""outlines' default: no blank lines, indentation unbounded. Its automaton grows with the bound: with
``DEFAULT_JSON_WHITESPACE_PATTERN`` the any-object schema (``json_object``) compiled past the 50 s deadline."""


def json_whitespace_pattern(
    pattern: str | None, disable_any_whitespace: bool, default: str = DEFAULT_JSON_WHITESPACE_PATTERN
) -> str:
    """The whitespace regex allowed between JSON tokens (``default`` when neither flag is set); raises
    ``ValueError`` for contradictory settings."""
    if pattern is not None and disable_any_whitespace:
        raise ValueError(
            "--constrained-json-whitespace-pattern and --constrained-json-disable-any-whitespace conflict: "
            "set one, not both"
        )
    if pattern is not None:
        return pattern
    return "" if disable_any_whitespace else default
