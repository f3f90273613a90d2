"""Each tool-call family's syntax (``scheduler.http.tool_syntaxes``): which template names it, how its template renders
the tools and earlier calls our request conversion hands it, and streaming that does not depend on how the output's
tokens are cut into increments (one token, random runs of 1-4, the whole output at once as a speculative run may give
it): the streamed deltas, joined, are the non-streamed message, ids, names, indexes and parallel calls included."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.http.protocol import ChatCompletionRequest, ProtocolError
from scheduler.http.request_conversion import RequestLimits, chat_calls
from scheduler.http.streaming import ChatStreamChunks
from scheduler.http.tool_call_reader import read_calls
from scheduler.http.tool_calls import ToolFormat, ToolPlan, tool_plan
from scheduler.http.tool_syntaxes import SYNTAXES, detect_syntax, renders_tools, resolve_syntax, writes_special_tokens
from scheduler.io_struct import FinishReason, GenerateOutput, SamplingParams, Usage
from scheduler.output_text import OutputText
from scheduler.server_args import TOOL_CALL_PARSERS
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import encode_exactly
from tests.unit.tool_templates import TEMPLATES

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
]
LIMITS = RequestLimits(max_seq_len=4096, max_spec_bytes=1 << 20)
EARLIER_CALLS = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')]


def request_with(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], **fields})


def test_the_parser_names_are_the_syntaxes_and_a_template_names_its_own() -> None:
    assert tuple(SYNTAXES) == TOOL_CALL_PARSERS
    for name, template in TEMPLATES.items():
        assert detect_syntax(template) == SYNTAXES[name] and renders_tools(template)
        assert resolve_syntax(None, template)[0].name == name
    assert resolve_syntax("mistral", TEMPLATES["qwen25"])[0].name == "mistral"
    assert detect_syntax(TEMPLATES["qwen25"] + TEMPLATES["mistral"]) is None  # two syntaxes: ambiguous
    assert resolve_syntax(None, TEMPLATES["qwen25"] + TEMPLATES["mistral"])[0].name == "hermes"


def test_a_template_with_transformers_generation_tag_is_read_for_tools() -> None:
    """``{% generation %}`` (transformers' mark of the assistant's text) is no Jinja of its own: a template holding it
    is parsed as transformers parses it, so that one rendering tools is still given them."""
    marked = TEMPLATES["qwen25"].replace(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
        "{%- generation %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
        "{%- endgeneration %}",
    )
    assert "{%- generation %}" in marked and renders_tools(marked)
    assert not renders_tools("{% if %}") and not renders_tools(None)


def test_smollm2s_template_names_no_syntax_and_renders_no_tools(smollm2_tokenizer: TokenizerSetup) -> None:
    template = smollm2_tokenizer.tokenizer.chat_template
    assert detect_syntax(template) is None and not renders_tools(template)
    assert resolve_syntax(None, template)[0].name == "hermes"


def test_outputs_are_decoded_with_special_tokens_where_the_syntax_writes_them(
    smollm2_tokenizer: TokenizerSetup, qwen35_tokenizer: TokenizerSetup
) -> None:
    """Qwen3.5's ``<tool_call>`` is a special token, which decoding would drop: with tools in a Qwen syntax the output
    keeps special tokens (unless the request says otherwise); SmolLM2 has no such token, and Hermes requests keep
    the defaults."""
    request = request_with(tools=TOOLS)
    for setup, syntax_name, expected in (
        (qwen35_tokenizer, "qwen25", False),
        (qwen35_tokenizer, "qwen3_coder", False),
        (smollm2_tokenizer, "hermes", True),
        (smollm2_tokenizer, "qwen25", True),
    ):
        syntax = SYNTAXES[syntax_name]
        tool_format = ToolFormat(syntax, False, writes_special_tokens(syntax, setup.tokenizer))
        (call,) = chat_calls(request, "id", LIMITS, tool_plan(request, syntax), tool_format)
        params = call.sampling_params
        assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (expected, expected)
        chosen = request.model_copy(update={"skip_special_tokens": True})
        (call,) = chat_calls(chosen, "id", LIMITS, tool_plan(chosen, syntax), tool_format)
        assert call.sampling_params.skip_special_tokens


def conversation() -> list[dict[str, Any]]:
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(EARLIER_CALLS)
    ]
    return [
        {"role": "user", "content": "Weather and time in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        {"role": "user", "content": "And now?"},
    ]


@pytest.mark.parametrize("syntax_name", list(SYNTAXES))
def test_the_template_renders_the_tools_and_the_earlier_calls_in_its_syntax(
    smollm2_tokenizer: TokenizerSetup, syntax_name: str
) -> None:
    """Hermes through SmolLM2's own template (tools offered in a system message, calls written into the content);
    every other family through its template, which is given the tools and the calls."""
    template = TEMPLATES.get(syntax_name, smollm2_tokenizer.tokenizer.chat_template)
    tool_format = ToolFormat(SYNTAXES[syntax_name], renders_tools(template))
    request = request_with(messages=conversation(), tools=TOOLS)
    plan = tool_plan(request, tool_format.syntax)
    (call,) = chat_calls(request.model_copy(update={"n": 1}), "id", LIMITS, plan, tool_format)
    prompt = smollm2_tokenizer.tokenizer.apply_chat_template(
        call.messages, tools=call.tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert all(json.dumps(schema) in prompt for schema in (WEATHER, TIME))
    after_question = prompt[prompt.index("Weather and time in Oslo?") :]
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    written = read_calls(after_question, tool_format.syntax, is_final=True, schemas=schemas).calls
    assert [(c.name, c.arguments) for c in written] == EARLIER_CALLS
    assert after_question.index("UTC") < after_question.index("sunny") < after_question.index("12:00")


def test_a_tool_message_needs_its_tool_call_id_and_strict_may_be_null_or_false() -> None:
    messages = [*conversation()[:2], {"role": "tool", "content": "sunny"}]
    with pytest.raises(ProtocolError) as error:
        chat_calls(request_with(messages=messages, tools=TOOLS), "id", LIMITS)
    assert error.value.param == "messages.tool_call_id" and "messages[2].tool_call_id" in error.value.message
    constraints = []
    for strict in (None, False, True):
        tools = [{**tool, "function": {**tool["function"], "strict": strict}} for tool in TOOLS]
        plan = tool_plan(request_with(tools=tools, tool_choice="auto"), SYNTAXES["hermes"])
        assert plan is not None
        constraints.append(plan.constraint())
    # every tool is held to its schema whatever its strict says, from its trigger on
    assert constraints[0] == constraints[1] == constraints[2]
    assert json.dumps(WEATHER) in json.dumps(constraints[0]) and json.dumps(TIME) in json.dumps(constraints[0])


ARGUMENT_TEXT = st.text(alphabet='Oslo é😀"\\<[{|:;,\n', max_size=8)
CALLS = st.lists(
    st.one_of(
        st.builds(lambda city: ("get_weather", json.dumps({"city": city}, ensure_ascii=False)), ARGUMENT_TEXT),
        st.builds(lambda zone: ("get_time", json.dumps({"zone": zone}, ensure_ascii=False)), ARGUMENT_TEXT),
    ),
    min_size=0,
    max_size=3,
)
SPLITS = st.one_of(st.just([1]), st.just([1 << 20]), st.lists(st.integers(1, 4), min_size=1, max_size=40))
"""Increment sizes in tokens, repeated to the output's end: one token, the whole output, or random runs of 1-4."""


