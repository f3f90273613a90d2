"""xgrammar's structural tag ``format`` form as an llguidance Lark grammar, so that llguidance compiles the tags
xgrammar does (what tool calls beside an answer format are sent as, ``scheduler.http.tool_calls``).

Formats: ``const_string``, ``json_schema`` (``style`` json), ``regex``, ``grammar`` (GBNF or Lark, a nested
grammar), ``any_text``, ``sequence``, ``or``, ``optional``, ``plus``, ``star``, ``repeat``, ``tag`` (string begin and
ends), ``triggered_tags`` and ``tags_with_separator``. The token-level formats, ``dispatch`` and the XML argument
styles are refused naming the format. Free text around triggered tags never holds a trigger (a trigger starts a tag),
as xgrammar enforces; a tag that ends any text ends at the first occurrence of its end (a lazy lexeme).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from sglang_constrained.constraint_spec import escape_regex_literal
from sglang_constrained.errors import GrammarSpecError

_ANY_TEXT = r"/(.|\n)*/"
_REPETITIONS = {"optional": "?", "plus": "+", "star": "*"}
_SUPPORTED = (
    "const_string, json_schema, regex, grammar, any_text, sequence, or, optional, plus, star, repeat, tag, "
    "triggered_tags, tags_with_separator"
)


def structural_tag_to_lark(
    tag: dict[str, Any], json_schema: Callable[[Any], dict[str, Any]], grammar_to_lark: Callable[[str], str]
) -> str:
    """The llguidance grammar (Lark, or llguidance's JSON list of grammars when ``grammar`` formats nest) of a
    ``{"type": "structural_tag", "format": ...}``. ``json_schema`` prepares a ``json_schema`` format's schema (the
    backend's checks and JSON options); ``grammar_to_lark`` gives a ``grammar`` format's Lark. Raises
    ``GrammarSpecError`` naming an unsupported format and where it is."""
    writer = _LarkWriter(json_schema, grammar_to_lark)
    start = writer.format(tag["format"], "/format")
    main = "\n".join([f"start: {start}", *writer.rules]) + "\n"
    if not writer.nested:
        return main
    grammars = [{"name": "structural_tag", "lark_grammar": main}]
    grammars += [{"name": name, "lark_grammar": lark} for name, lark in writer.nested.items()]
    return json.dumps({"grammars": grammars})


class _LarkWriter:
    """Lark expressions for format nodes; ``rules``: the extra rules and terminals written; ``nested``: the nested
    grammars by name."""

    def __init__(self, json_schema: Callable[[Any], dict[str, Any]], grammar_to_lark: Callable[[str], str]) -> None:
        self.json_schema = json_schema
        self.grammar_to_lark = grammar_to_lark
        self.rules: list[str] = []
        self.nested: dict[str, str] = {}

    def format(self, node: Any, where: str) -> str:
        if not isinstance(node, dict) or not isinstance(node.get("type"), str):
            raise GrammarSpecError(f"invalid structural tag at {where}: a format is an object with a 'type'")
        kind = node["type"]
        if kind == "const_string":
            return _literal(_text(node, "value", where))
        if kind == "json_schema":
            if node.get("style", "json") != "json":
                raise _unsupported(f"json_schema style {node['style']!r}", where)
            return "%json " + json.dumps(self.json_schema(node.get("json_schema")), ensure_ascii=False)
        if kind == "regex":
            return _regex(_text(node, "pattern", where))
        if kind == "grammar":
            name = f"grammar_{len(self.nested)}"
            self.nested[name] = self.grammar_to_lark(_text(node, "grammar", where))
            return f"@{name}"
        if kind == "any_text":
            return _ANY_TEXT
        if kind in ("sequence", "or"):
            elements = enumerate(_list(node, "elements", where))
            parts = [self.format(item, f"{where}/elements/{i}") for i, item in elements]
            return "(" + (" " if kind == "sequence" else " | ").join(parts) + ")"
        if kind in ("optional", "plus", "star"):
            inner = self.format(node.get("content"), f"{where}/content")
            return f"({inner}){_REPETITIONS[kind]}"
        if kind == "repeat":
            low, high = node.get("min", 0), node.get("max", -1)
            inner = self.format(node.get("content"), f"{where}/content")
            return f"({inner}){{{low},{'' if high is None or high < 0 else high}}}"
        if kind == "tag":
            return self.tag(node, where)
        if kind == "triggered_tags":
            return self.triggered_tags(node, where)
        if kind == "tags_with_separator":
            return self.tags_with_separator(node, where)
        raise _unsupported(f"format {kind!r}", where)

    def tag(self, node: dict[str, Any], where: str, skip: int = 0) -> str:
        """``begin content end``; ``skip``: characters of ``begin`` already matched (its trigger)."""
        begin = _text(node, "begin", where)[skip:]
        ends = node.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not ends or not all(isinstance(end, str) for end in ends):
            raise _unsupported("a tag whose begin or end is not a string", where)
        end = "(" + " | ".join(_literal(end) for end in ends) + ")"
        content = node.get("content")
        if isinstance(content, dict) and content.get("type") == "any_text":
            name = f"tag_text_{len(self.rules)}"
            self.rules.append(f"{name}[lazy]: {_ANY_TEXT} {end}")
            return f"{_literal(begin)} {name}"
        return f"{_literal(begin)} {self.format(content, f'{where}/content')} {end}"

    def triggered_tags(self, node: dict[str, Any], where: str) -> str:
        triggers = _list(node, "triggers", where)
        if not triggers or not all(isinstance(trigger, str) and trigger for trigger in triggers):
            raise GrammarSpecError(f"invalid structural tag at {where}: triggers must be non-empty strings")
        number = len(self.rules)
        text = f"TRIGGER_FREE_{number}"
        alternation = "|".join(escape_regex_literal(trigger).replace("/", "\\/") for trigger in triggers)
        self.rules.append(f"{text}: {_ANY_TEXT} & ~/(.|\\n)*({alternation})(.|\\n)*/")
        tags = []
        for index, tag in enumerate(_list(node, "tags", where)):
            tag_where = f"{where}/tags/{index}"
            begin = _text(tag, "begin", tag_where)
            trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
            if trigger is None:
                raise GrammarSpecError(f"invalid structural tag at {tag_where}: its begin starts with no trigger")
            name = f"tag_{number}_{index}"
            self.rules.append(f"{name}_trigger[lazy]: {text} {_literal(trigger)}")
            self.rules.append(f"{name}: {name}_trigger {self.tag(tag, tag_where, skip=len(trigger))}")
            tags.append(name)
        one = "(" + " | ".join(tags) + ")"
        if node.get("stop_after_first"):
            return one if node.get("at_least_one") else f"({one} | {text})"
        return f"{one}{'+' if node.get('at_least_one') else '*'} {text}"

    def tags_with_separator(self, node: dict[str, Any], where: str) -> str:
        tags = [self.tag(tag, f"{where}/tags/{i}") for i, tag in enumerate(_list(node, "tags", where))]
        one = "(" + " | ".join(f"({tag})" for tag in tags) + ")"
        separator = _literal(_text(node, "separator", where))
        some = one if node.get("stop_after_first") else f"{one} ({separator} {one})*"
        return some if node.get("at_least_one") else f"({some})?"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else '""'


def _regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _text(node: dict[str, Any], key: str, where: str) -> str:
    value = node.get(key)
    if not isinstance(value, str):
        raise GrammarSpecError(f"invalid structural tag at {where}: '{key}' must be a string")
    return value


def _list(node: dict[str, Any], key: str, where: str) -> list[Any]:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise GrammarSpecError(f"invalid structural tag at {where}: '{key}' must be a non-empty list")
    return value


def _unsupported(what: str, where: str) -> GrammarSpecError:
    return GrammarSpecError(
        f"the llguidance grammar backend cannot compile the structural tag's {what} (at {where}); it compiles "
        f"{_SUPPORTED}"
    )
