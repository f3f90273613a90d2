"""Property-based fuzzing of the HTTP endpoints from the app's own request models: bodies that set any of a model's
fields (from its JSON schema) to arbitrary JSON never get a 5xx, every error is in OpenAI's shape, and the server
serves afterwards."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.http.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from tests.helpers import QUESTION, HttpServer

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.sampled_from([2**31, 2**64, -(2**70), 10**30])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["(", "root ::=", '{"type": "strin"}', "true", "[a-"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
"""Any JSON value: small numbers (so that generations stay short), numbers too large for the wire, and strings
that are broken constraints."""

ENDPOINTS = {
    "/v1/chat/completions": (ChatCompletionRequest, {"messages": QUESTION, "max_tokens": 2}),
    "/v1/completions": (CompletionRequest, {"prompt": "Hi", "max_tokens": 2}),
    "/generate": (GenerateRequest, {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}),
}


def bodies(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """A valid base body with some of the model's fields (its JSON schema's properties) set to any JSON value, its
    token limit kept small so that an accepted body generates a few tokens only."""
    model, base = ENDPOINTS[path]
    fields = [*sorted(model.model_json_schema()["properties"]), "frobnicate"]
    overrides = st.dictionaries(st.sampled_from(fields), JSON_VALUES, max_size=3)
    return overrides.map(lambda changes: _short(base | changes))


def _short(body: dict[str, Any]) -> dict[str, Any]:
    if isinstance(body.get("sampling_params"), dict):
        return body | {"sampling_params": {"max_new_tokens": 2} | body["sampling_params"]}
    if "sampling_params" not in body and body.get("max_tokens") is None:
        return body | {"max_tokens": 2}
    return body


@pytest.mark.model
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_fuzzed_bodies_never_get_a_server_error(server: HttpServer, path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:

        @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
        @given(bodies(path))
        def check(body: dict[str, Any]) -> None:
            response = http.post(path, content=json.dumps(body).encode())
            assert response.status_code < 500, (body, response.text[:300])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"], error

        check()
    assert server.health()["status"] == "ok"
