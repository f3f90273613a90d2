"""Tool calls on chat completions: the prompt that offers the tools, the constraint that keeps a call inside its
function's ``parameters`` schema, and the answer's ``tool_calls`` read back from the output.

Calls are written in the server's ``ToolSyntax`` (``scheduler.http.tool_syntaxes``: ``--tool-call-parser``, or the
one the chat template names; Hermes' ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` by default). A chat
template that renders tools is given them, and the earlier calls of assistant messages, as Hugging Face templates take
them; otherwise (SmolLM2's) the tools are offered in a system message and earlier calls are written into the
assistant's content in the syntax. By ``tool_choice``:

- ``"required"``: one call or more, alone (one at most when ``parallel_tool_calls`` is false), each ``arguments``
  valid for its function's schema; Hermes writes them as vLLM does, as a JSON array of ``{"name", "arguments"}``;
- a named function: one call of it, alone; Hermes writes its arguments alone, a JSON value valid for its schema;
- ``"auto"`` (the default with tools): free text, where the syntax's trigger starts a call that is then kept to the
  named function's schema (the first call, or section of calls, ends the output unless parallel calls are allowed);
  with an answer format (``response_format`` or another constraint field), either calls only or an answer valid for
  that format, chosen by the model at its first token;
- ``"none"``: the tools are neither offered nor called, and the answer format applies.

Every call is held to its schema in every mode, whatever the tool's ``strict`` says (true, false or null). With
``required`` or a named function the answer format is for a later turn's answer, as OpenAI reads it. Calls are read
back by ``scheduler.http.tool_call_parser``, which also streams them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Literal

from scheduler.http.constraint_fields import requested_constraint
from scheduler.http.protocol import ChatCompletionRequest, Message, NamedToolChoice, ProtocolError
from scheduler.http.tool_call_parser import OutputShape, new_call_id, parse_output
from scheduler.http.tool_call_reader import ParsedOutput
from scheduler.http.tool_syntaxes import (
    DEFAULT_SYNTAX,
    SYNTAXES,
    ToolSyntax,
    renders_tools,
    resolve_syntax,
    writes_special_tokens,
)
from sglang_constrained.constraint_spec import GrammarSpecError, choices_to_regex

ANY_OBJECT: dict[str, Any] = {"type": "object"}
logger = logging.getLogger("scheduler.http")


@dataclass(frozen=True)
class ToolFormat:
    """The server's way with tools: the syntax calls are written in, whether its chat template renders tools
    (``tool_syntaxes.renders_tools``), and whether the syntax writes special tokens of its tokenizer (then outputs
    with tools are decoded with special tokens unless a request says otherwise)."""

    syntax: ToolSyntax
    template_renders_tools: bool
    writes_special_tokens: bool = False


def server_tool_format(tool_call_parser: str | None, tokenizer: Any) -> ToolFormat:
    """The server's tool format from ``--tool-call-parser`` and its tokenizer's chat template (the choice is
    logged)."""
    chat_template = _template_for_tools(tokenizer)
    syntax, why = resolve_syntax(tool_call_parser, chat_template)
    renders = renders_tools(chat_template)
    offered = "the chat template renders them" if renders else "offered in a system message"
    logger.info("tool calls are written in the %s syntax, chosen by %s; tools are %s", syntax.name, why, offered)
    return ToolFormat(syntax, renders, writes_special_tokens(syntax, tokenizer))


def _template_for_tools(tokenizer: Any) -> str | None:
    """The chat template a request with tools is rendered by: of a tokenizer with several named templates, its
    ``tool_use`` one if it has one (as transformers chooses), else its default."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        return str(tokenizer.get_chat_template(tools=[]))
    except ValueError:  # several templates, none of them the default
        return None


DEFAULT_TOOL_FORMAT = ToolFormat(SYNTAXES[DEFAULT_SYNTAX], template_renders_tools=False)
"""A server whose chat template names no tool syntax and renders no tools (SmolLM2's)."""


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools. ``functions``: name → parameters schema; ``named``: the forced one;
    ``answer``: with ``auto``, the format a text answer must have (a structural tag ``format`` node), if any."""

    mode: Literal["auto", "required", "named"]
    syntax: ToolSyntax
    functions: dict[str, dict[str, Any]]
    descriptions: dict[str, str]
    parallel: bool
    named: str | None = None
    answer: dict[str, Any] | None = None

    @property
    def shape(self) -> OutputShape:
        """How the output is written (``tool_call_parser``)."""
        if self.mode != "auto":
            if not self.syntax.forced_as_json:
                return "in_text"
            return "named" if self.mode == "named" else "array"
        return "in_text" if self.answer is None else "calls_or_answer"

    def read(self, text: str, is_final: bool) -> ParsedOutput:
        """The reading of the output so far (``tool_call_parser.ToolCallStream`` streams it)."""
        return parse_output(text, self.shape, is_final, self.syntax, self.functions, self.named)

    def constraint(self) -> dict[str, Any]:
        """The output's constraint as ``SamplingParams`` fields; raises ``ProtocolError`` for a function whose
        parameters the syntax cannot hold to their schema."""
        try:
            return self._constraint()
        except ValueError as e:
            raise ProtocolError(f"{e} (--tool-call-parser {self.syntax.name})", param="tools") from e

    def _constraint(self) -> dict[str, Any]:
        if self.mode == "named":
            assert self.named is not None
            if self.syntax.forced_as_json:
                return {"json_schema": self.functions[self.named]}
            calls = self.syntax.calls_format({self.named: self.functions[self.named]}, parallel=False, in_text=False)
        elif self.mode == "required":
            if self.syntax.forced_as_json:
                array: dict[str, Any] = {"type": "array", "items": {"anyOf": self._call_schemas()}, "minItems": 1}
                return {"json_schema": array | ({} if self.parallel else {"maxItems": 1})}
            calls = self.syntax.calls_format(self.functions, self.parallel, in_text=False)
        elif self.answer is None:
            calls = self.syntax.calls_format(self.functions, self.parallel, in_text=True)
        else:
            only_calls = self.syntax.calls_format(self.functions, self.parallel, in_text=False)
            calls = {"type": "or", "elements": [only_calls, self.answer]}
        return {"structural_tag": {"type": "structural_tag", "format": calls}}

    def system_prompt(self) -> str:
        """The system message that offers the tools and says how to call them (for a template that renders none)."""
        offered = [
            {"name": name, "description": self.descriptions.get(name, ""), "parameters": schema}
            for name, schema in self.functions.items()
        ]
        listing = "\n".join(json.dumps(tool) for tool in offered)
        if self.mode == "named" and self.syntax.forced_as_json:
            how = f"Call the function {self.named} now: answer with its arguments as one JSON object."
        elif self.mode == "required" and self.syntax.forced_as_json:
            how = 'Answer with a JSON array of function calls: [{"name": <function name>, "arguments": <object>}].'
        else:
            how = f"To call a function, write {self.syntax.example()}"
            if self.mode == "named":
                how += f"; call the function {self.named} now."
            elif self.mode == "required":
                how += "; call one function or more now."
            else:
                how += "; " + ("otherwise answer in text." if self.answer is None else "otherwise give your answer.")
        return f"You can call these functions:\n{listing}\n{how}"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a final output in OpenAI's shape; each call's ``arguments`` is its JSON text as
        generated (an output cut short ends in a call with incomplete arguments, as OpenAI's does)."""
        parsed = self.read(text, True)
        calls = [
            {**new_call_id(), "function": {"name": call.name, "arguments": call.arguments}} for call in parsed.calls
        ]
        return parsed.content or None, calls

    def _call_schemas(self) -> list[dict[str, Any]]:
        return [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in self.functions.items()
        ]


