"""Tool calls on chat completions: the prompt that offers the tools, the constraint that keeps a call inside its
function's ``parameters`` schema, and the answer's ``tool_calls`` read back from the output.

SmolLM2's chat template has no tool format, so the tools are offered in a system message, in the Hermes style
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` that many templates use. By ``tool_choice``:

- ``"required"``: the output is a JSON array of ``{"name", "arguments"}`` calls, each ``arguments`` valid for its
  function's schema (one call at most when ``parallel_tool_calls`` is false), as vLLM constrains it;
- a named function: the output is that function's arguments, a JSON value valid for its schema;
- ``"auto"`` (the default with tools): free text, where a ``<tool_call>`` trigger starts a call that is then kept to
  the named function's schema (the first call ends the output unless parallel calls are allowed); with an answer
  format (``response_format`` or another constraint field), either calls only or an answer valid for that format,
  chosen by the model at its first token (a structural tag in xgrammar's ``format`` form);
- ``"none"``: the tools are neither offered nor called, and the answer format applies.

With ``required`` or a named function the answer format is for a later turn's answer, as OpenAI reads it. Calls are
read back by ``scheduler.http.tool_call_parser``, which also streams them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from scheduler.http.constraint_fields import requested_constraint
from scheduler.http.protocol import ChatCompletionRequest, Message, NamedToolChoice, ProtocolError
from scheduler.http.tool_call_parser import CALL_BEGIN, CALL_END, OutputShape, new_call_id, parse_output
from sglang_constrained.constraint_spec import GrammarSpecError, choices_to_regex

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools. ``functions``: name → parameters schema; ``named``: the forced one;
    ``answer``: with ``auto``, the format a text answer must have (a structural tag ``format`` node), if any."""

    mode: Literal["auto", "required", "named"]
    functions: dict[str, dict[str, Any]]
    descriptions: dict[str, str]
    parallel: bool
    named: str | None = None
    answer: dict[str, Any] | None = None

    @property
    def shape(self) -> OutputShape:
        """How the output is written (``tool_call_parser``)."""
        if self.mode == "named":
            return "named"
        if self.mode == "required":
            return "array"
        return "tagged" if self.answer is None else "tagged_or_answer"

    def constraint(self) -> dict[str, Any]:
        """The output's constraint as ``SamplingParams`` fields."""
        if self.mode == "named":
            assert self.named is not None
            return {"json_schema": self.functions[self.named]}
        if self.mode == "required":
            calls: dict[str, Any] = {"type": "array", "items": {"anyOf": self._call_schemas()}, "minItems": 1}
            return {"json_schema": calls | ({} if self.parallel else {"maxItems": 1})}
        tags = [
            {
                "type": "tag",
                "begin": f'{CALL_BEGIN}{{"name": {json.dumps(name)}, "arguments": ',
                "content": {"type": "json_schema", "json_schema": schema},
                "end": "}" + CALL_END,
            }
            for name, schema in self.functions.items()
        ]
        if self.answer is None:
            calls = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags}
        else:
            calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        calls["stop_after_first"] = not self.parallel
        if self.answer is not None:
            calls = {"type": "or", "elements": [calls, self.answer]}
        return {"structural_tag": {"type": "structural_tag", "format": calls}}

    def system_prompt(self) -> str:
        """The system message that offers the tools and says how to call them."""
        offered = [
            {"name": name, "description": self.descriptions.get(name, ""), "parameters": schema}
            for name, schema in self.functions.items()
        ]
        listing = "\n".join(json.dumps(tool) for tool in offered)
        if self.mode == "named":
            how = f"Call the function {self.named} now: answer with its arguments as one JSON object."
        elif self.mode == "required":
            how = 'Answer with a JSON array of function calls: [{"name": <function name>, "arguments": <object>}].'
        else:
            how = (
                "To call a function, write "
                f'{CALL_BEGIN}{{"name": <function name>, "arguments": <arguments object>}}{CALL_END}; '
                + ("otherwise answer in text." if self.answer is None else "otherwise give your answer.")
            )
        return f"You can call these functions:\n{listing}\n{how}"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a final output in OpenAI's shape; each call's ``arguments`` is its JSON text as
        generated (an output cut short ends in a call with incomplete arguments, as OpenAI's does)."""
        parsed = parse_output(text, self.shape, is_final=True, named=self.named)
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


def tool_plan(request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's use of its tools (None: no tools, or ``tool_choice`` "none"); raises ``ProtocolError`` for a
    choice naming no offered function, or an answer format that cannot go beside ``auto``'s calls."""
    choice = request.tool_choice
    if not request.tools:
        if choice not in (None, "none"):
            raise ProtocolError("tool_choice needs tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    functions = {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in request.tools}
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
        return ToolPlan("named", functions, descriptions, parallel, named=choice.function.name)
    if choice == "required":
        return ToolPlan("required", functions, descriptions, parallel)
    return ToolPlan("auto", functions, descriptions, parallel, answer=answer_format(requested_constraint(request)))


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


def template_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Messages for the chat template, an assistant's ``tool_calls`` written after its content as it was asked to
    write them (``tool`` messages keep their role)."""
    rendered = []
    for message in messages:
        template_message = message.as_template_message()
        for call in message.tool_calls or []:
            name = json.dumps(call.function.name)
            written = f'{{"name": {name}, "arguments": {call.function.arguments}}}'
            template_message["content"] += f"{CALL_BEGIN}{written}{CALL_END}"
        rendered.append(template_message)
    return rendered


def with_tools_offered(messages: list[dict[str, str]], plan: ToolPlan) -> list[dict[str, str]]:
    """``messages`` with the tools offered in the system message (a new one first if there is none)."""
    offer = plan.system_prompt()
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}, *messages[1:]]
    return [{"role": "system", "content": offer}, *messages]
