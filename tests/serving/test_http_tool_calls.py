"""Tool calls through the real ``openai`` client: ``tool_choice`` "required", a named function, "auto" and "none",
streamed and not, and a multi-turn exchange that sends a call and its result back. A call the server returns always
has arguments that validate against its function's ``parameters`` schema."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from scheduler.http.protocol import ChatCompletionRequest
from scheduler.http.streaming import ChatStreamChunks
from scheduler.http.tool_calls import ToolPlan, tool_plan
from scheduler.http.tool_syntaxes import SYNTAXES
from scheduler.io_struct import FinishReason, GenerateOutput, Usage
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import HTTP_MAX_SEQ_LEN, MODEL, HttpServer, http_server, serving
from tests.unit.tool_templates import TEMPLATES

pytestmark = pytest.mark.model

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 24}, "hour24": {"type": "boolean"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Current time in a time zone", "parameters": TIME},
    },
]
PROMPTS = [
    "What's the weather in Paris?",
    "Is it raining in Tokyo right now?",
    "What time is it in New York?",
    "Tell me the temperature in Lima in fahrenheit.",
    "Current time in Europe/Berlin please.",
    "How hot is it in Cairo?",
    "What's the local time in Sydney?",
    "Weather report for Oslo, celsius.",
    "Do I need an umbrella in London today?",
    "What hour is it in UTC?",
    "Check the weather in Reykjavik.",
    "Give me the time in Asia/Kolkata, 24-hour clock.",
    "Is it cold in Moscow?",
    "What's the time in Los Angeles?",
    "Weather in Nairobi?",
    "Tell me the current time in Tokyo.",
    "How's the weather in Buenos Aires?",
    "What time is it in Paris?",
    "Should I wear a coat in Chicago?",
    "Time in Auckland?",
]


def assert_valid_call(call: Any) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_calls_validate_for_twenty_prompts_at_temperature_0_8(server: HttpServer) -> None:
    async def ask(client: openai.AsyncOpenAI, prompt: str) -> Any:
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
        return await client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.8,
            max_tokens=150,
        )

    async def ask_all() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(ask(client, prompt) for prompt in PROMPTS))
        finally:
            await client.close()

    for completion in asyncio.run(ask_all()):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls or []
        assert_valid_call(call)


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "I am flying to Rome tomorrow."}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=120,
    )
    (call,) = completion.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and completion.choices[0].finish_reason == "stop"
    assert_valid_call(call)


def test_auto_and_none(client: openai.OpenAI) -> None:
    """With "auto" the model may answer or call (a call is valid); with "none" it only answers."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What's the weather in Madrid?"}]
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=60
    ).choices[0]
    assert auto.message.content or auto.message.tool_calls
    for call in auto.message.tool_calls or []:
        assert_valid_call(call)
    none = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=24
    ).choices[0]
    assert none.message.tool_calls is None and none.message.content


def test_streamed_calls_arrive_as_deltas_and_a_call_result_can_be_sent_back(client: openai.OpenAI) -> None:
    """OpenAI's streaming: each call's id and name first, then its arguments in several deltas, which add up to the
    arguments of the same request not streamed."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What time is it in Lisbon?"}]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 120,
    }
    deltas = [chunk.choices[0] for chunk in client.chat.completions.create(**kwargs, stream=True) if chunk.choices]
    pieces = [call for d in deltas for call in d.delta.tool_calls or []]
    assert deltas[-1].finish_reason == "tool_calls"
    header, *argument_pieces = pieces
    assert header.id and header.function is not None and header.function.name in SCHEMAS
    assert header.function.arguments == "" and len(argument_pieces) > 1
    assert all(piece.id is None and piece.index == 0 for piece in argument_pieces)
    arguments = "".join(piece.function.arguments or "" for piece in argument_pieces if piece.function)
    jsonschema.validate(json.loads(arguments), SCHEMAS[header.function.name])
    (unstreamed,) = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    assert (unstreamed.function.name, unstreamed.function.arguments) == (header.function.name, arguments)
    follow_up: list[ChatCompletionMessageParam] = [
        *messages,
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": header.id,
                    "type": "function",
                    "function": {"name": header.function.name or "", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": header.id, "content": '{"time": "14:05"}'},
    ]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, temperature=0, max_tokens=24)
    assert answer.choices[0].message.content


FAMILY_QUESTION = "What's the weather in Paris, in celsius?"


def family_request(syntax_name: str, tokenizer: Any) -> tuple[ToolPlan, dict[str, Any]]:
    """A ``/generate`` body: the family's template rendering the tools and the question, constrained by the family's
    ``required`` constraint (one call: the markers of some families take up to 90 of SmolLM2's tokens), greedy."""
    syntax = SYNTAXES[syntax_name]
    messages = [{"role": "user", "content": FAMILY_QUESTION}]
    body = {"messages": messages, "tools": TOOLS[:1], "tool_choice": "required", "parallel_tool_calls": False}
    plan = tool_plan(ChatCompletionRequest.model_validate(body), syntax)
    assert plan is not None
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS[:1], chat_template=TEMPLATES[syntax_name], tokenize=False, add_generation_prompt=True
    )
    room = HTTP_MAX_SEQ_LEN - len(tokenizer.encode(prompt, add_special_tokens=False))
    params = {"max_new_tokens": room, "temperature": 0, "skip_special_tokens": False, **plan.constraint()}
    return plan, {"text": prompt, "sampling_params": params}


