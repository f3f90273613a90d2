"""The client libraries people already use, pointed at the server as a new user would: the ``openai`` client's own
helpers, instructor and LangChain's ``ChatOpenAI``. Each is judged strictly: by the object the library itself
parses, and by jsonschema (or Lark's parser) on the raw text that came over the wire.

Tools beside a typed answer (every ``tool_choice``), Lark grammars, OpenAI's bookkeeping fields, tool-call arguments
streamed as they are generated (and equal to the non-streamed ones), and JSON whitespace a reader would write.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import instructor
import jsonschema
import lark
import openai
import pytest
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

from tests.helpers import MODEL, HttpServer

pytestmark = pytest.mark.model


class Weather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


class Answer(BaseModel):
    city: str = Field(max_length=24)
    is_capital: bool


WEATHER_SCHEMA = openai.pydantic_function_tool(Weather)["function"]["parameters"]
ANSWER_SCHEMA = Answer.model_json_schema()
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What's the weather in Paris?"}]
CAPITAL: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Is Lyon the capital of France?"}]
LARK_GRAMMAR = """
start: greeting " " NAME "!"
greeting: "Hello" | "Hi"
NAME: /[A-Z][a-z]{1,9}/
"""
BOOKKEEPING = {
    "store": True,
    "metadata": {"team": "tests"},
    "service_tier": "auto",
    "prompt_cache_key": "tests",
    "safety_identifier": "user-1",
    "user": "user-1",
    "reasoning_effort": "low",
    "verbosity": "low",
}


def assert_reader_whitespace(text: str) -> None:
    """No blank line and no run of more than 20 spaces or tabs (README: JSON whitespace)."""
    assert not re.search(r"\n[ \t]*\r?\n", text) and not re.search(r"[ \t]{21,}", text), repr(text)


def assert_weather_arguments(arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    assert_reader_whitespace(arguments)


def assert_answer_text(text: str | None) -> None:
    assert text is not None
    jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    assert_reader_whitespace(text)


TOOL_CHOICES: dict[str, Any] = {
    "auto": "auto",
    "required": "required",
    "named": {"type": "function", "function": {"name": "Weather"}},
    "none": "none",
}


@pytest.mark.parametrize("choice", TOOL_CHOICES)
def test_openai_parse_with_tools_and_a_typed_answer(client: openai.OpenAI, choice: str) -> None:
    """``auto``: calls or the typed answer; ``required`` and named: calls; ``none``: the typed answer. Streamed (the
    client's stream helper) and not, the same message."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [openai.pydantic_function_tool(Weather)],
        "tool_choice": TOOL_CHOICES[choice],
        "response_format": Answer,
        "temperature": 0,
        "max_tokens": 60,
        "parallel_tool_calls": False,
    }
    message = client.chat.completions.parse(**kwargs).choices[0].message
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert (streamed.content, [c.function.arguments for c in streamed.tool_calls or []]) == (
        message.content,
        [c.function.arguments for c in message.tool_calls or []],
    )
    if choice in ("required", "named") or (choice == "auto" and message.tool_calls):
        assert message.tool_calls and message.parsed is None
        for call in message.tool_calls:
            assert isinstance(call.function.parsed_arguments, Weather)
            assert_weather_arguments(call.function.arguments)
    else:
        assert not message.tool_calls and isinstance(message.parsed, Answer)
        assert_answer_text(message.content)