def stream(
    plan: ToolPlan, params: SamplingParams, setup: TokenizerSetup, ids: list[int], sizes: list[int]
) -> list[dict[str, Any]]:
    """The chat chunks of ``ids`` streamed in increments of ``sizes`` tokens, through the scheduler's detokeniser
    (``OutputText`` with the request's ``params``, holding back partial characters) and the frontend's chunks."""
    chunks = ChatStreamChunks("chatcmpl-x", "m", n=1, include_usage=False, token_text=str, plan=plan)
    output_text = OutputText(
        setup.tokenizer,
        stop=[],
        needs_live_text=True,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )
    events: list[dict[str, Any]] = []
    sent, start, step = "", 0, 0
    while start < len(ids):
        end = min(len(ids), start + sizes[step % len(sizes)])
        finished = end == len(ids)
        output_text.update(ids[:end])
        text = output_text.final_text(ids) if finished else output_text.stable_text()
        usage = Usage(prompt_tokens=1, completion_tokens=end)
        reason = FinishReason("stop") if finished else None
        output = GenerateOutput(
            rid="r",
            token_ids=ids[start:end],
            text=text[len(sent) :],
            finished=finished,
            finish_reason=reason,
            usage=usage,
        )
        events += chunks.events(0, output)
        sent, start, step = text, end, step + 1
    return events


