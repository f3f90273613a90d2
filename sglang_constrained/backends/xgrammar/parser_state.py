"""An exact key for the state of an xgrammar matcher, read from its Earley parser (xgrammar 0.2.8).

What the parser keeps (xgrammar's ``cpp/earley_parser.h``): one row per accepted byte (and one at the start) holding
the scanable ``ParserState``s after that byte, the states waiting there for a rule predicted there to complete (its
parents), and whether the root rule completed; and the flag of an accepted stop token. A completed rule returns to the
row its states name in ``rule_start_pos`` (-1: the root's). ``GrammarMatcher._debug_print_internal_state()`` prints
the last row's scanable states with every field (rule, sequence, element, the place in a byte string or a UTF-8
character, repeat count, partial code point, ...), never the waiting states: ``root ::= "a" X "b" | "c" X "ddd"``
prints the same rows, one by one, after ``a(`` and after ``c(``. So no key made of printouts alone is sound.

But a row is a function of the bytes before it. The key is the printed states, whether the root has completed, and the
accepted bytes up to the furthest row a printed state returns to: equal keys mean equal states over equal rows, so
equal futures. States that return to the root, or to a row both share, merge however they were spelt since: a
string's content loops, a closed rule forgets its bytes; an open rule keeps the bytes before it.

Not keyed (None): grammars with token or character budgets (``max_tokens``, ``max_chars``: their deadlines count
tokens and characters, not bytes) and token terminals (``Token(...)``, structural tags' token triggers: a row per token,
not per byte); a state with a deadline, or a printout with a row count other than the bytes accepted plus one.
"""

from __future__ import annotations

import re
from collections.abc import Hashable

import xgrammar

UNKEYED_FIELD = "_deadline="
"""What the printout of the ``ParserState`` fields that count tokens or characters holds (``budget_deadline``,
``char_budget_deadline``; printed where set). The others are rule, sequence, element, rule_start_pos, the place in a
byte string or a UTF-8 character, repeat count, partial code point and temperature rule."""
_UNKEYED_GRAMMAR = re.compile(r"max_tokens=|max_chars=|Token\(|TokenTagDispatch\(")
_PRINTOUT = re.compile(r"There are (\d+) steps in history\. Last step: \[(.*)\]\s*\Z", re.DOTALL)
_STATE = re.compile(r"ParserState\([^)]*\)")
_START = re.compile(r"rule_start_pos=(-?\d+)")
TERMINATED = ("terminated",)
"""The key of every matcher that has accepted a stop token: nothing follows."""


def is_keyed_grammar(compiled_grammar: xgrammar.CompiledGrammar) -> bool:
    """Whether the matchers of ``compiled_grammar`` move byte by byte with no budget (their state is keyed)."""
    return _UNKEYED_GRAMMAR.search(str(compiled_grammar.grammar)) is None


def matcher_state_key(matcher: xgrammar.GrammarMatcher, accepted: bytes | bytearray) -> Hashable | None:
    """The key of ``matcher``'s state, the matcher having accepted exactly the bytes ``accepted`` (from a keyed
    grammar); None where its printout is not what this module reads. The state does not change."""
    if matcher.is_terminated():
        return TERMINATED
    printout = _PRINTOUT.match(matcher._debug_print_internal_state())
    if printout is None or int(printout[1]) != len(accepted) + 1:
        return None
    states = printout[2]
    if UNKEYED_FIELD in states:
        return None
    furthest_row = max(map(int, _START.findall(states)), default=0)
    return matcher.is_completed(), frozenset(_STATE.findall(states)), bytes(accepted[: max(furthest_row, 0)])
