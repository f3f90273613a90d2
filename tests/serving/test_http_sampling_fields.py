"""SGLang's and vLLM's documented request fields, as their clients send them, on the embedded model: SGLang's
``/generate`` ``sampling_params`` and logprob fields with its ``meta_info`` shape, the OpenAI client with OpenAI's and
vLLM's extras, and the service endpoints (model and server info, cache flush, deep health, tokenize, version).

Each field is checked by what a user sees: a stop token ends the output where it occurs, a banned token never
appears, ``n`` seeded samples come back the same twice, and no token a constraint disallows is ever among the top
logprobs."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import MODEL, QUESTION, YES_NO_SCHEMA, HttpServer

pytestmark = pytest.mark.model

DIGITS = r"[0-9]{4}"
COUNTING = "Count with me: one, two, three, four, five, six,"


def generate(server: HttpServer, **body: Any) -> Any:
    response = httpx.post(f"{server.url}/generate", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_generate_takes_every_sglang_sampling_field(server: HttpServer) -> None:
    """Every documented ``sampling_params`` field at once, with a constraint: the output keeps to it and
    ``meta_info`` has SGLang's shape, logprobs included."""
    params = {
        "n": 1,
        "max_new_tokens": 12,
        "min_new_tokens": 2,
        "stop": [],
        "stop_token_ids": [],
        "ignore_eos": False,
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": -1,
        "min_p": 0.01,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "repetition_penalty": 1.1,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "no_stop_trim": False,
        "logit_bias": {"15": 1.0},
        "sampling_seed": 11,
        "custom_params": None,
        "regex": DIGITS,
    }
    result = generate(
        server,
        text="A four-digit number:",
        sampling_params=params,
        return_logprob=True,
        top_logprobs_num=20,
        logprob_start_len=-1,
        return_text_in_logprobs=True,
    )
    assert set(result) == {"text", "output_ids", "meta_info"}
    meta = result["meta_info"]
    assert len(result["text"]) == 4 and result["text"].isdigit(), result["text"]
    assert meta["finish_reason"]["type"] == "stop" and isinstance(meta["finish_reason"]["matched"], int)
    assert meta["completion_tokens"] == len(result["output_ids"]) == len(meta["output_token_logprobs"])
    assert {"id", "prompt_tokens", "cached_tokens"} <= set(meta) and meta["input_token_logprobs"] == []
    stop_token = meta["finish_reason"]["matched"]
    for (logprob, token_id, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert logprob <= 0 and any(entry[1] == token_id and entry[0] == logprob for entry in top)
        assert [entry[0] for entry in top] == sorted((entry[0] for entry in top), reverse=True)
        assert math.fsum(math.exp(entry[0]) for entry in top) <= 1 + 1e-4
        # the top 20 of the whole vocabulary would hold words: the mask leaves digits (and the stop token at the end)
        assert all(entry[2].strip().isdigit() or entry[1] == stop_token for entry in top), top


def flush_cache(server: HttpServer) -> None:
    response = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert response.status_code == 200, response.text


def test_generate_n_gives_n_seeded_samples_reproducibly(server: HttpServer) -> None:
    """Choice ``i`` is the sample of seed ``seed + i`` (the same alone, computed without any cache)."""
    prompt = "My favourite animal is"
    params = {"n": 4, "temperature": 1.0, "sampling_seed": 7, "max_new_tokens": 8}
    flush_cache(server)
    first = generate(server, text=prompt, sampling_params=params)
    assert isinstance(first, list) and len(first) == 4
    assert len({r["text"] for r in first}) > 1
    # choices that reached the scheduler together take the whole prompt's KV from the first, later ones all but its
    # last token (the in-process check of this is in test_speculative.py; here arrival depends on the frontend)
    num_prompt_tokens = first[0]["meta_info"]["prompt_tokens"]
    assert {r["meta_info"]["cached_tokens"] for r in first} <= {0, num_prompt_tokens - 1, num_prompt_tokens}
    again = generate(server, text=prompt, sampling_params=params)
    assert [r["output_ids"] for r in first] == [r["output_ids"] for r in again]
    for i, result in list(enumerate(first))[1:3]:
        flush_cache(server)
        alone = generate(server, text=prompt, sampling_params={**params, "n": 1, "sampling_seed": 7 + i})
        assert alone["output_ids"] == result["output_ids"], i
    batch = generate(server, text=["Hi", "Hello"], sampling_params={**params, "n": 2})
    assert len(batch) == 4  # prompt-major: each prompt's two choices


def test_a_stop_token_ends_the_output_where_it_occurs(server: HttpServer) -> None:
    plain = generate(server, text=COUNTING, sampling_params={"temperature": 0, "max_new_tokens": 10})
    ids = plain["output_ids"]
    assert plain["meta_info"]["finish_reason"] == {"type": "length", "length": 10}, plain
    index = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stop = ids[index]
    for no_stop_trim in (False, True):
        params = {"temperature": 0, "max_new_tokens": 10, "stop_token_ids": [stop], "no_stop_trim": no_stop_trim}
        result = generate(server, text=COUNTING, sampling_params=params)
        assert result["output_ids"] == ids[: index + 1]
        assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        shown = ids[: index + 1] if no_stop_trim else ids[:index]
        detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": shown}, timeout=30).json()["prompt"]
        assert result["text"] == detokenized


def test_logit_bias_bans_and_forces_tokens(server: HttpServer) -> None:
    plain = generate(server, text=COUNTING, sampling_params={"temperature": 0, "max_new_tokens": 6})
    banned = plain["output_ids"][0]
    params = {"temperature": 0, "max_new_tokens": 6, "logit_bias": {str(banned): -100}}
    without = generate(server, text=COUNTING, sampling_params=params)
    assert banned not in without["output_ids"]
    forced = generate(
        server, text=COUNTING, sampling_params={"temperature": 0, "max_new_tokens": 4, "logit_bias": {"1345": 100}}
    )
    assert forced["output_ids"] == [1345] * 4


def test_penalties_make_a_repetitive_output_less_repetitive(server: HttpServer) -> None:
    prompt = "Repeat forever: la la la la la la la la la la"

    def most_repeated(**penalties: float) -> int:
        result = generate(server, text=prompt, sampling_params={"temperature": 0, "max_new_tokens": 16, **penalties})
        return max(Counter(result["output_ids"]).values())

    plain = most_repeated()
    assert most_repeated(frequency_penalty=1.5) < plain
    assert most_repeated(repetition_penalty=2.0) < plain


def test_ignore_eos_and_min_tokens_lengthen_a_short_answer(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Answer with one word: is the sky blue?"}]

    def completion(**extra: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=24, extra_body=extra or None
        )

    short = completion()
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 12
    ignored = completion(ignore_eos=True)
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 24
    longer = completion(min_tokens=16)
    assert longer.usage.completion_tokens >= 16


def test_openai_chat_with_openai_and_vllm_fields(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": QUESTION,
        "n": 2,
        "seed": 5,
        "temperature": 0.9,
        "logprobs": True,
        "top_logprobs": 3,
        "stop": ["\n\n"],
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "logit_bias": {"15": -1.0},
        "max_completion_tokens": 24,
        "user": "test-user",
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO_SCHEMA}},
        "extra_body": {"min_p": 0.05, "top_k": 20, "repetition_penalty": 1.05, "min_tokens": 1, "stop_token_ids": []},
    }
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    for choice in first.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), YES_NO_SCHEMA)
        content = choice.logprobs.content
        assert "".join(entry.token for entry in content).startswith(choice.message.content or "")  # then EOS
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) <= 3
            assert entry.bytes == list(entry.token.encode())