@pytest.mark.parametrize("field", ["structured_outputs", "guided_grammar"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_lark_grammar_is_followed(client: openai.OpenAI, field: str, stream: bool) -> None:
    extra_body = {field: {"grammar": LARK_GRAMMAR}} if field == "structured_outputs" else {field: LARK_GRAMMAR}
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Greet Anna."}]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16}
    if stream:
        chunks = client.chat.completions.create(**kwargs, extra_body=extra_body, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    else:
        text = client.chat.completions.create(**kwargs, extra_body=extra_body).choices[0].message.content or ""
    lark.Lark(LARK_GRAMMAR).parse(text)


def test_openai_bookkeeping_fields_leave_the_answer_as_it_is(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": CAPITAL, "temperature": 0, "max_tokens": 12}
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs, **BOOKKEEPING).choices[0].message.content == plain


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_openai_streams_tool_arguments_as_they_are_generated(client: openai.OpenAI, choice: str) -> None:
    """Each call: id and name first (empty arguments), then the arguments in several deltas adding up to the
    non-streamed arguments."""
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": ASK,
        "tools": [openai.pydantic_function_tool(Weather)],
        "tool_choice": TOOL_CHOICES[choice],
        "temperature": 0,
        "max_tokens": 60,
        "parallel_tool_calls": False,
    }
    unstreamed = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    pieces: dict[int, list[Any]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            pieces.setdefault(call.index, []).append(call)
    assert len(pieces) == len(unstreamed)
    for index, call in enumerate(unstreamed):
        header, *rest = pieces[index]
        assert header.id and header.function.name == call.function.name == "Weather"
        assert header.function.arguments == "" and len(rest) > 1
        assert "".join(piece.function.arguments for piece in rest) == call.function.arguments
        assert_weather_arguments(call.function.arguments)


def test_instructor_tools_json_schema_and_partial_streaming(client: openai.OpenAI) -> None:
    """instructor's TOOLS mode (a named tool), its partial objects while the arguments stream, and JSON_SCHEMA mode
    (response_format)."""
    tools = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 60, "max_retries": 0}
    weather = tools.chat.completions.create(response_model=Weather, **kwargs)
    assert isinstance(weather, Weather)
    partials = list(tools.chat.completions.create_partial(response_model=Weather, **kwargs))
    assert len({partial.model_dump_json() for partial in partials}) > 2, "the arguments came in one piece"
    assert partials[-1].model_dump() == weather.model_dump()
    schema_mode = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    answer = schema_mode.chat.completions.create(
        response_model=Answer, **{**kwargs, "messages": CAPITAL}, **BOOKKEEPING
    )
    assert isinstance(answer, Answer)


def chat_model(server: HttpServer, **settings: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model=MODEL,
        temperature=0,
        max_tokens=60,  # type: ignore[call-arg]
        max_retries=0,
        use_responses_api=False,
        **settings,
    )


def test_langchain_agent_turn_with_tools_and_a_typed_answer(server: HttpServer) -> None:
    """``bind_tools(..., response_format=...)``, the agent's request on every turn, invoked and streamed; settings
    that are OpenAI bookkeeping are accepted."""
    llm = chat_model(server, reasoning_effort="low", service_tier="auto", store=True)
    agent = llm.bind_tools([Weather], response_format=Answer, strict=True)
    message = agent.invoke("What's the weather in Paris?")
    streamed = None
    for chunk in agent.stream("What's the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    if message.tool_calls:
        assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in message.tool_calls]
        for call in message.tool_calls:
            assert Weather.model_validate(call["args"]) and call["name"] == "Weather"
            jsonschema.validate(call["args"], WEATHER_SCHEMA)
    else:
        assert isinstance(message.additional_kwargs.get("parsed"), Answer)
        assert_answer_text(str(message.content))
        assert streamed.content == message.content


def test_langchain_structured_output_and_streamed_tool_chunks(server: HttpServer) -> None:
    llm = chat_model(server)
    for method in ("json_schema", "function_calling"):
        answer = llm.with_structured_output(Answer, method=method).invoke("Is Lyon the capital of France?")
        assert isinstance(answer, Answer)
    forced = llm.bind_tools([Weather], tool_choice="Weather")
    chunks = list(forced.stream("What's the weather in Paris?"))
    pieces = [piece for chunk in chunks for piece in chunk.tool_call_chunks]
    assert pieces[0]["name"] == "Weather" and pieces[0]["id"] and len(pieces) > 2
    arguments = "".join(piece["args"] or "" for piece in pieces)
    assert_weather_arguments(arguments)
    assert json.loads(arguments) == forced.invoke("What's the weather in Paris?").tool_calls[0]["args"]


def test_langchain_lark_grammar_through_extra_body(server: HttpServer) -> None:
    llm = chat_model(server, extra_body={"structured_outputs": {"grammar": LARK_GRAMMAR}})
    lark.Lark(LARK_GRAMMAR).parse(str(llm.invoke("Greet Anna.").content))
