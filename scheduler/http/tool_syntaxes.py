"""How each model family writes tool calls, as data: ``--tool-call-parser`` names (SGLang's) to ``ToolSyntax``.

A syntax is written once here, and both sides are derived from it: the constraint a call is generated under (a
structural tag in xgrammar's ``format`` form, ``ToolSyntax.calls_format``) and the reading of calls out of the output
(``scheduler.http.tool_call_reader.read_calls``), so the two cannot disagree. Every family here writes a call as
``call_begin NAME name_end ARGUMENTS call_end``; calls are joined by ``separator``, and either stand in free text one
by one (Hermes, Qwen2.5, Qwen3-Coder, gpt-oss) or sit in one section between ``section_begin`` and ``section_end``
(Llama 3, Mistral, DeepSeek-V3, Kimi-K2, pythonic). ``{index}`` in ``name_end`` is the call's number in its section
(Kimi-K2's ``functions.NAME:0``). The arguments are one JSON object, or are written parameter by parameter
(``Parameters``: Qwen3-Coder's ``<parameter=KEY>`` blocks, pythonic ``KEY=VALUE``), each value JSON valid for its
property's schema (Qwen3-Coder writes a string's text as it is); the reader turns those back into the JSON object
OpenAI's ``arguments`` holds.

Which syntax a server uses: ``--tool-call-parser``, else the one the chat template's markers name unambiguously
(``detect_syntax``), else Hermes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from scheduler.http.tool_parameters import Parameters, const
from sglang_constrained.tokenizer.chat_template import template_variables

INDEX = "{index}"
CALL_NUMBER = "(0|[1-9][0-9]{0,3})"


@dataclass(frozen=True)
class ToolSyntax:
    """One family's call syntax. ``trigger``: the text that starts calls in free text (the start of
    ``section_begin``, or of ``call_begin``); ``markers``: strings whose presence in a chat template says it writes
    this syntax (empty: never chosen from a template);
    ``forced_as_json``: ``required`` and a named function are written as vLLM writes them, a JSON array of calls and
    the arguments alone, instead of in this syntax (Hermes, for models such as SmolLM2 that know no tool syntax);
    ``parameters``: the arguments are written parameter by parameter (else as one JSON object)."""

    name: str
    call_begin: str
    name_end: str
    call_end: str
    separator: str
    trigger: str
    section_begin: str = ""
    section_end: str = ""
    markers: tuple[str, ...] = ()
    forced_as_json: bool = False
    parameters: Parameters | None = None

    @property
    def literals(self) -> tuple[str, ...]:
        """The fixed text the syntax writes around names and arguments."""
        parameters = self.parameters
        around = (
            (parameters.begin, parameters.key_end, parameters.value_end, parameters.separator) if parameters else ()
        )
        own = (self.call_begin, self.name_end, self.call_end, self.separator, self.section_begin, self.section_end)
        return own + around

    @property
    def sectioned(self) -> bool:
        """Whether calls sit in one section (else each stands alone in the text)."""
        return bool(self.section_begin)

    def call_tag(self, name: str, schema: dict[str, Any]) -> dict[str, Any]:
        """The ``tag`` format node of one call of ``name`` whose arguments are valid for ``schema``."""
        arguments: dict[str, Any] = {"type": "json_schema", "json_schema": schema}
        if self.parameters is not None:
            arguments = self.parameters.format(schema)
        before_index, has_index, after_index = self.name_end.partition(INDEX)
        if has_index:
            number = {"type": "regex", "pattern": CALL_NUMBER}
            arguments = {"type": "sequence", "elements": [number, const(after_index), arguments]}
        return {
            "type": "tag",
            "begin": self.call_begin + name + before_index,
            "content": arguments,
            "end": self.call_end,
        }

    def calls_format(self, functions: dict[str, dict[str, Any]], parallel: bool, in_text: bool) -> dict[str, Any]:
        """The format node of the calls: ``in_text``, free text in which the trigger starts them (``auto``); else the
        calls alone, at least one (``required``, a named function, ``auto`` beside an answer format). One call at
        most unless ``parallel``."""
        tags = [self.call_tag(name, schema) for name, schema in functions.items()]
        calls = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator,
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
        if not self.sectioned:
            return _triggered(self.trigger, tags, stop_after_first=not parallel) if in_text else calls
        if in_text:
            section = {"type": "tag", "begin": self.section_begin, "content": calls, "end": self.section_end}
            return _triggered(self.trigger, [section], stop_after_first=True)
        return {"type": "sequence", "elements": [const(self.section_begin), calls, const(self.section_end)]}

    def write_calls(self, calls: list[tuple[str, str]], schemas: dict[str, dict[str, Any]] | None = None) -> str:
        """``(name, arguments JSON)`` calls as the model writes them (for a template that cannot render calls);
        calls in free text follow one another directly. ``schemas``: the functions' (for parameters written raw)."""
        return self._write([(name, self._written_arguments(a, (schemas or {}).get(name, {}))) for name, a in calls])

    def example(self) -> str:
        """How to call a function, for the system message that offers the tools; a placeholder stands for a whole
        JSON value (a name in a JSON string is shown without its quotes)."""
        quoted = self.call_begin.endswith('"') and self.name_end.startswith('"')
        call_begin, name_end = (self.call_begin[:-1], self.name_end[1:]) if quoted else (self.call_begin, self.name_end)
        if self.parameters is None:
            return self._write([("<function name>", "<arguments object>")], call_begin, name_end)
        parameters = self.parameters
        one = parameters.begin + "<parameter name>" + parameters.key_end + "<value>" + parameters.value_end
        return self._write([("<function name>", parameters.separator.join([one, "..."]))], call_begin, name_end)

    def _write(self, calls: list[tuple[str, str]], call_begin: str | None = None, name_end: str | None = None) -> str:
        call_begin = self.call_begin if call_begin is None else call_begin
        name_end = self.name_end if name_end is None else name_end
        written = [
            call_begin + name + name_end.replace(INDEX, str(index)) + arguments + self.call_end
            for index, (name, arguments) in enumerate(calls)
        ]
        if not self.sectioned:
            return "".join(written)
        return self.section_begin + self.separator.join(written) + self.section_end

    def _written_arguments(self, arguments: str, schema: dict[str, Any]) -> str:
        if self.parameters is None:
            return arguments
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return self.parameters.write(parsed, schema) if isinstance(parsed, dict) else arguments


