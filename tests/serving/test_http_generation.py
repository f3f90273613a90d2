"""The HTTP API generating on the embedded model, driven by the real ``openai`` client (and httpx for SGLang's
``/generate``). Every request runs concurrently in one module fixture (``outcomes``), so that the scheduler decodes
them in shared batches rather than one after another; each table row is still its own test. Over 300 lines: the
table is one fixture's input, so it stays in one module."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

from tests.helpers import (
    ANSWER_TAG,
    COLORS,
    FEW_SHOT_JSON,
    JSON_SCHEMA_FORMAT,
    MODEL,
    PHONE_REGEX,
    QUESTION,
    SO,
    YES_NO_EBNF,
    YES_NO_EBNF_LANGUAGE,
    YES_NO_SCHEMA,
    HttpServer,
    is_color,
    is_json_object,
    is_yes_no_json,
    matches,
)


@dataclass(frozen=True)
class Clients:
    openai: openai.AsyncOpenAI
    http: httpx.AsyncClient


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Clients], Awaitable[Any]]
    check: Callable[[Any], None]


def chat_case(
    case_id: str, check: Callable[[str], None], messages: list[ChatCompletionMessageParam], **kwargs: Any
) -> Case:
    """A chat completion whose constraint must finish (``stop``) with a text that passes ``check``."""

    async def run(clients: Clients) -> Any:
        return await clients.openai.chat.completions.create(
            model=MODEL,
            messages=messages,
            temperature=0,
            max_tokens=40,
            **kwargs,
        )

    def check_completion(completion: Any) -> None:
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        check(choice.message.content)

    return Case(case_id, run, check_completion)


ANSWER_TAG_TEXT = json.dumps(ANSWER_TAG)
IS_ANSWER_TAG = matches(r"<answer>(yes|no)</answer>")
IS_PHONE = matches(PHONE_REGEX)
IS_YES_NO_PAIR = matches(YES_NO_EBNF_LANGUAGE)
CONSTRAINT_CASES = [
    chat_case("response_format.json_schema", is_yes_no_json, QUESTION, response_format=JSON_SCHEMA_FORMAT),
    chat_case("response_format.json_object", is_json_object, FEW_SHOT_JSON, response_format={"type": "json_object"}),
    chat_case("response_format.structural_tag", IS_ANSWER_TAG, QUESTION, response_format=ANSWER_TAG),
    chat_case("sglang.regex", IS_PHONE, QUESTION, extra_body={"regex": PHONE_REGEX}),
    chat_case("sglang.ebnf", IS_YES_NO_PAIR, QUESTION, extra_body={"ebnf": YES_NO_EBNF}),
    chat_case("sglang.json_schema", is_yes_no_json, QUESTION, extra_body={"json_schema": json.dumps(YES_NO_SCHEMA)}),
    chat_case(f"vllm.{SO}.json", is_yes_no_json, QUESTION, extra_body={SO: {"json": YES_NO_SCHEMA}}),
    chat_case(f"vllm.{SO}.regex", IS_PHONE, QUESTION, extra_body={SO: {"regex": PHONE_REGEX}}),
    chat_case(f"vllm.{SO}.choice", is_color, QUESTION, extra_body={SO: {"choice": COLORS}}),
    chat_case(f"vllm.{SO}.grammar", IS_YES_NO_PAIR, QUESTION, extra_body={SO: {"grammar": YES_NO_EBNF}}),
    chat_case(f"vllm.{SO}.json_object", is_json_object, FEW_SHOT_JSON, extra_body={SO: {"json_object": True}}),
    chat_case(
        f"vllm.{SO}.structural_tag",
        IS_ANSWER_TAG,
        QUESTION,
        extra_body={SO: {"structural_tag": ANSWER_TAG_TEXT}},
    ),
    chat_case("vllm.guided_json", is_yes_no_json, QUESTION, extra_body={"guided_json": YES_NO_SCHEMA}),
    chat_case("vllm.guided_regex", IS_PHONE, QUESTION, extra_body={"guided_regex": PHONE_REGEX}),
    chat_case("vllm.guided_choice", is_color, QUESTION, extra_body={"guided_choice": COLORS}),
    chat_case("vllm.guided_grammar", IS_YES_NO_PAIR, QUESTION, extra_body={"guided_grammar": YES_NO_EBNF}),
]


class Answer(BaseModel):
    city: Literal["Paris", "London", "Tokyo"]
    is_capital: bool
    population_millions: int = Field(ge=0, le=99)


async def parse_answer(clients: Clients) -> Any:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
    return await clients.openai.chat.completions.parse(
        model=MODEL,
        messages=messages,
        response_format=Answer,
        temperature=0,
        max_tokens=60,
    )


async def stream_chat(clients: Clients, **kwargs: Any) -> tuple[dict[int, str], dict[int, str], Any]:
    """``(texts, finish_reasons, usage)`` of a streamed chat completion, texts joined from the deltas per choice."""
    stream = await clients.openai.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    texts: dict[int, str] = {}
    finish_reasons: dict[int, str] = {}
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    return texts, finish_reasons, usage


async def post_generate(clients: Clients, body: dict[str, Any]) -> Any:
    response = await clients.http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(event) for event in events[:-1]]


def generate_case(case_id: str, check: Callable[[str], None], prompt: dict[str, Any], **params: Any) -> Case:
    """``/generate`` with one SGLang constraint field; checks SGLang's answer shape and the text."""

    def check_result(result: dict[str, Any]) -> None:
        meta = result["meta_info"]
        assert meta["finish_reason"]["type"] == "stop", meta
        assert meta["id"] and meta["prompt_tokens"] > 0, meta
        assert meta["completion_tokens"] == len(result["output_ids"]), meta
        check(result["text"])

    body = {**prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 40, **params}}
    return Case(case_id, lambda clients: post_generate(clients, body), check_result)


