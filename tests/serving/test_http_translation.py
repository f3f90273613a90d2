"""Every way OpenAI, SGLang and vLLM clients ask for a constraint becomes one scheduler field; two are refused."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pydantic
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from scheduler.http.protocol import ChatCompletionRequest, ProtocolError, _openai_wording, parse_body
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


def test_a_part_of_the_wrong_type_is_named_by_its_type_whatever_order_pydantic_lists_its_problems() -> None:
    """A predicted output's ``image_url`` part has a wrong tag, lacks ``text`` and has an unknown field. pydantic 2.13
    lists the unknown field first and 2.14 the tag: the message names the tag in every order of the problems
    (``test_bad_input_corpus`` checks the whole request on the pydantic installed, one order)."""
    part = {"type": "image_url", "image_url": {"url": "x"}}
    body = {"messages": QUESTION, "prediction": {"type": "content", "content": [part]}}
    with pytest.raises(pydantic.ValidationError) as raised:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    field = ("prediction", "content")
    problems = [p for p in raised.value.errors(include_url=False) if p["loc"][: len(field)] == field]
    inside = [p for p in problems if len(p["loc"]) > len(field) + 1]
    assert {p["type"] for p in inside} == {"literal_error", "missing", "extra_forbidden"}
    for order in itertools.permutations(problems):
        message, _ = _openai_wording(order[0], "prediction.content", list(order), len(field))
        assert message.startswith("prediction.content.0.type: ") and "'text'" in message, message
