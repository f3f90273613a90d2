"""Reading tool calls out of a chat output as it grows: the calls whose name is known, each with the raw text of its
``arguments`` generated so far, and the text outside calls that can be shown already.

One reading serves both answers: the final one (``is_final``) gives the message's ``content`` and ``tool_calls``, and
the streamed one diffs successive readings into OpenAI's deltas (``ToolCallStream``). Every reading of a prefix of an
output is a prefix of the reading of the whole output (content, calls in order, each call's arguments), so however
the output is cut into increments the streamed calls add up to the non-streamed ones: the arguments' JSON text
exactly as the model wrote it (for a syntax written parameter by parameter, the JSON object the parameters make).

The output's shapes, by ``tool_choice`` (``scheduler.http.tool_calls``): Hermes' own shapes for ``required`` (a JSON
array of ``{"name", "arguments"}`` objects) and a named function (its arguments alone); otherwise calls written in the
server's ``ToolSyntax`` (``scheduler.http.tool_call_reader``): in free text (``auto``), alone, or either calls only or
an answer only (``auto`` beside an answer format).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler.http.tool_call_reader import (
    WHITESPACE,
    ParsedCall,
    ParsedOutput,
    certain_content,
    json_value_end,
    read_calls,
    skip_whitespace,
)
from scheduler.http.tool_syntaxes import ToolSyntax

OutputShape = Literal["named", "array", "in_text", "calls_or_answer"]
OutputReader = Callable[[str, bool], ParsedOutput]


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
        start = skip_whitespace(text, 0)
        end = json_value_end(text, start, is_final)
        return ParsedOutput("", (ParsedCall(str(named), text[start:end]),))
    if shape == "array":  # an output cut short before any call is complete stays text
        calls = tuple(_array_calls(text, is_final))
        return ParsedOutput(certain_content(text) if is_final and not calls else "", calls)
    if shape == "calls_or_answer":
        head = text.lstrip(WHITESPACE)
        if not head.startswith(syntax.trigger):
            if syntax.trigger.startswith(head) and not is_final:
                return ParsedOutput("", ())
            return ParsedOutput(certain_content(head), ())
    return read_calls(text, syntax, is_final, schemas)


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
        index = skip_whitespace(text, index)
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
        index = skip_whitespace(text, key_end)
        if index >= len(text) or text[index] != ":":
            return read
        index = skip_whitespace(text, index + 1)
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
    index = skip_whitespace(text, 0)
    if not text.startswith("[", index):
        return calls
    index += 1
    while True:
        index = skip_whitespace(text, index)
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
