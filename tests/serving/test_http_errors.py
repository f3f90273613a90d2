"""Client errors over HTTP: OpenAI's error shape and status, a clear reason, and a server that keeps serving."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.helpers import MODEL, QUESTION, SO, HttpServer


@pytest.mark.model
def test_health_and_models(server: HttpServer, client: openai.OpenAI) -> None:
    health = server.health()
    assert health["status"] == "ok" and health["model"] == MODEL and health["grammar_backend"] == "auto"
    assert health["running_requests"] == 0 and health["scheduler"]["num_running_requests"] == 0
    assert [model.id for model in client.models.list()] == [MODEL]


INVALID_CONSTRAINTS = [
    pytest.param(
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}},
        "Failed to compile json grammar",
        id="json_schema",
    ),
    pytest.param(
        {"extra_body": {"guided_json": {"type": "object", "not": {"required": ["a"]}}}},
        "feature 'not'",
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
    body = error.value.body
    assert isinstance(body, dict) and message in body["message"] and error.value.code == "invalid_constraint", body
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
    pytest.param(CHAT, {"messages": QUESTION, "best_of": 2}, 400, {"code": "unknown_parameter"}, id="unknown-for-chat"),
    pytest.param(
        CHAT,
        {"messages": QUESTION, "guided_whitespace_pattern": " *"},
        400,
        {"code": "unsupported_parameter"},
        id="unsupported",
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
    response = server.http.post(path, content=content, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["type"] == "invalid_request_error" and expected.items() <= error.items(), error
    assert server.health()["status"] == "ok"