ASK = {"text": "Q: Is the sky blue?\nA:"}
FEW_SHOT_TEXT = {"text": 'JSON: {"a": 1}\nJSON: {"b": 2}\nJSON:'}
GENERATE_CASES = [
    generate_case("json_schema", is_yes_no_json, ASK, json_schema=json.dumps(YES_NO_SCHEMA)),
    generate_case("regex", matches(PHONE_REGEX), ASK, regex=PHONE_REGEX),
    generate_case("ebnf", matches(YES_NO_EBNF_LANGUAGE), ASK, ebnf=YES_NO_EBNF),
    generate_case("structural_tag", matches(r"<answer>(yes|no)</answer>"), ASK, structural_tag=ANSWER_TAG),
    generate_case("choice", is_color, ASK, choice=COLORS),
    generate_case("json_object", is_json_object, FEW_SHOT_TEXT, json_object=True),
    generate_case("input_ids", is_color, {"input_ids": [504, 2988, 314]}, choice=COLORS),
]


async def chat(clients: Clients, **kwargs: Any) -> Any:
    return await clients.openai.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)


async def complete(clients: Clients, **kwargs: Any) -> Any:
    return await clients.openai.completions.create(model=MODEL, **kwargs)


async def same_seed_twice(clients: Clients) -> list[Any]:
    return list(await asyncio.gather(*(chat(clients, temperature=1.0, seed=1234, max_tokens=6) for _ in range(2))))


async def stream_completion(clients: Clients) -> list[Any]:
    stream = await clients.openai.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        temperature=0,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    return [chunk async for chunk in stream]


def check_n2(completion: Any) -> None:
    assert [c.index for c in completion.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in completion.choices)
    assert completion.usage.completion_tokens == 8


def check_n2_stream(outcome: tuple[dict[int, str], dict[int, str], Any]) -> None:
    texts, finish_reasons, usage = outcome
    assert set(texts) == {0, 1} and finish_reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == 6


def check_stop(stop: str) -> Callable[[Any], None]:
    def check(completion: Any) -> None:
        choice = completion.choices[0]
        text = choice.message.content if hasattr(choice, "message") else choice.text
        assert choice.finish_reason == "stop" and stop not in text, choice

    return check


def check_length(completion: Any) -> None:
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3


def check_same_text(completions: list[Any]) -> None:
    first, second = (c.choices[0].message.content for c in completions)
    assert first == second and first


def check_prompt_major_choices(completion: Any) -> None:
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.usage.completion_tokens == 8


def check_stream_completion(chunks: list[Any]) -> None:
    *text_chunks, usage_chunk = chunks
    assert [c.object for c in chunks] == ["text_completion"] * len(chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in text_chunks)


def check_generate_stream(events: list[dict[str, Any]]) -> None:
    for before, after in itertools.pairwise(events):
        assert after["text"].startswith(before["text"]) and before["meta_info"]["finish_reason"] is None
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    matches(PHONE_REGEX)(events[-1]["text"])


def check_generate_batch(results: list[dict[str, Any]]) -> None:
    assert len(results) == 2
    for result in results:
        is_color(result["text"])


