"""Calls read out of text in a ``ToolSyntax``, driven by the syntax's data alone (``scheduler.http.tool_syntaxes``, from
which the constraint the calls are generated under is derived too): each call's name once it is complete, and its
``arguments`` so far, the JSON text as the model wrote it, or for a syntax of ``Parameters`` the JSON object they make
(a parameter joins it once its value is complete).

Reading a prefix of a text gives a prefix of the reading of the whole text (the text outside calls, held back while it
may begin the trigger; the calls in order; each call's arguments), which is what lets streaming cut an output
anywhere (``scheduler.http.tool_call_parser``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scheduler.http.tool_parameters import Parameters
from scheduler.http.tool_syntaxes import INDEX, ToolSyntax

WHITESPACE = " \t\n\r"
_SCALAR_CHARACTERS = frozenset("0123456789+-.eEtruefalsn")
_NAME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")


@dataclass(frozen=True)
class ParsedCall:
    """A call whose function name is complete; ``arguments``: the JSON text of its arguments so far."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """``content``: the text outside calls that is certain (stripped; trailing whitespace and what may begin a call
    are held back until the output goes on); ``calls`` in order."""

    content: str
    calls: tuple[ParsedCall, ...]


def read_calls(
    text: str, syntax: ToolSyntax, is_final: bool, schemas: dict[str, dict[str, Any]] | None = None
) -> ParsedOutput:
    """Text with calls in ``syntax``: each trigger starts a call (or a section of calls); a call cut before its name
    and ``name_end`` are complete is not read yet, and text that does not follow the syntax after a trigger is content
    at the end (held back until then). ``schemas``: the functions' parameters (which parameters are raw text)."""
    reader = _CallReader(text, syntax, is_final, schemas or {})
    outside: list[str] = []
    calls: list[ParsedCall] = []
    index = 0
    while True:
        begin = text.find(syntax.trigger, index)
        if begin < 0:
            rest = text[index:]
            outside.append(rest if is_final else _without_prefix_of(rest, syntax.trigger))
            break
        outside.append(text[index:begin])
        block = reader.section(begin) if syntax.sectioned else reader.call(begin)
        calls += block.calls
        if block.end is None:
            if is_final and not block.calls:
                outside.append(text[begin:])
            break
        index = block.end
        if not syntax.sectioned and syntax.separator.strip(WHITESPACE):
            after_separator = _literal_end(text, index, syntax.separator)
            if after_separator is not None:
                index = after_separator
            elif not is_final and _starts_literal(text, index, syntax.separator):
                break
    return ParsedOutput(certain_content("".join(outside)), tuple(calls))


def json_value_end(text: str, start: int, is_final: bool) -> int | None:
    """The end (exclusive) of the JSON value that starts at ``text[start]``, or None while it is incomplete (a number
    or literal at the end of a text that may go on is incomplete)."""
    if start >= len(text):
        return None
    first = text[start]
    if first in '{["':
        depth, in_string, escaped = 0, False, False
        for index in range(start, len(text)):
            char = text[index]
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
                    if depth == 0:
                        return index + 1
            elif char == '"':
                in_string = True
            elif char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return index + 1
        return None
    index = start
    while index < len(text) and text[index] in _SCALAR_CHARACTERS:
        index += 1
    return index if index < len(text) or is_final else None


@dataclass(frozen=True)
class _Block:
    """Calls read from one trigger on; ``end``: where the text after them starts, None if they may go on (or the
    text stopped following the syntax)."""

    calls: tuple[ParsedCall, ...]
    end: int | None


_NO_CALL = _Block((), None)


