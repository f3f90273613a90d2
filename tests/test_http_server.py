"""The HTTP API end to end: ``python -m scheduler.launch --port`` as a real subprocess serving the embedded
SmolLM2-135M on CPU, driven by the real ``openai`` client (and httpx for SGLang's ``/generate`` and raw bodies).

Every request that generates more than a token or two runs concurrently in one module fixture (``outcomes``),
so that the scheduler decodes them in shared batches rather than one after another; each table row is still its
own test, which checks its own outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam
from pydantic import BaseModel, Field

from scheduler.openai_protocol import ChatCompletionRequest, ProtocolError, parse_body
from scheduler.openai_requests import chat_calls
from scheduler.process import SchedulerProcess, free_port
from scheduler.server_args import EMBEDDED_MODEL_NAME

MODEL = EMBEDDED_MODEL_NAME
SERVER_FLAGS = ("--max-running-requests", "32", "--max-seq-len", "384")
"""Slots for every concurrent test request at once; a KV cache small enough to start in seconds."""

YES_NO_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue"]
YES_NO_EBNF = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
YES_NO_EBNF_LANGUAGE = r"(yes|no) (yes|no)"
ANSWER_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "regex", "pattern": "yes|no"},
        "end": "</answer>",
    },
}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Is the sky blue?"}]
FEW_SHOT_JSON: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Give me a JSON object with key a set to 1."},
    {"role": "assistant", "content": '{"a": 1}'},
    {"role": "user", "content": "Now with key b set to 2."},
]


def is_yes_no_json(text: str) -> None:
    jsonschema.validate(json.loads(text), YES_NO_SCHEMA)


def is_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def matches(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check


def is_color(text: str) -> None:
    assert text in COLORS, text


# --- translation of the constraint fields (no server) -----------------------------------------------------------

JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO_SCHEMA, "strict": True}}
SO = "structured_outputs"
CONSTRAINT_SOURCES: dict[str, tuple[dict[str, Any], str]] = {
    "response_format (json_schema)": ({"response_format": JSON_SCHEMA_FORMAT}, "json_schema"),
    "response_format (json_object)": ({"response_format": {"type": "json_object"}}, "json_object"),
    "response_format (structural_tag)": ({"response_format": ANSWER_TAG}, "structural_tag"),
    "regex": ({"regex": PHONE_REGEX}, "regex"),
    "ebnf": ({"ebnf": YES_NO_EBNF}, "ebnf"),
    "json_schema": ({"json_schema": json.dumps(YES_NO_SCHEMA)}, "json_schema"),
    f"{SO}.json": ({SO: {"json": YES_NO_SCHEMA}}, "json_schema"),
    f"{SO}.regex": ({SO: {"regex": PHONE_REGEX}}, "regex"),
    f"{SO}.choice": ({SO: {"choice": COLORS}}, "choice"),
    f"{SO}.grammar": ({SO: {"grammar": YES_NO_EBNF}}, "ebnf"),
    f"{SO}.json_object": ({SO: {"json_object": True}}, "json_object"),
    f"{SO}.structural_tag": ({SO: {"structural_tag": json.dumps(ANSWER_TAG)}}, "structural_tag"),
    "guided_json": ({"guided_json": YES_NO_SCHEMA}, "json_schema"),
    "guided_regex": ({"guided_regex": PHONE_REGEX}, "regex"),
    "guided_choice": ({"guided_choice": COLORS}, "choice"),
    "guided_grammar": ({"guided_grammar": YES_NO_EBNF}, "ebnf"),
}
"""Every way to ask for a constraint (OpenAI, SGLang, vLLM) and the scheduler field it becomes."""


@given(st.sets(st.sampled_from(sorted(CONSTRAINT_SOURCES)), max_size=3))
def test_one_constraint_is_translated_and_more_are_refused_by_name(names: set[str]) -> None:
    assume(sum(name.startswith("response_format") for name in names) <= 1)
    body: dict[str, Any] = {"messages": QUESTION, "n": 2}
    for name in names:
        fields = CONSTRAINT_SOURCES[name][0]
        body |= {key: body.get(key, {}) | value if key == SO else value for key, value in fields.items()}
    request = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    if len(names) > 1:
        with pytest.raises(ProtocolError) as error:
            chat_calls(request, "id", max_seq_len=100)
        assert error.value.status_code == 400 and all(name in error.value.message for name in names)
        return
    calls = chat_calls(request, "id", max_seq_len=100)
    expected = [CONSTRAINT_SOURCES[name][1] for name in names]
    assert [call.sampling_params.constraint_fields() for call in calls] == [expected, expected]


# --- a live server --------------------------------------------------------------------------------------------


class HttpServer(SchedulerProcess):
    """The launcher with ``--port`` (the package's test launcher, plus the HTTP side)."""

    def __init__(self, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__("--port", str(self.port), *SERVER_FLAGS, *flags)

    def wait_until_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=10).status_code == 200:
                    return
            assert self.process.poll() is None, f"the launcher exited at start-up; log:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"not healthy within {timeout_s:g} s; log:\n{self.log()[-4000:]}"
            time.sleep(0.5)

    def health(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/health", timeout=30)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def frontend_pid(self) -> int:
        pid = self.process.pid
        (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return int(child)

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)


@contextlib.contextmanager
def serving(*servers: HttpServer) -> Iterator[None]:
    """Wait until every server is healthy (their start-ups overlap); stop them all afterwards."""
    try:
        for server in servers:
            server.wait_until_healthy()
        yield
    finally:
        for server in servers:
            server.stop()
            server.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    live = HttpServer()
    with serving(live):
        yield live


@pytest.fixture(scope="module")
def client(server: HttpServer) -> openai.OpenAI:
    return server.openai_client()


# --- requests that generate, all in flight at once --------------------------------------------------------------


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


# --- one request at a time --------------------------------------------------------------------------------------


@pytest.mark.model
def test_health_and_models(server: HttpServer, client: openai.OpenAI) -> None:
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL and health["grammar_backend"] == "xgrammar"
    assert health["running_requests"] == 0 and health["scheduler"]["num_running_requests"] == 0
    assert [model.id for model in client.models.list()] == [MODEL]


INVALID_CONSTRAINTS = [
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
        "Failed to compile json grammar",
        id="json_schema",
    ),
    pytest.param(
        {"extra_body": {"guided_json": {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}}},
        "patternProperties",
        id="unsupported_schema_feature",
    ),
    pytest.param({"extra_body": {"regex": "("}}, "Failed to compile regex grammar", id="regex"),
    pytest.param({"extra_body": {"ebnf": "root ::= ("}}, "Failed to compile ebnf grammar", id="ebnf"),
    pytest.param({"stream": True, "extra_body": {"regex": "[a-"}}, "Failed to compile regex grammar", id="stream"),
]


@pytest.mark.model
@pytest.mark.parametrize(("kwargs", "message"), INVALID_CONSTRAINTS)
def test_invalid_constraint_is_a_400_and_the_next_request_succeeds(
    client: openai.OpenAI, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **kwargs)
    assert message in error.value.message and error.value.code == "invalid_constraint", error.value.body
    completion = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    assert completion.choices[0].finish_reason == "length"


TWO_CONSTRAINTS = [
    pytest.param({"regex": "a"}, {"type": "json_object"}, ["regex", "response_format (json_object)"], id="regex+rf"),
    pytest.param({"guided_choice": ["a"], SO: {"regex": "a"}}, None, ["guided_choice", f"{SO}.regex"], id="vllm"),
    pytest.param({"ebnf": 'root ::= "a"', "json_schema": "{}"}, None, ["ebnf", "json_schema"], id="sglang"),
    pytest.param({SO: {"json": {}, "choice": ["a"]}}, None, [f"{SO}.json", f"{SO}.choice"], id="structured_outputs"),
]


@pytest.mark.model
@pytest.mark.parametrize(("extra_body", "response_format", "names"), TWO_CONSTRAINTS)
def test_two_constraints_are_a_400_naming_both(
    client: openai.OpenAI, extra_body: dict[str, Any], response_format: Any, names: list[str]
) -> None:
    kwargs = {"response_format": response_format} if response_format else {}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body=extra_body, **kwargs)
    assert all(name in error.value.message for name in names), error.value.message
    assert error.value.code == "multiple_constraints"