def check_parse(completion: Any) -> None:
    assert isinstance(completion.choices[0].message.parsed, Answer), completion.choices[0].message


def check_stream_json(outcome: tuple[dict[int, str], dict[int, str], Any]) -> None:
    texts, finish_reasons, usage = outcome
    assert finish_reasons == {0: "stop"}
    is_yes_no_json(texts[0])
    assert usage.completion_tokens > 0


OTHER_CASES = [
    Case("parse", parse_answer, check_parse),
    Case(
        "stream.json_schema",
        lambda c: stream_chat(c, messages=QUESTION, temperature=0, max_tokens=40, response_format=JSON_SCHEMA_FORMAT),
        check_stream_json,
    ),
    Case("n=2", lambda c: chat(c, n=2, max_tokens=4, seed=0), check_n2),
    Case("n=2.stream", lambda c: stream_chat(c, messages=QUESTION, n=2, max_tokens=3, seed=0), check_n2_stream),
    Case("stop.chat", lambda c: chat(c, stop=[" "], temperature=0, max_tokens=10), check_stop(" ")),
    Case(
        "stop.completions",
        lambda c: complete(c, prompt="1, 2, 3, 4,", stop=[","], temperature=0, max_tokens=8),
        check_stop(","),
    ),
    Case("max_tokens", lambda c: chat(c, temperature=0, max_tokens=3), check_length),
    Case("max_completion_tokens", lambda c: chat(c, temperature=0, max_completion_tokens=3), check_length),
    Case("seed", same_seed_twice, check_same_text),
    Case(
        "completions.prompts_and_n",
        lambda c: complete(c, prompt=["A", "B"], n=2, max_tokens=2, seed=0),
        check_prompt_major_choices,
    ),
    Case("completions.stream", stream_completion, check_stream_completion),
    Case(
        "generate.stream",
        lambda c: post_generate(c, {**ASK, "stream": True, "sampling_params": {"regex": PHONE_REGEX}}),
        check_generate_stream,
    ),
    Case(
        "generate.batch",
        lambda c: post_generate(c, {"text": ["Red or blue?", "Pick one:"], "sampling_params": {"choice": COLORS}}),
        check_generate_batch,
    ),
]
ALL_CASES = CONSTRAINT_CASES + GENERATE_CASES + OTHER_CASES


@pytest.fixture(scope="module")
def outcomes(server: HttpServer) -> dict[str, Any]:
    """Every case's result (or the exception it raised), all requests sent at once."""

    async def run_all() -> list[Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as http:
            client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
            clients = Clients(client, http)
            try:
                return await asyncio.gather(*(case.run(clients) for case in ALL_CASES), return_exceptions=True)
            finally:
                await client.close()

    return {case.id: result for case, result in zip(ALL_CASES, asyncio.run(run_all()), strict=True)}


def check_outcome(outcomes: dict[str, Any], case: Case) -> None:
    result = outcomes[case.id]
    if isinstance(result, BaseException):
        raise result
    case.check(result)


@pytest.mark.model
@pytest.mark.parametrize("case", CONSTRAINT_CASES, ids=lambda case: case.id)
def test_constraint_fields_constrain_the_chat_completion(outcomes: dict[str, Any], case: Case) -> None:
    check_outcome(outcomes, case)


@pytest.mark.model
@pytest.mark.parametrize("case", GENERATE_CASES, ids=lambda case: case.id)
def test_generate_endpoint_takes_each_sglang_field(outcomes: dict[str, Any], case: Case) -> None:
    check_outcome(outcomes, case)


@pytest.mark.model
@pytest.mark.parametrize("case", OTHER_CASES, ids=lambda case: case.id)
def test_sampling_streaming_and_parsing(outcomes: dict[str, Any], case: Case) -> None:
    check_outcome(outcomes, case)


@pytest.mark.model
def test_a_repeated_prompt_reports_its_cached_tokens(server: HttpServer, client: openai.OpenAI) -> None:
    """The second asking of a chat reuses the first's KV: OpenAI's usage, SGLang's meta_info and /health say so."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name a prime number below ten."}]
    first, second = (
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0) for _ in range(2)
    )
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens_details is not None
    # All but the last prompt token: the forward that yields the first output's logits must run on one.
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    body = {"text": "Count to five:", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}
    metas = [httpx.post(f"{server.url}/generate", json=body, timeout=600).json()["meta_info"] for _ in range(2)]
    assert metas[1]["cached_tokens"] == metas[1]["prompt_tokens"] - 1
    assert server.health()["scheduler"]["cache_hit_rate"] > 0
