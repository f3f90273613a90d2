"""The constraints tool calls are generated under, compiled by xgrammar and llguidance on the real SmolLM2
vocabulary: a call whose arguments break its function's schema, or that names no offered function, is not an output
the grammar accepts, and beside an answer format ``auto`` admits calls only or the answer only; the text the grammar
accepts is read back as OpenAI's ``tool_calls``."""

from __future__ import annotations

import json

import pytest

from scheduler.http.protocol import ChatCompletionRequest
from scheduler.http.tool_calls import ToolPlan, tool_plan
from scheduler.http.tool_syntaxes import SYNTAXES
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import accepts_text

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}


def plan_for(
    tool_choice: object, parallel: bool = True, syntax: str = "hermes", tools: list[object] = TOOLS, **fields: object
) -> ToolPlan:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "tool_choice": tool_choice, **fields}
    request = ChatCompletionRequest.model_validate_json(json.dumps(body | {"parallel_tool_calls": parallel}))
    plan = tool_plan(request, SYNTAXES[syntax])
    assert plan is not None
    return plan


def accepts(plan: ToolPlan, text: str, setup: TokenizerSetup, backend: object) -> bool:
    ((field, spec),) = plan.constraint().items()
    kind = {"json_schema": "json", "structural_tag": "structural_tag"}[field]
    grammar = compile_grammar(backend, make_grammar_key(kind, spec))
    return accepts_text(grammar, setup, text)


GOOD_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
CASES = [
    ("required", True, f"[{GOOD_CALL}]", True),
    ("required", True, f'[{GOOD_CALL}, {{"name": "get_time", "arguments": {{"zone": "UTC"}}}}]', True),
    ("required", False, f'[{GOOD_CALL}, {{"name": "get_time", "arguments": {{"zone": "UTC"}}}}]', False),
    ("required", True, "[]", False),
    ("required", True, '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}]', False),
    ("required", True, '[{"name": "launch", "arguments": {}}]', False),
    ("named", True, '{"city": "Oslo", "unit": "F"}', True),
    ("named", True, '{"zone": "UTC"}', False),
    ("auto", True, "It is sunny.", True),
    ("auto", True, f"Let me check.<tool_call>{GOOD_CALL}</tool_call>", True),
    ("auto", True, '<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>', False),
    ("auto", True, '<tool_call>{"name": "other", "arguments": {}}</tool_call>', False),
    ("auto", False, f"<tool_call>{GOOD_CALL}</tool_call> and <tool_call>{GOOD_CALL}</tool_call>", False),
    ("auto", True, "Let me check.<tool_call> for you", False),
    ("auto+answer", True, '{"answer": "yes"}', True),
    ("auto+answer", True, f"<tool_call>{GOOD_CALL}</tool_call>", True),
    ("auto+answer", True, f"<tool_call>{GOOD_CALL}</tool_call>\n<tool_call>{GOOD_CALL}</tool_call>", True),
    ("auto+answer", False, f"<tool_call>{GOOD_CALL}</tool_call>\n<tool_call>{GOOD_CALL}</tool_call>", False),
    ("auto+answer", True, '{"answer": "maybe"}', False),
    ("auto+answer", True, "It is sunny.", False),
    ("auto+answer", True, f"Checking.<tool_call>{GOOD_CALL}</tool_call>", False),
    ("auto+answer", True, f'<tool_call>{GOOD_CALL}</tool_call>{{"answer": "yes"}}', False),
    ("required+answer", True, f"[{GOOD_CALL}]", True),
    ("required+answer", True, '{"answer": "yes"}', False),
    ("named+answer", True, '{"city": "Oslo", "unit": "F"}', True),
]


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize(("mode", "parallel", "text", "accepted"), CASES)
def test_the_grammar_admits_exactly_the_calls_that_fit_their_schemas(
    smollm2_tokenizer: TokenizerSetup,
    build_backend: BackendBuilder,
    backend_name: str,
    mode: str,
    parallel: bool,
    text: str,
    accepted: bool,
) -> None:
    """``+answer``: with a response_format, which only ``auto`` lets the model use on this turn."""
    choice_name = mode.removesuffix("+answer")
    choice = {"type": "function", "function": {"name": "get_weather"}} if choice_name == "named" else choice_name
    fields = {"response_format": RESPONSE_FORMAT} if mode.endswith("+answer") else {}
    plan = plan_for(choice, parallel, **fields)
    assert accepts(plan, text, smollm2_tokenizer, build_backend(backend_name, smollm2_tokenizer)) is accepted


def test_outlines_refuses_a_tag_constraint_naming_itself(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder
) -> None:
    ((_, spec),) = plan_for("auto", response_format=RESPONSE_FORMAT).constraint().items()
    grammar = compile_grammar(build_backend("outlines", smollm2_tokenizer), make_grammar_key("structural_tag", spec))
    assert "outlines" in getattr(grammar, "error_message", "")


def test_accepted_outputs_read_back_as_openai_tool_calls() -> None:
    content, calls = plan_for("auto").parse(f"Checking.<tool_call>{GOOD_CALL}</tool_call>")
    assert content == "Checking." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    _, named = plan_for({"type": "function", "function": {"name": "get_time"}}).parse('{"zone": "UTC"}')
    assert named[0]["function"]["name"] == "get_time"
    assert plan_for("required").parse('[{"name": "get_time"') == ('[{"name": "get_time"', [])
    assert plan_for("auto").parse("No call here.") == ("No call here.", [])