def test_openai_streams_logprobs_and_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and not chunks[-1].choices
    tokens = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert len(tokens) == chunks[-1].usage.completion_tokens


def test_openai_completions_logprobs_and_legacy_guided_fields(client: openai.OpenAI) -> None:
    completion = client.completions.create(
        model=MODEL,
        prompt="The colour of grass is",
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )
    choice = completion.choices[0]
    assert choice.text in ("red", "green", "blue")
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs and logprobs.token_logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_a_field_the_server_cannot_honour_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, extra_body={"guided_regex": "a+", "guided_whitespace_pattern": " *"}
        )
    assert "guided_whitespace_pattern" in error.value.message


def test_service_endpoints(server: HttpServer) -> None:
    url = server.url
    tokenized = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) == len(tokenized["token_strs"]) > 0
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokenized["tokens"]}).json() == {"prompt": "Hello world"}
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > tokenized["count"] and chat["max_model_len"] > 0
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert httpx.get(f"{url}/version").json()["version"]
    model_info = httpx.get(f"{url}/get_model_info").json()
    assert model_info["is_generation"] is True and model_info["model_path"]
    server_info = httpx.get(f"{url}/get_server_info").json()
    assert server_info["grammar_backend"] == "auto" and server_info["version"]
    assert server_info["internal_states"][0]["num_running_requests"] == 0
    flushed = httpx.post(f"{url}/flush_cache", timeout=30)
    assert flushed.status_code == 200 and "flushed" in flushed.text
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200
