"""Reading tool calls out of a chat output as it grows: the calls whose name is known, each with the raw text of its
``arguments`` generated so far, and the text outside calls that can be shown already.

One reading serves both answers: the final one (``is_final``) gives the message's ``content`` and ``tool_calls``, and
the streamed one diffs successive readings into OpenAI's deltas (``ToolCallStream``). Every reading of a prefix of an
output is a prefix of the reading of the whole output (content, calls in order, each call's arguments), so however
the output is cut into increments the streamed calls add up to the non-streamed ones: the arguments' JSON text
exactly as the model wrote it.

The output's shapes, by ``tool_choice`` (``scheduler.http.tool_calls``): Hermes' own shapes for ``required`` (a JSON
array of ``{"name", "arguments"}`` objects) and a named function (its arguments alone); otherwise calls written in the
server's ``ToolSyntax`` (``read_calls``, driven by the syntax's data alone): in free text (``auto``), alone, or either
calls only or an answer only (``auto`` beside an answer format).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.http.tool_syntaxes import INDEX, Parameters, ToolSyntax

_WHITESPACE = " \t\n\r"
_SCALAR_CHARACTERS = frozenset("0123456789+-.eEtruefalsn")
_NAME_CHARACTERS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")

OutputShape = Literal["named", "array", "in_text", "calls_or_answer"]
OutputReader = Callable[[str, bool], "ParsedOutput"]


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


def parse_output(
    text: str,
    shape: OutputShape,
    is_final: bool,
    syntax: ToolSyntax,
    schemas: dict[str, dict[str, Any]],
    named: str | None = None,
) -> ParsedOutput:
    """Read ``text`` (the output so far) in ``shape``; ``schemas``: the functions' parameters; ``named``: the function
    of the ``named`` shape."""
    if shape == "named":
        start = _skip_whitespace(text, 0)
        end = json_value_end(text, start, is_final)
        return ParsedOutput("", (ParsedCall(str(named), text[start:end]),))
    if shape == "array":  # an output cut short before any call is complete stays text
        calls = tuple(_array_calls(text, is_final))
        return ParsedOutput(_certain(text) if is_final and not calls else "", calls)
    if shape == "calls_or_answer":
        head = text.lstrip(_WHITESPACE)
        if not head.startswith(syntax.trigger):
            if syntax.trigger.startswith(head) and not is_final:
                return ParsedOutput("", ())
            return ParsedOutput(_certain(head), ())
    return read_calls(text, syntax, is_final, schemas)


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
        if not syntax.sectioned and syntax.separator.strip(_WHITESPACE):
            after_separator = _literal_end(text, index, syntax.separator)
            if after_separator is not None:
                index = after_separator
            elif not is_final and _starts_literal(text, index, syntax.separator):
                break
    return ParsedOutput(_certain("".join(outside)), tuple(calls))


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


class ToolCallStream:
    """One streamed choice's tool calls as OpenAI streams them: each call's ``id``, ``type`` and ``name`` first (with
    empty arguments), then its arguments in deltas as they are generated; content deltas for the text outside calls."""

    def __init__(self, read: OutputReader) -> None:
        self.read = read
        self.text = ""
        self._num_content_chars = 0
        self._num_argument_chars: list[int] = []

    def deltas(self, new_text: str, is_final: bool) -> list[dict[str, Any]]:
        """The chat deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``new_text`` adds."""
        self.text += new_text
        parsed = self.read(self.text, is_final)
        deltas: list[dict[str, Any]] = []
        if len(parsed.content) > self._num_content_chars:
            deltas.append({"content": parsed.content[self._num_content_chars :]})
            self._num_content_chars = len(parsed.content)
        for index, call in enumerate(parsed.calls):
            if index == len(self._num_argument_chars):
                self._num_argument_chars.append(0)
                header = {"index": index, **new_call_id(), "function": {"name": call.name, "arguments": ""}}
                deltas.append({"tool_calls": [header]})
            if len(call.arguments) > self._num_argument_chars[index]:
                more = call.arguments[self._num_argument_chars[index] :]
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": more}}]})
                self._num_argument_chars[index] = len(call.arguments)
        return deltas


def new_call_id() -> dict[str, str]:
    """A call's ``id`` and ``type``, as OpenAI writes them."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function"}


