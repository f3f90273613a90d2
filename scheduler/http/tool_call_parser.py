"""Reading tool calls out of a chat output as it grows: the calls whose name is known, each with the raw text of its
``arguments`` generated so far, and the text outside calls that can be shown already.

One reading serves both answers: the final one (``is_final``) gives the message's ``content`` and ``tool_calls``, and
the streamed one diffs successive readings into OpenAI's deltas (``ToolCallStream``), so the streamed arguments,
joined, are the non-streamed ones: the arguments' JSON text exactly as the model wrote it.

The output's shapes, by ``tool_choice`` (``scheduler.http.tool_calls``): a named function's arguments alone; a JSON
array of ``{"name", "arguments"}`` objects (``required``); or text with ``<tool_call>{"name", "arguments"}
</tool_call>`` calls in it (``auto``; with an answer format, either calls only or the answer only).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_WHITESPACE = " \t\n\r"
_SCALAR_CHARACTERS = frozenset("0123456789+-.eEtruefalsn")

OutputShape = Literal["named", "array", "tagged", "tagged_or_answer"]


@dataclass(frozen=True)
class ParsedCall:
    """A call whose function name is complete; ``arguments``: the JSON text of its arguments so far."""

    name: str
    arguments: str
    is_complete: bool


@dataclass(frozen=True)
class ParsedOutput:
    """``content``: the text outside calls that is certain (stripped; trailing whitespace and what may begin a call
    are held back until the output goes on); ``calls`` in order."""

    content: str
    calls: tuple[ParsedCall, ...]


def parse_output(text: str, shape: OutputShape, is_final: bool, named: str | None = None) -> ParsedOutput:
    """Read ``text`` (the output so far) in ``shape``; ``named``: the function of the ``named`` shape."""
    if shape == "named":
        start = _skip_whitespace(text, 0)
        end = json_value_end(text, start, is_final)
        return ParsedOutput("", (ParsedCall(str(named), text[start:end], end is not None),))
    if shape == "array":  # an output cut short before any call is complete stays text
        calls = tuple(_array_calls(text, is_final))
        return ParsedOutput(_certain(text) if is_final and not calls else "", calls)
    if shape == "tagged_or_answer":
        head = text.lstrip(_WHITESPACE)
        if not head.startswith(CALL_BEGIN):
            if CALL_BEGIN.startswith(head) and not is_final:
                return ParsedOutput("", ())
            return ParsedOutput(_certain(head), ())
    return _tagged(text, is_final)


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

    def __init__(self, shape: OutputShape, named: str | None = None) -> None:
        self.shape = shape
        self.named = named
        self.text = ""
        self._num_content_chars = 0
        self._num_argument_chars: list[int] = []

    def deltas(self, new_text: str, is_final: bool) -> list[dict[str, Any]]:
        """The chat deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``new_text`` adds."""
        self.text += new_text
        parsed = parse_output(self.text, self.shape, is_final, self.named)
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
        return ParsedCall(self.name, arguments, self.arguments_end is not None)


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


def _tagged(text: str, is_final: bool) -> ParsedOutput:
    """Text with ``<tool_call>`` calls: a call cut before its name is complete stays text (held back until the end)."""
    outside: list[str] = []
    calls: list[ParsedCall] = []
    index = 0
    while True:
        begin = text.find(CALL_BEGIN, index)
        if begin < 0:
            outside.append(text[index:] if is_final else _without_call_prefix(text[index:]))
            break
        outside.append(text[index:begin])
        body = _skip_whitespace(text, begin + len(CALL_BEGIN))
        read = _read_call_object(text, body, is_final) if text.startswith("{", body) else None
        call = read.call() if read is not None else None
        if call is None or read is None:
            if is_final:
                outside.append(text[begin:])
            break
        calls.append(call)
        after = _skip_whitespace(text, read.end) if read.end is not None else len(text)
        if not text.startswith(CALL_END, after):
            break
        index = after + len(CALL_END)
    return ParsedOutput(_certain("".join(outside)), tuple(calls))


def _certain(content: str) -> str:
    """Content without leading and trailing whitespace: the final content is stripped, and a stream holds trailing
    whitespace back until more content follows, so that what is streamed adds up to it."""
    return content.strip(_WHITESPACE)


def _without_call_prefix(text: str) -> str:
    """``text`` less its longest suffix that may be the start of ``CALL_BEGIN``."""
    for length in range(min(len(text), len(CALL_BEGIN) - 1), 0, -1):
        if CALL_BEGIN.startswith(text[-length:]):
            return text[:-length]
    return text


def _skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in _WHITESPACE:
        index += 1
    return index