CHAT = "/v1/chat/completions"
BAD_BODIES = [
    pytest.param(CHAT, b'{"messages": [', 400, {"code": "invalid_json"}, id="invalid-json"),
    pytest.param(CHAT, b"[1, 2]", 400, {}, id="not-an-object"),
    pytest.param(CHAT, {"messages": QUESTION, "temperature": "hot"}, 400, {"param": "temperature"}, id="wrong-type"),
    pytest.param(CHAT, {"messages": QUESTION, "top_p": 0}, 400, {"param": "top_p"}, id="out-of-range"),
    pytest.param(CHAT, {"messages": []}, 400, {"param": "messages"}, id="no-messages"),
    pytest.param(CHAT, {"messages": QUESTION, "frobnicate": 1}, 400, {"param": "frobnicate"}, id="unknown-field"),
    pytest.param(
        CHAT, {"messages": QUESTION, "logprobs": True}, 400, {"code": "unsupported_parameter"}, id="unsupported"
    ),
    pytest.param(CHAT, {"messages": QUESTION, "model": "gpt-4"}, 404, {"code": "model_not_found"}, id="unknown-model"),
    pytest.param("/v1/completions", {"prompt": []}, 400, {"param": "prompt"}, id="empty-prompt"),
    pytest.param(
        "/generate", {"text": "x", "sampling_params": {"frobnicate": 1}}, 400, {"param": "sampling_params"}, id="param"
    ),
    pytest.param("/generate", {"text": "x", "input_ids": [1]}, 400, {}, id="two-prompts"),
    pytest.param("/generate", {"input_ids": [10**6]}, 400, {}, id="token-id-out-of-range"),
    pytest.param("/generate", {"text": "x", "sampling_params": {"seed": 2**70}}, 400, {"param": "seed"}, id="seed"),
    pytest.param(
        "/generate", {"text": "x", "sampling_params": {"regex": "a", "json_schema": {}}}, 400, {}, id="two-constraints"
    ),
    pytest.param("/v1/nothing", {}, 404, {}, id="unknown-route"),
]


