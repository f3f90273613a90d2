"""Every way OpenAI, SGLang and vLLM clients ask for a constraint becomes one scheduler field; two are refused."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from scheduler.http.protocol import ChatCompletionRequest, ProtocolError, parse_body
from scheduler.http.request_conversion import RequestLimits, chat_calls
from tests.helpers import ANSWER_TAG, COLORS, JSON_SCHEMA_FORMAT, PHONE_REGEX, QUESTION, SO, YES_NO_EBNF, YES_NO_SCHEMA

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
LIMITS = RequestLimits(max_seq_len=100, max_spec_bytes=1 << 20)


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
            chat_calls(request, "id", LIMITS)
        assert error.value.status_code == 400 and all(name in error.value.message for name in names)
        return
    calls = chat_calls(request, "id", LIMITS)
    expected = [CONSTRAINT_SOURCES[name][1] for name in names]
    assert [call.sampling_params.constraint_fields() for call in calls] == [expected, expected]
