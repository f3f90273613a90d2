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

from tests.helpers import MODEL, HttpServer

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