def streamed_deltas(plan: ToolPlan, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat chunks of a streamed ``/generate`` (each event holds the text so far), as the chat endpoint streams."""
    chunks = ChatStreamChunks("chatcmpl-x", MODEL, n=1, include_usage=False, token_text=str, plan=plan)
    deltas, sent = [], ""
    for event in events:
        usage = Usage(prompt_tokens=1, completion_tokens=len(event["output_ids"]))
        finished = event["meta_info"]["finish_reason"] is not None
        output = GenerateOutput(
            rid="r",
            token_ids=[],
            text=event["text"][len(sent) :],
            finished=finished,
            finish_reason=FinishReason("stop") if finished else None,
            usage=usage,
        )
        sent = event["text"]
        deltas += [chunk["choices"][0]["delta"] for chunk in chunks.events(0, output)]
    return deltas


@pytest.mark.parametrize("syntax_name", [name for name in SYNTAXES if name != "hermes"])
def test_the_model_constrained_into_each_family_syntax_calls_tools_streamed_and_not(
    server: HttpServer, smollm2_tokenizer: TokenizerSetup, syntax_name: str
) -> None:
    """The embedded model, prompted through the family's template and held to its syntax, writes calls that read
    back as OpenAI's ``tool_calls`` with valid arguments; streamed, the deltas add up to the same calls."""
    plan, body = family_request(syntax_name, smollm2_tokenizer.tokenizer)
    whole = server.http.post("/generate", json=body).json()
    content, calls = plan.parse(whole["text"])
    assert calls and content is None and whole["meta_info"]["finish_reason"]["type"] == "stop", whole["text"]
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    with server.http.stream("POST", "/generate", json=body | {"stream": True}) as response:
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [
        piece
        for delta in streamed_deltas(plan, [json.loads(line) for line in lines])
        for piece in delta.get("tool_calls", [])
    ]
    headers = [piece for piece in pieces if "id" in piece]
    assert [(h["index"], h["function"]["name"]) for h in headers] == [
        (i, c["function"]["name"]) for i, c in enumerate(calls)
    ]
    for index, call in enumerate(calls):
        arguments = "".join(p["function"]["arguments"] for p in pieces if p["index"] == index)
        assert arguments == call["function"]["arguments"]


CODER_FLAGS = ("--tool-call-parser", "qwen3_coder")


@pytest.mark.launches(*CODER_FLAGS, http=True)
def test_a_server_started_with_a_tool_call_parser_writes_calls_in_its_syntax() -> None:
    """``--tool-call-parser qwen3_coder`` on SmolLM2 (whose template renders no tools): the system message shows the
    syntax, the model writes a call in a ``<function=...>`` block with ``<parameter=...>`` values (strings as raw
    text), and it comes back as OpenAI's ``tool_calls`` with JSON arguments, the same streamed and not."""
    live = http_server(*CODER_FLAGS)
    with serving(live):
        client = live.openai_client()
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What's the weather in Paris, and the time in Tokyo?"}
        ]
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "temperature": 0,
            "max_tokens": 140,
            "logprobs": True,
        }
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and calls
        for call in calls:
            assert_valid_call(call)
        written = "".join(token.token for token in (choice.logprobs.content if choice.logprobs else None) or [])
        assert f"<tool_call>\n<function={calls[0].function.name}>\n<parameter=" in written
        streamed: list[list[str]] = []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if piece.id is not None:
                    streamed.append([piece.function.name if piece.function else "", ""])
                elif piece.function is not None:
                    streamed[piece.index][1] += piece.function.arguments or ""
        assert streamed == [[call.function.name, call.function.arguments] for call in calls]