@dataclass
class _CallObject:
    """What has been read of one ``{"name": ..., "arguments": ...}`` object."""

    name: str | None = None
    arguments_start: int | None = None
    arguments_end: int | None = None
    end: int | None = None
    text: str = field(default="", repr=False)

    def call(self) -> ParsedCall | None:
        if self.name is None or self.arguments_start is None:
            return None
        arguments = self.text[self.arguments_start : self.arguments_end]
        return ParsedCall(self.name, arguments)


def _read_call_object(text: str, start: int, is_final: bool) -> _CallObject:
    """Read the call object whose ``{`` is at ``start``, as far as ``text`` goes."""
    read = _CallObject(text=text)
    index = start + 1
    while True:
        index = _skip_whitespace(text, index)
        if index >= len(text):
            return read
        if text[index] == "}":
            read.end = index + 1
            return read
        if text[index] == ",":
            index += 1
            continue
        key_end = json_value_end(text, index, is_final)
        if text[index] != '"' or key_end is None:
            return read
        key = json.loads(text[index:key_end])
        index = _skip_whitespace(text, key_end)
        if index >= len(text) or text[index] != ":":
            return read
        index = _skip_whitespace(text, index + 1)
        if index >= len(text):
            if key == "arguments":
                read.arguments_start = index
            return read
        value_end = json_value_end(text, index, is_final)
        if key == "arguments":
            read.arguments_start, read.arguments_end = index, value_end
        elif key == "name" and value_end is not None:
            name = json.loads(text[index:value_end])
            read.name = name if isinstance(name, str) else None
        if value_end is None:
            return read
        index = value_end


def _array_calls(text: str, is_final: bool) -> list[ParsedCall]:
    calls: list[ParsedCall] = []
    index = _skip_whitespace(text, 0)
    if not text.startswith("[", index):
        return calls
    index += 1
    while True:
        index = _skip_whitespace(text, index)
        if index < len(text) and text[index] == ",":
            index += 1
            continue
        if index >= len(text) or text[index] != "{":
            return calls
        read = _read_call_object(text, index, is_final)
        call = read.call()
        if call is not None:
            calls.append(call)
        if read.end is None:
            return calls
        index = read.end


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
            if syntax.separator.strip(_WHITESPACE):
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
        start = _skip_whitespace(text, index)
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
            if written and parameters.separator.strip(_WHITESPACE):
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
        """A raw-text value: from ``key_end``'s end to ``value_end``, less the line breaks those literals hold."""
        opening = _literal_end(text, key_end, parameters.key_end)
        closing = parameters.value_end.strip(_WHITESPACE)
        end = text.find(closing, opening) if opening is not None else -1
        if opening is None or end < 0:
            return "", None
        raw = text[opening:end]
        raw = raw.removeprefix(parameters.key_end[len(parameters.key_end.rstrip(_WHITESPACE)) :])
        raw = raw.removesuffix(
            parameters.value_end[: len(parameters.value_end) - len(parameters.value_end.lstrip(_WHITESPACE))]
        )
        return json.dumps(raw, ensure_ascii=False), _literal_end(text, end, closing)

    def _json_value(self, text: str, start: int, parameters: Parameters) -> tuple[str, int | None]:
        start = _skip_whitespace(text, start)
        end = json_value_end(text, start, self.is_final)
        if end is None:
            return "", None
        return text[start:end], _literal_end(text, end, parameters.value_end)


def _literal_end(text: str, index: int, literal: str) -> int | None:
    """Where ``literal`` ends if it is written at ``index`` (whitespace around it is let through: a call's JSON may
    end in whitespace); None if it is not, or not yet."""
    index = _skip_whitespace(text, index)
    wanted = literal.strip(_WHITESPACE)
    return index + len(wanted) if text.startswith(wanted, index) else None


def _starts_literal(text: str, index: int, literal: str) -> bool:
    """Whether the text ends in the start of ``literal`` from ``index`` on (after whitespace)."""
    index = _skip_whitespace(text, index)
    return index < len(text) and literal.strip(_WHITESPACE).startswith(text[index:])


def _certain(content: str) -> str:
    """Content without leading and trailing whitespace: the final content is stripped, and a stream holds trailing
    whitespace back until more content follows, so that what is streamed adds up to it."""
    return content.strip(_WHITESPACE)


def _without_prefix_of(text: str, trigger: str) -> str:
    """``text`` less its longest suffix that may be the start of ``trigger``."""
    for length in range(min(len(text), len(trigger) - 1), 0, -1):
        if trigger.startswith(text[-length:]):
            return text[:-length]
    return text


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index
