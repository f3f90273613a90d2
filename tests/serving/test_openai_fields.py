"""Every field of OpenAI's current chat-completions and completions request bodies, as the installed ``openai``
package declares them, is honoured, accepted as bookkeeping, or refused with a 400 naming it; a name OpenAI does not
know is a 400 naming it. A field a newer ``openai`` adds fails the first test until it is accounted for."""

from __future__ import annotations

import typing
from typing import Any

import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import ChatCompletionStreamOptionsParam
from openai.types.chat import completion_create_params as chat_create_params

from scheduler.http.openai_fields import BOOKKEEPING_FIELDS, REFUSED_FIELDS
from scheduler.http.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from tests.helpers import MODEL, QUESTION


def openai_fields(params: Any) -> set[str]:
    """The request fields of a ``*CompletionCreateParams`` union (streaming and not)."""
    return {name for member in typing.get_args(params) for name in typing.get_type_hints(member)}


def declared(model: type[Any]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize(
    ("params", "model"),
    [
        (chat_create_params.CompletionCreateParams, ChatCompletionRequest),
        (completion_create_params.CompletionCreateParams, CompletionRequest),
    ],
    ids=["chat", "completions"],
)
def test_every_openai_field_is_accounted_for(params: Any, model: type[Any]) -> None:
    fields = openai_fields(params)
    assert fields - declared(model) == set(), "OpenAI fields the server would refuse as unknown"
    nested = {f"stream_options.{name}" for name in typing.get_type_hints(ChatCompletionStreamOptionsParam)}
    assert {name.split(".")[1] for name in nested} <= declared(StreamOptions)
    assert (
        set(BOOKKEEPING_FIELDS) | set(REFUSED_FIELDS)
        <= declared(ChatCompletionRequest) | declared(CompletionRequest) | nested
    )


REFUSED = [
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("moderation", {"model": "omni-moderation-latest"}),
    ("web_search_options", {}),
]


@pytest.mark.model
@pytest.mark.parametrize(("name", "value"), REFUSED, ids=[name for name, _ in REFUSED])
def test_a_field_that_would_change_the_answer_is_a_400_naming_it(client: openai.OpenAI, name: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body={name: value})
    assert name in error.value.message and error.value.code == "unsupported_parameter"


@pytest.mark.model
def test_neutral_values_and_typos(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=1,
        modalities=["text"],
        stream_options=None,
        extra_body={"prediction": {"type": "content", "content": "Yes"}, "prompt_cache_retention": "24h"},
    )
    assert answer.choices[0].message.content is not None
    for typo in ("safety_identifer", "reasoning_efort", "metdata"):
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, extra_body={typo: "x"})
        assert typo in error.value.message and error.value.code == "unknown_parameter"
