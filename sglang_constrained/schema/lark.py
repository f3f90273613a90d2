"""Lark grammars where a grammar is taken: told from GBNF as vLLM tells them, and written as GBNF for xgrammar.

vLLM (``grammar_is_likely_lark``) reads a grammar as Lark unless a line, comments removed, holds ``::=``. llguidance
compiles Lark itself; xgrammar takes GBNF, so a Lark grammar is parsed with the ``lark`` package (its ``%import``s
resolved, ``common.NUMBER`` and the like inlined) and written rule by rule, terminals as rules and ``/regex/``
terminals as xgrammar's ``Regex("...")``. What GBNF cannot say is refused naming the construct: ``%ignore``
(terminals allowed between any two tokens), case-insensitive literals and regex flags, template rules, ``%declare``,
and llguidance's own extensions (``%json``, ``%llguidance``, ``%regex``, ``@sub``-grammars, special tokens).
"""

from __future__ import annotations

import ast
import json
import re

from lark import Token, Tree
from lark.exceptions import GrammarError, LarkError
from lark.grammar import NonTerminal, Terminal
from lark.load_grammar import load_grammar

from sglang_constrained.errors import GrammarSpecError, bounded_message

_COMMENT = re.compile(r"(#|//).*$")
_LLGUIDANCE_EXTENSIONS = (
    (re.compile(r"%json\b"), "%json (an inline JSON schema)"),
    (re.compile(r"%llguidance\b"), "%llguidance (llguidance's options)"),
    (re.compile(r"%regex\b"), "%regex"),
    (re.compile(r"(?m)(^|[\s(|:])@[A-Za-z_]"), "@name (a nested grammar)"),
    (re.compile(r"<\|[^|>]*\|>|<\[\d+\]>"), "special tokens (<|...|>)"),
)
_CLASS_SPECIALS = frozenset("]\\-^[")
_INVALID_LARK = "invalid Lark grammar (read as Lark because no line defines a GBNF rule with '::=')"


def is_lark_grammar(grammar: str) -> bool:
    """vLLM's test: Lark unless some line, its ``#`` and ``//`` comments removed, defines a rule with ``::=``."""
    lines = (_COMMENT.sub("", line).strip() for line in grammar.split("\n"))
    return bool(grammar.strip()) and not any("::=" in line for line in lines)


def lark_to_gbnf(grammar: str, backend_name: str) -> str:
    """The GBNF (root rule ``root``, from Lark's ``start``) of a Lark grammar; raises ``GrammarSpecError`` naming the
    construct that ``backend_name`` cannot take, or Lark's own parse error."""
    for pattern, construct in _LLGUIDANCE_EXTENSIONS:
        if pattern.search(grammar):
            raise GrammarSpecError(
                f"the {backend_name} grammar backend cannot take the Lark grammar: it uses llguidance's extension "
                f"{construct}; use --grammar-backend llguidance or auto"
            )
    try:
        parsed, _ = load_grammar(grammar, "<grammar>", [], False)
    except (GrammarError, LarkError) as e:
        raise GrammarSpecError(f"{_INVALID_LARK}: {bounded_message(str(e))}") from e
    refuse = _Refusal(backend_name)
    if parsed.ignore:
        refuse("%ignore (terminals allowed between any two tokens)")
    definitions = [(name, tree) for name, _, tree, _ in parsed.rule_defs]
    definitions += [(name, tree) for name, (tree, _) in parsed.term_defs]
    if "start" not in (name for name, _ in definitions):
        raise GrammarSpecError(f"{_INVALID_LARK}: it has no 'start' rule, where generation begins")
    declared = [name for name, tree in definitions if tree is None]  # Lark itself refuses undefined names
    if declared:
        refuse(f"%declare ({', '.join(declared)}: names no rule defines)")
    for name, params, _, _ in parsed.rule_defs:
        if params:
            refuse(f"template rule {name}{{{', '.join(params)}}}")
    writer = _GbnfWriter(refuse)
    lines = [f"{writer.rule_name(name)} ::= {writer.expansions(tree)}" for name, tree in definitions]
    return "\n".join(lines) + "\n"


class _Refusal:
    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name

    def __call__(self, construct: str) -> None:
        raise GrammarSpecError(f"the {self.backend_name} grammar backend cannot take the Lark grammar's {construct}")


class _GbnfWriter:
    """Writes the trees of ``lark.load_grammar`` as GBNF expressions."""

    def __init__(self, refuse: _Refusal) -> None:
        self.refuse = refuse

    @staticmethod
    def rule_name(name: str) -> str:
        """Lark's ``start`` is GBNF's ``root``; a Lark rule called ``root`` is renamed out of the way."""
        return {"start": "root", "root": "lark_root"}.get(name, name)

    def expansions(self, tree: Tree) -> str:
        alternatives = [self.expression(child) for child in tree.children]
        return alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"

    def expression(self, node: object) -> str:
        if isinstance(node, NonTerminal | Terminal):
            return self.rule_name(node.name)
        if not isinstance(node, Tree):
            raise GrammarSpecError(f"invalid Lark grammar: unexpected {node!r}")
        kind, children = node.data, node.children
        if kind == "expansions":
            return self.expansions(node)
        if kind == "alias":
            return self.expression(children[0])
        if kind == "expansion":
            return " ".join(self.expression(child) for child in children) if children else '""'
        if kind == "value":
            return self.expression(children[0])
        if kind == "maybe":
            return f"({self.expression(children[0])})?"
        if kind == "expr":
            return self._repeated(children)
        if kind == "literal":
            return self._literal(children[0])
        if kind == "range":
            low, high = (ast.literal_eval(str(bound)) for bound in children)
            return f"[{_class_char(low)}-{_class_char(high)}]"
        if kind == "template_usage":
            self.refuse("template rules")
        raise GrammarSpecError(f"invalid Lark grammar: unexpected {kind}")

    def _repeated(self, children: list[object]) -> str:
        inner = f"({self.expression(children[0])})"
        operator = children[1]
        if str(operator) in ("?", "*", "+"):
            return inner + str(operator)
        bounds = [int(str(bound)) for bound in children[2:]]
        low, high = bounds[0], bounds[-1]
        return f"{inner}{{{low},{high}}}"

    def _literal(self, token: object) -> str:
        text = str(token)
        if isinstance(token, Token) and token.type == "REGEXP":
            pattern, flags = text[1:].rsplit("/", 1)
            if flags:
                self.refuse(f"regex flags ({text})")
            return f"Regex({json.dumps(pattern.replace(chr(92) + '/', '/'))})"
        if text.endswith("i"):
            self.refuse(f"case-insensitive literal ({text})")
        return json.dumps(ast.literal_eval(text), ensure_ascii=False)


def _class_char(char: str) -> str:
    """A character inside a GBNF character class."""
    if char in _CLASS_SPECIALS or ord(char) < 0x20:
        return f"\\u{ord(char):04x}"
    return char