def joined(events: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]], str | None]:
    """``(content, tool_calls, finish_reason)`` the deltas add up to; each call's header must come once, first."""
    content: str | None = None
    calls: list[dict[str, Any]] = []
    for event in events:
        (choice,) = event["choices"]
        delta = choice["delta"]
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["function"]["arguments"] == ""
                calls.append(
                    {"id": piece["id"], "type": piece["type"], "name": piece["function"]["name"], "arguments": ""}
                )
            else:
                assert "name" not in piece["function"]
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, calls, events[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize(
    ("syntax_name", "tokenizer_name"),
    [(name, "smollm2") for name in SYNTAXES] + [("qwen25", "qwen35"), ("qwen3_coder", "qwen35")],
)
def test_streamed_calls_add_up_to_the_unstreamed_ones_however_the_tokens_are_cut(
    request: pytest.FixtureRequest, syntax_name: str, tokenizer_name: str
) -> None:
    """Every family on SmolLM2's tokenizer, and the Qwen families on the real Qwen3.5 tokenizer (248k tokens, in which
    ``<tool_call>`` is one token)."""
    syntax = SYNTAXES[syntax_name]
    setup: TokenizerSetup = request.getfixturevalue(f"{tokenizer_name}_tokenizer")
    tool_format = ToolFormat(syntax, False, writes_special_tokens(syntax, setup.tokenizer))
    runs = []

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(before=st.text(alphabet="ab <[|{\n", max_size=10), calls=CALLS, sizes=SPLITS, parallel=st.booleans())
    def check(before: str, calls: list[tuple[str, str]], sizes: list[int], parallel: bool) -> None:
        runs.append(sizes)
        request = request_with(tools=TOOLS, parallel_tool_calls=parallel)
        plan = tool_plan(request, syntax)
        assert plan is not None
        (call,) = chat_calls(request, "id", LIMITS, plan, tool_format)
        written = syntax.write_calls(calls, {"get_weather": WEATHER, "get_time": TIME})
        text = before.replace(syntax.trigger, "") + written if calls else before or "-"
        ids = encode_exactly(setup, text)
        content, tool_calls = plan.parse(text)
        streamed_content, streamed_calls, finish_reason = joined(stream(plan, call.sampling_params, setup, ids, sizes))
        assert streamed_content == content
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in tool_calls
        ]
        assert [(c["name"], c["arguments"]) for c in streamed_calls] == calls
        assert all(c["id"].startswith("call_") and c["type"] == "function" for c in streamed_calls)
        assert len({c["id"] for c in streamed_calls}) == len(calls)
        assert finish_reason == ("tool_calls" if calls else "stop")

    check()
    print(f"{syntax_name} ({tokenizer_name}): {len(runs)} random splits")  # the run count, shown with -s


def test_parameters_a_syntax_cannot_write_as_their_schema_says_are_refused_by_name() -> None:
    """Qwen3-Coder writes string parameters as raw text: a ``pattern`` could not be enforced there (a 400 naming
    it; enums and length bounds can, and JSON syntaxes take the same tool). Pythonic keywords cannot hold a space."""
    zone = {"type": "string", "pattern": "^[A-Z]+$"}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"properties": {"zone": zone}}}}]
    request = request_with(tools=tools, tool_choice="required")
    plan = tool_plan(request, SYNTAXES["qwen3_coder"])
    assert plan is not None
    with pytest.raises(ProtocolError) as error:
        plan.constraint()
    assert error.value.param == "tools" and "'zone'" in error.value.message and "pattern" in error.value.message
    json_plan = tool_plan(request, SYNTAXES["qwen25"])
    assert json_plan is not None and "structural_tag" in json_plan.constraint()
    spaced = {"properties": {"zip code": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": spaced}}]
    pythonic = tool_plan(request_with(tools=tools), SYNTAXES["pythonic"])
    assert pythonic is not None
    with pytest.raises(ProtocolError) as error:
        pythonic.constraint()
    assert "'zip code'" in error.value.message