def tool_plan(request: ChatCompletionRequest, syntax: ToolSyntax) -> ToolPlan | None:
    """The request's use of its tools (None: no tools, or ``tool_choice`` "none"); raises ``ProtocolError`` for a
    choice naming no offered function, or an answer format that cannot go beside ``auto``'s calls."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    functions = tool_schemas(request)
    if len(functions) != len(request.tools):
        raise ProtocolError("tools must have distinct function names", param="tools")
    descriptions = {tool.function.name: tool.function.description or "" for tool in request.tools}
    parallel = request.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in functions:
            raise ProtocolError(
                f"tool_choice names the function {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        return ToolPlan("named", syntax, functions, descriptions, parallel, named=choice.function.name)
    if choice == "required":
        return ToolPlan("required", syntax, functions, descriptions, parallel)
    answer = answer_format(requested_constraint(request))
    return ToolPlan("auto", syntax, functions, descriptions, parallel, answer=answer)


def answer_format(constraint: dict[str, Any]) -> dict[str, Any] | None:
    """A request's constraint (``SamplingParams`` fields) as a structural tag ``format`` node, None for none."""
    if not constraint:
        return None
    ((field_name, value),) = constraint.items()
    if field_name == "json_object":
        return {"type": "json_schema", "json_schema": ANY_OBJECT}
    if field_name == "regex":
        return {"type": "regex", "pattern": value}
    if field_name == "ebnf":
        return {"type": "grammar", "grammar": value}
    if field_name == "choice":
        try:
            return {"type": "regex", "pattern": choices_to_regex(value)}
        except GrammarSpecError as e:
            raise ProtocolError(str(e), param="guided_choice", code="invalid_constraint") from e
    parsed = _parsed_json(value, field_name)
    if field_name == "json_schema":
        return {"type": "json_schema", "json_schema": parsed}
    if not isinstance(parsed, dict) or not isinstance(parsed.get("format"), dict):
        raise ProtocolError(
            "tools with tool_choice 'auto' take a structural tag answer format only in xgrammar's format form "
            '({"type": "structural_tag", "format": {...}}), not the structures/triggers form',
            param="response_format",
            code="invalid_constraint",
        )
    return dict(parsed["format"])


def _parsed_json(value: Any, field_name: str) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"the {field_name} constraint is not valid JSON: {e.msg}", param=field_name) from e


def template_messages(
    messages: list[Message], syntax: ToolSyntax, renders_tools: bool, schemas: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Messages for the chat template. An assistant's ``tool_calls``: for a template that renders tools, as Hugging
    Face templates take them (``arguments`` an object when it is one), with ``tool`` messages' ``tool_call_id``;
    otherwise written after its content in ``syntax`` (``schemas``: the functions' parameters)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        template_message: dict[str, Any] = dict(message.as_template_message())
        calls = message.tool_calls or []
        if calls and renders_tools:
            template_message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _object(call)},
                }
                for call in calls
            ]
        elif calls:
            written = [(call.function.name, call.function.arguments) for call in calls]
            template_message["content"] += syntax.write_calls(written, schemas)
        if renders_tools and message.tool_call_id is not None:
            template_message["tool_call_id"] = message.tool_call_id
        rendered.append(template_message)
    return rendered


def tool_schemas(request: ChatCompletionRequest) -> dict[str, dict[str, Any]]:
    """Each offered function's parameters schema by name."""
    return {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in request.tools or []}


def offered_tools(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's tools as a chat template takes them (OpenAI's shape)."""
    return [tool.model_dump(exclude_none=True) for tool in request.tools or []]


def _object(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


def with_tools_offered(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """``messages`` with the tools offered in the system message (a new one first if there is none)."""
    offer = plan.system_prompt()
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}, *messages[1:]]
    return [{"role": "system", "content": offer}, *messages]
