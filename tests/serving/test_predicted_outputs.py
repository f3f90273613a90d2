"""OpenAI's predicted outputs over HTTP: ``prediction`` on chat completions, completions and ``/generate`` changes no
answer, and its usage counts what the answer repeated (streamed and not).

The exactness of prediction drafts on every grammar backend, greedy and seeded, is checked in process in
``test_speculative.py``, and malformed predictions (400s naming the field) in ``test_bad_input_corpus.py``; here the
answers with and without a prediction are each computed on an empty prefix cache, as that comparison needs."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.helpers import MODEL, PERSON_SCHEMA, HttpServer

pytestmark = pytest.mark.model

COPY_JSON = [{"role": "user", "content": 'Repeat this JSON exactly: {"name": "Bo", "age": 7}'}]
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}}
COUNTING = "Count with me: one, two, three, four, five, six,"


def flush_cache(server: HttpServer) -> None:
    response = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text


def chat(server: HttpServer, client: openai.OpenAI, **extra: Any) -> Any:
    """A greedy JSON answer to ``COPY_JSON`` computed on an empty prefix cache (``extra``: more arguments of the
    call)."""
    flush_cache(server)
    return client.chat.completions.create(
        model=MODEL, messages=COPY_JSON, max_tokens=32, temperature=0, response_format=PERSON_FORMAT, **extra
    )


def num_tokens(server: HttpServer, text: str) -> int:
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert response.status_code == 200, response.text
    return int(response.json()["count"])


def test_a_prediction_that_is_the_answer_is_all_accepted_streamed_or_not(
    server: HttpServer, client: openai.OpenAI
) -> None:
    plain = chat(server, client).choices[0].message.content
    assert plain and plain.count('"') >= 6, plain
    prediction = {"type": "content", "content": [{"type": "text", "text": plain}]}  # OpenAI's list-of-parts form
    predicted = chat(server, client, extra_body={"prediction": prediction})
    assert predicted.choices[0].message.content == plain
    details = predicted.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (num_tokens(server, plain), 0)
    prediction = {"type": "content", "content": plain}
    chunks = list(
        chat(server, client, stream=True, stream_options={"include_usage": True}, extra_body={"prediction": prediction})
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens_details == details


def test_a_diverging_prediction_changes_no_answer_and_is_partly_rejected(
    server: HttpServer, client: openai.OpenAI
) -> None:
    plain = chat(server, client).choices[0].message.content
    assert plain is not None and '"Bo"' in plain, plain
    edited = plain.replace('"Bo"', '"Alexander"')
    predicted = chat(server, client, extra_body={"prediction": {"type": "content", "content": edited}})
    assert predicted.choices[0].message.content == plain
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == num_tokens(server, edited)
    assert details.accepted_prediction_tokens <= predicted.usage.completion_tokens


def test_completions_and_generate_take_a_prediction(server: HttpServer, client: openai.OpenAI) -> None:
    """A seeded completion with an edited prediction, and ``/generate`` with the answer's token ids as prediction:
    the same output as without; the ids are all accepted (the stop token included)."""
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": COUNTING, "max_tokens": 16, "temperature": 0.8, "seed": 3}
    flush_cache(server)
    plain = client.completions.create(**kwargs).choices[0].text
    flush_cache(server)
    edited = {"type": "content", "content": plain.replace(",", ";", 2)}
    assert client.completions.create(**kwargs, extra_body={"prediction": edited}).choices[0].text == plain
    params = {"max_new_tokens": 12, "temperature": 0}
    flush_cache(server)
    first = httpx.post(f"{server.url}/generate", json={"text": COUNTING, "sampling_params": params}, timeout=300)
    ids = first.json()["output_ids"]
    flush_cache(server)
    body = {"text": COUNTING, "sampling_params": params, "prediction": ids}
    result = httpx.post(f"{server.url}/generate", json=body, timeout=300).json()
    assert result["output_ids"] == ids
    meta = result["meta_info"]
    assert (meta["accepted_prediction_tokens"], meta["rejected_prediction_tokens"]) == (len(ids), 0)
    assert first.json()["meta_info"]["accepted_prediction_tokens"] == 0