def _triggered(trigger: str, tags: list[dict[str, Any]], stop_after_first: bool) -> dict[str, Any]:
    """Free text in which ``trigger`` starts one of ``tags``."""
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": stop_after_first}


SYNTAXES: dict[str, ToolSyntax] = {
    syntax.name: syntax
    for syntax in (
        ToolSyntax(
            "hermes",
            call_begin='<tool_call>{"name": "',
            name_end='", "arguments": ',
            call_end="}</tool_call>",
            separator="\n",
            trigger="<tool_call>",
            forced_as_json=True,
        ),
        ToolSyntax(
            "qwen25",
            call_begin='<tool_call>\n{"name": "',
            name_end='", "arguments": ',
            call_end="}\n</tool_call>",
            separator="\n",
            trigger="<tool_call>",
            markers=("<tool_call>", "<args-json-object>"),
        ),
        ToolSyntax(
            "qwen3_coder",
            call_begin="<tool_call>\n<function=",
            name_end=">\n",
            call_end="</function>\n</tool_call>",
            separator="\n",
            trigger="<tool_call>",
            markers=("<tool_call>", "<function=", "<parameter="),
            parameters=Parameters(
                begin="<parameter=", key_end=">\n", value_end="\n</parameter>\n", separator="", raw_strings=True
            ),
        ),
        ToolSyntax(
            "llama3",
            call_begin='{"name": "',
            name_end='", "parameters": ',
            call_end="}",
            separator=";",
            trigger="<|python_tag|>",
            section_begin="<|python_tag|>",
            section_end="<|eom_id|>",
            markers=("<|python_tag|>",),
        ),
        ToolSyntax(
            "mistral",
            call_begin='{"name": "',
            name_end='", "arguments": ',
            call_end="}",
            separator=", ",
            trigger="[TOOL_CALLS]",
            section_begin="[TOOL_CALLS] [",
            section_end="]",
            markers=("[TOOL_CALLS]",),
        ),
        ToolSyntax(
            "deepseekv3",
            call_begin="<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
            name_end="\n```json\n",
            call_end="\n```<｜tool▁call▁end｜>",
            separator="\n",
            trigger="<｜tool▁calls▁begin｜>",
            section_begin="<｜tool▁calls▁begin｜>",
            section_end="<｜tool▁calls▁end｜>",
            markers=("<｜tool▁calls▁begin｜>",),
        ),
        ToolSyntax(
            "kimi_k2",
            call_begin="<|tool_call_begin|>functions.",
            name_end=":{index}<|tool_call_argument_begin|>",
            call_end="<|tool_call_end|>",
            separator="",
            trigger="<|tool_calls_section_begin|>",
            section_begin="<|tool_calls_section_begin|>",
            section_end="<|tool_calls_section_end|>",
            markers=("<|tool_calls_section_begin|>",),
        ),
        ToolSyntax(
            "pythonic",
            call_begin="",
            name_end="(",
            call_end=")",
            separator=", ",
            trigger="[",
            section_begin="[",
            section_end="]",
            markers=("[func_name1(",),
            parameters=Parameters(begin="", key_end="=", value_end="", separator=", "),
        ),
        ToolSyntax(
            "gpt-oss",
            call_begin="<|channel|>commentary to=functions.",
            name_end=" <|constrain|>json<|message|>",
            call_end="<|call|>",
            separator="<|start|>assistant",
            trigger="<|channel|>commentary to=",
            markers=("<|channel|>", "to=functions."),
        ),
    )
}
DEFAULT_SYNTAX = "hermes"


def detect_syntax(chat_template: str | None) -> ToolSyntax | None:
    """The syntax whose markers a chat template holds, when exactly one does (None: none, or several)."""
    if not chat_template:
        return None
    found = [
        syntax for syntax in SYNTAXES.values() if syntax.markers and all(m in chat_template for m in syntax.markers)
    ]
    return found[0] if len(found) == 1 else None


def resolve_syntax(tool_call_parser: str | None, chat_template: str | None) -> tuple[ToolSyntax, str]:
    """The server's syntax and why it was chosen (for the start-up log)."""
    if tool_call_parser is not None:
        return SYNTAXES[tool_call_parser], f"--tool-call-parser {tool_call_parser}"
    detected = detect_syntax(chat_template)
    if detected is not None:
        return detected, f"the chat template's markers ({', '.join(map(json.dumps, detected.markers))})"
    return SYNTAXES[DEFAULT_SYNTAX], "the default (the chat template names no tool syntax unambiguously)"


def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads a ``tools`` variable (then it is given the tools and earlier calls)."""
    return bool(chat_template) and "tools" in template_variables(chat_template or "")


def writes_special_tokens(syntax: ToolSyntax, tokenizer: Any) -> bool:
    """Whether the syntax's fixed text holds one of the tokenizer's special tokens (Qwen3.5's ``<tool_call>``,
    Llama's ``<|python_tag|>``): then outputs are decoded with special tokens, or the calls could not be read."""
    special = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    return any(token in literal for literal in syntax.literals for token in special)