@pytest.mark.model
@pytest.mark.parametrize(("path", "body", "status", "expected"), BAD_BODIES)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    server: HttpServer, path: str, body: bytes | dict[str, Any], status: int, expected: dict[str, Any]
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error" and expected.items() <= error.items(), error
    assert server.health()["status"] == "ok"


async def _wait_for_health(http: httpx.AsyncClient, condition: Callable[[dict[str, Any]], bool]) -> None:
    """Poll ``/health`` until ``condition`` holds (a busy scheduler may answer late: 503, or an older answer)."""
    deadline = time.monotonic() + 120
    while True:
        response = await http.get("/health")
        if response.status_code == 200 and condition(response.json()):
            return
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.1)


def _is_idle(health: dict[str, Any]) -> bool:
    return health["running_requests"] == 0 and health["scheduler"]["num_running_requests"] == 0


async def _disconnect_mid_request(url: str, stream: bool) -> None:
    rid = f"disconnect-{stream}"
    # Counting goes on to the token limit (no EOS), long enough to be caught running.
    params = {"max_new_tokens": 300, "temperature": 0}
    body = {"text": "1, 2, 3, 4, 5, 6,", "rid": rid, "stream": stream, "sampling_params": params}
    again = {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def consume() -> None:
            async with http.stream("POST", "/generate", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass

        request = asyncio.create_task(consume())
        await _wait_for_health(http, lambda h: h["scheduler"]["num_running_requests"] == 1)
        clash = await http.post("/generate", json=again)
        assert clash.status_code == 400 and "is running" in clash.json()["error"]["message"], clash.text
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _wait_for_health(http, _is_idle)
        # The frontend has sent the abort before this request on the same socket: the scheduler freed the rid.
        response = await http.post("/generate", json=again)
        assert response.status_code == 200, response.text


@pytest.mark.model
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_client_disconnect_aborts_the_request_in_the_scheduler(server: HttpServer, stream: bool) -> None:
    asyncio.run(_disconnect_mid_request(server.url, stream))
    assert f"aborting 1 scheduler request(s) ['disconnect-{stream}']" in server.log()


def _is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _ctrl_c(live: HttpServer) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    for pid in (live.process.pid, live.frontend_pid()):
        os.kill(pid, signal.SIGINT)


SHUTDOWN_CASES: dict[str, Callable[[HttpServer], None]] = {
    "ctrl-c": _ctrl_c,
    "SIGTERM": lambda live: live.process.send_signal(signal.SIGTERM),
    "SIGKILL": lambda live: live.process.send_signal(signal.SIGKILL),
}
"""How the launcher is stopped: Ctrl-C reaches the frontend as well, the others the launcher alone."""


@pytest.fixture(scope="module")
def doomed_servers() -> Iterator[dict[str, HttpServer]]:
    """A small server per way of stopping it, started side by side."""
    servers = {how: HttpServer("--grammar-backend", "none", "--max-running-requests", "2") for how in SHUTDOWN_CASES}
    with serving(*servers.values()):
        yield servers


@pytest.mark.model
@pytest.mark.parametrize("how", SHUTDOWN_CASES)
def test_the_frontend_stops_with_the_launcher(doomed_servers: dict[str, HttpServer], how: str) -> None:
    """Mid-stream, the client gets an error; the frontend exits (by itself when the launcher is killed)."""
    live = doomed_servers[how]
    frontend = live.frontend_pid()
    stream = live.openai_client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=300, stream=True)
    next(iter(stream))
    SHUTDOWN_CASES[how](live)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert live.process.wait(timeout=60) == (-signal.SIGKILL if how == "SIGKILL" else 0), live.log()[-4000:]
    deadline = time.monotonic() + 30
    while _is_alive(frontend):
        assert time.monotonic() < deadline, f"the frontend (pid {frontend}) outlived the launcher"
        time.sleep(0.1)
    with socket.create_server(("127.0.0.1", live.port)):
        pass
