"""Tool calls on chat completions: the prompt that offers the tools, the constraint that keeps a call inside its
function's ``parameters`` schema, and the answer's ``tool_calls`` read back from the output.

SmolLM2's chat template has no tool format, so the tools are offered in a system message, in the Hermes style
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` that many templates use. By ``tool_choice``:

- ``"required"``: the output is a JSON array of ``{"name", "arguments"}`` calls, each ``arguments`` valid for its
  function's schema (one call at most when ``parallel_tool_calls`` is false), as vLLM constrains it;
- a named function: the output is that function's arguments, a JSON value valid for its schema;
- ``"auto"`` (the default with tools): free text, where a ``<tool_call>`` trigger starts a call that is then kept to
  the named function's schema (an xgrammar structural tag; the first call ends the output unless parallel calls are
  allowed);
- ``"none"``: the tools are neither offered nor called.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from scheduler.http.protocol import ChatCompletionRequest, Message, NamedToolChoice, ProtocolError

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_BEGIN) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools. ``functions``: name → parameters schema; ``named``: the forced one."""

    mode: Literal["auto", "required", "named"]
    functions: dict[str, dict[str, Any]]
    descriptions: dict[str, str]
    parallel: bool
    named: str | None = None

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
        trigger = {
            "type": "triggered_tags",
            "triggers": [CALL_BEGIN],
            "tags": tags,
            "stop_after_first": not self.parallel,
        }
        return {"structural_tag": {"type": "structural_tag", "format": trigger}}

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
                "otherwise answer in text."
            )
        return f"You can call these functions:\n{listing}\n{how}"

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of an output in OpenAI's shape; an output cut short (no complete call) is
        returned as content with no calls."""
        try:
            if self.mode == "named":
                return None, [_tool_call(str(self.named), json.loads(text))]
            if self.mode == "required":
                return None, [_tool_call(call["name"], call["arguments"]) for call in json.loads(text)]
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        calls = []
        for match in _CALL.finditer(text):
            try:
                call = json.loads(match.group(1))
                calls.append(_tool_call(call["name"], call["arguments"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []
        content = _CALL.sub("", text).strip() if calls else text
        return content or None, calls

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
    choice naming no offered function, or for tools beside another constraint."""
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
    return ToolPlan("required" if choice == "required" else "auto", functions, descriptions, parallel)


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


def _tool_call(name: str, arguments: Any) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