class _CallReader:
    """Reads calls from positions of one text in one syntax."""

    def __init__(self, text: str, syntax: ToolSyntax, is_final: bool, schemas: dict[str, dict[str, Any]]) -> None:
        self.text = text
        self.syntax = syntax
        self.is_final = is_final
        self.schemas = schemas

    def section(self, begin: int) -> _Block:
        """``section_begin``, calls joined by ``separator``, ``section_end``."""
        text, syntax = self.text, self.syntax
        index = _literal_end(text, begin, syntax.section_begin)
        calls: list[ParsedCall] = []
        while index is not None:
            block = self.call(index)
            calls += block.calls
            if block.end is None:
                break
            index = block.end
            if syntax.separator.strip(WHITESPACE):
                after_separator = _literal_end(text, index, syntax.separator)
                if after_separator is not None:
                    index = after_separator
                    continue
            elif _literal_end(text, index, syntax.call_begin) is not None or _starts_literal(
                text, index, syntax.call_begin
            ):
                continue
            return _Block(tuple(calls), _literal_end(text, index, syntax.section_end))
        return _Block(tuple(calls), None)

    def call(self, begin: int) -> _Block:
        """``call_begin NAME name_end ARGUMENTS call_end``; the call is read once its ``name_end`` is complete."""
        text, syntax = self.text, self.syntax
        index = _literal_end(text, begin, syntax.call_begin)
        if index is None:
            return _NO_CALL
        name_start = index
        while index < len(text) and text[index] in _NAME_CHARACTERS:
            index += 1
        name = text[name_start:index]
        before_number, has_number, after_number = syntax.name_end.partition(INDEX)
        index = _literal_end(text, index, before_number) if name and index < len(text) else None
        if index is not None and has_number:
            digits_start = index
            while index < len(text) and text[index].isdigit():
                index += 1
            complete = index > digits_start and index < len(text)
            index = _literal_end(text, index, after_number) if complete else None
        if index is None:
            return _NO_CALL
        if syntax.parameters is not None:
            arguments, end = self.parameters(index, syntax.parameters, self.schemas.get(name, {}))
            return _Block((ParsedCall(name, arguments),), end)
        start = skip_whitespace(text, index)
        end = json_value_end(text, start, self.is_final)
        call = (ParsedCall(name, text[start:end]),)
        return _Block(call, None if end is None else _literal_end(text, end, syntax.call_end))

    def parameters(self, index: int, parameters: Parameters, schema: dict[str, Any]) -> tuple[str, int | None]:
        """The arguments as a JSON object, each parameter added once its value is complete, closed at ``call_end``;
        and where the call ends (None: not yet, or the text stopped following the syntax)."""
        text = self.text
        properties = schema.get("properties") or {}
        written: list[str] = []
        while True:
            if written and parameters.separator.strip(WHITESPACE):
                after_separator = _literal_end(text, index, parameters.separator)
                if after_separator is not None:
                    index = after_separator
                elif (end := _literal_end(text, index, self.syntax.call_end)) is not None:
                    return "{" + ", ".join(written) + "}", end
                else:
                    break
            elif (end := _literal_end(text, index, self.syntax.call_end)) is not None:
                return "{" + ", ".join(written) + "}", end
            key_start = _literal_end(text, index, parameters.begin)
            if key_start is None:
                break
            key_end = key_start
            while key_end < len(text) and text[key_end] in _NAME_CHARACTERS:
                key_end += 1
            key = text[key_start:key_end]
            value_start = _literal_end(text, key_end, parameters.key_end) if key and key_end < len(text) else None
            if value_start is None:
                break
            if parameters.is_raw(properties.get(key)):
                value, index_after = self._raw_value(text, key_end, parameters)
            else:
                value, index_after = self._json_value(text, value_start, parameters)
            if index_after is None:
                break
            written.append(f"{json.dumps(key)}: {value}")
            index = index_after
        return "{" + ", ".join(written), None

    def _raw_value(self, text: str, key_end: int, parameters: Parameters) -> tuple[str, int | None]:
        """A raw-text value: its text up to the first ``value_end`` as written (the end of the grammar's tag), less
        the line break ``key_end`` holds."""
        opening = _literal_end(text, key_end, parameters.key_end)
        end = text.find(parameters.value_end, opening) if opening is not None else -1
        if opening is None or end < 0:
            return "", None
        raw = text[opening:end].removeprefix(parameters.key_end[len(parameters.key_end.rstrip(WHITESPACE)) :])
        return json.dumps(raw, ensure_ascii=False), end + len(parameters.value_end)

    def _json_value(self, text: str, start: int, parameters: Parameters) -> tuple[str, int | None]:
        start = skip_whitespace(text, start)
        end = json_value_end(text, start, self.is_final)
        if end is None:
            return "", None
        return text[start:end], _literal_end(text, end, parameters.value_end)


def _literal_end(text: str, index: int, literal: str) -> int | None:
    """Where ``literal`` ends if it is written at ``index`` (whitespace around it is let through: a call's JSON may
    end in whitespace); None if it is not, or not yet."""
    index = skip_whitespace(text, index)
    wanted = literal.strip(WHITESPACE)
    return index + len(wanted) if text.startswith(wanted, index) else None


def _starts_literal(text: str, index: int, literal: str) -> bool:
    """Whether the text ends in the start of ``literal`` from ``index`` on (after whitespace)."""
    index = skip_whitespace(text, index)
    return index < len(text) and literal.strip(WHITESPACE).startswith(text[index:])


def certain_content(content: str) -> str:
    """Content without leading and trailing whitespace: the final content is stripped, and a stream holds trailing
    whitespace back until more content follows, so that what is streamed adds up to it."""
    return content.strip(WHITESPACE)


def _without_prefix_of(text: str, trigger: str) -> str:
    """``text`` less its longest suffix that may be the start of ``trigger``."""
    for length in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-length:]):
            return text[:-length]
    return text


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index