WEATHER_ARGUMENTS, TIME_ARGUMENTS = '{"city": "Oslo", "unit": "C"}', '{"zone": "UTC"}'
PING = {"type": "object", "properties": {"host": {"type": "string"}, "count": {"type": "integer"}}}
"""Parameters all optional: written in any subset, in the schema's order."""
BAD_ARGUMENTS = '{"city": "Oslo", "unit": "K"}'
FAMILY_CASES = [
    # (tool_choice, parallel, text built from the syntax's calls: [(name, arguments)] with text before them, accepted)
    ("auto", True, ("", []), True),
    ("auto", True, ("Let me check. ", [("get_weather", WEATHER_ARGUMENTS)]), True),
    ("auto", True, ("", [("get_weather", WEATHER_ARGUMENTS), ("get_time", TIME_ARGUMENTS)]), True),
    ("auto", False, ("", [("get_weather", WEATHER_ARGUMENTS), ("get_time", TIME_ARGUMENTS)]), False),
    ("auto", True, ("", [("get_weather", BAD_ARGUMENTS)]), False),
    ("auto", True, ("", [("launch", "{}")]), False),
    ("required", True, ("", [("get_weather", WEATHER_ARGUMENTS), ("get_time", TIME_ARGUMENTS)]), True),
    ("required", False, ("", [("get_time", TIME_ARGUMENTS)]), True),
    ("required", True, ("Sure. ", [("get_time", TIME_ARGUMENTS)]), False),
    ("named", True, ("", [("get_weather", WEATHER_ARGUMENTS)]), True),
    ("named", True, ("", [("get_time", TIME_ARGUMENTS)]), False),
    ("required", True, ("", [("ping", "{}")]), True),
    ("required", True, ("", [("ping", '{"count": 3}')]), True),
    ("required", True, ("", [("ping", '{"host": "a", "count": 3}')]), True),
    ("required", True, ("", [("ping", '{"count": "3"}')]), False),
    ("auto+answer", True, ("", [("get_weather", WEATHER_ARGUMENTS)]), True),
    ("auto+answer", True, ('{"answer": "yes"}', []), True),
    ("auto+answer", True, ("It is sunny.", []), False),
]
FAMILY_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "ping", "parameters": PING}}]
FAMILIES = [name for name, syntax in SYNTAXES.items() if not syntax.forced_as_json]


def family_text(syntax_name: str, tool_choice: str, before: str, calls: list[tuple[str, str]]) -> str:
    """The calls as the syntax writes them; in ``required`` mode parallel calls in free text are joined by the
    syntax's separator (the grammar's calls-only form)."""
    syntax, schemas = SYNTAXES[syntax_name], {"get_weather": WEATHER, "get_time": TIME, "ping": PING}
    if tool_choice != "auto" and not syntax.sectioned:
        return before + syntax.separator.join(syntax.write_calls([call], schemas) for call in calls)
    return before + (syntax.write_calls(calls, schemas) if calls else "")


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("syntax_name", FAMILIES)
def test_each_family_syntax_is_the_constraint_and_reads_back(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder, backend_name: str, syntax_name: str
) -> None:
    """Every mode's constraint, in each family's syntax, admits exactly the calls that fit their schemas (and what
    ``auto`` allows beside them); what it admits reads back as the calls written."""
    backend = build_backend(backend_name, smollm2_tokenizer)
    for mode, parallel, (before, calls), accepted in FAMILY_CASES:
        choice_name = mode.removesuffix("+answer")
        choice = {"type": "function", "function": {"name": "get_weather"}} if choice_name == "named" else choice_name
        fields = {"response_format": RESPONSE_FORMAT} if mode.endswith("+answer") else {}
        plan = plan_for(choice, parallel, syntax_name, FAMILY_TOOLS, **fields)
        text = family_text(syntax_name, choice_name, before, calls)
        assert accepts(plan, text, smollm2_tokenizer, backend) is accepted, (mode, parallel, text)
        if accepted:
            content, read = plan.parse(text)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in read] == calls
            assert content == ((before.strip() or None) if calls else (before or None))


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_calls_json_has_the_servers_whitespace(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder, backend_name: str
) -> None:
    """``--constrained-json-disable-any-whitespace`` holds inside a call's arguments too (xgrammar's structural tags
    take no whitespace option: a random-weight model filled a call with pages of it); by default a line break and
    an indent pass between tokens, and a blank line does not."""
    plan = plan_for("required", syntax="qwen25")
    compact = build_backend(backend_name, smollm2_tokenizer, constrained_json_disable_any_whitespace=True)
    default = build_backend(backend_name, smollm2_tokenizer)
    spaced = SYNTAXES["qwen25"].write_calls([("get_time", '{"zone":\n  "UTC"}')])
    assert accepts(plan, SYNTAXES["qwen25"].write_calls([("get_time", '{"zone":"UTC"}')]), smollm2_tokenizer, compact)
    assert not accepts(plan, spaced, smollm2_tokenizer, compact)
    assert accepts(plan, spaced, smollm2_tokenizer, default)
    assert not accepts(plan, spaced.replace("\n  ", "\n\n  "), smollm2_tokenizer, default)


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_raw_text_parameter_ends_where_the_grammar_ends_it(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder, backend_name: str
) -> None:
    """Qwen3-Coder's string values are raw text up to ``\\n</parameter>\\n``: a value holding ``</parameter>``
    otherwise (or line breaks) is one the grammar takes, and reads back whole."""
    plan = plan_for("required", syntax="qwen3_coder", tools=[TOOLS[1]])
    arguments = json.dumps({"zone": "a</parameter>b\n\nc\n"})
    text = SYNTAXES["qwen3_coder"].write_calls([("get_time", arguments)], {"get_time": TIME})
    assert accepts(plan, text, smollm2_tokenizer, build_backend(backend_name, smollm2_tokenizer))
    assert [call["function"]["arguments"] for call in plan.parse(text)[1]] == [arguments]
