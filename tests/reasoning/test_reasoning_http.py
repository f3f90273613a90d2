"""A reasoning model served over HTTP, the way SGLang's and vLLM's users call one: ``reasoning_content`` apart from
the answer (streamed as ``delta.reasoning_content``), SGLang's ``separate_reasoning`` on ``/generate``, a thinking
budget under either project's field name, thinking turned off through ``chat_template_kwargs``, and constraints and
tool calls that hold on the answer however the model meets the think gate.

One server for the package: the tiny random-weight Qwen3 with the 248k-token Qwen3.5 vocabulary (``conftest``),
``--reasoning-parser qwen3``. Its chat template opens ``<think>`` in the prompt (Qwen3.5's way); ``/generate`` with a
prompt that does not (a Qwen3 hybrid's way) lets the model open it itself or answer at once. ``logit_bias`` on
``</think>`` and ``<think>`` decides how a sample meets the gate; the tokens in between are the model's own.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from scheduler.http.protocol import ChatCompletionRequest
from scheduler.http.tool_calls import tool_plan
from scheduler.http.tool_syntaxes import SYNTAXES
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import HttpServer

pytestmark = pytest.mark.model

ANSWER = "ANSWER: (yes|no)"
VERDICT = {
    "type": "object",
    "properties": {"prime": {"type": "boolean"}},
    "required": ["prime"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Is 7 a prime number? Think, then answer."}]
RAW_PROMPT = "<|im_start|>user\nIs 7 a prime number?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def bias(qwen35_tokenizer: TokenizerSetup) -> Any:
    def of(**by_tag: float) -> dict[str, float]:
        tags = {"close": "</think>", "open": "<think>"}
        return {str(qwen35_tokenizer.tokenizer.convert_tokens_to_ids(tags[k])): v for k, v in by_tag.items()}

    return of


def chat(server: HttpServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 64, **body}, timeout=600
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


def generate(server: HttpServer, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/generate", json={"text": RAW_PROMPT, **body}, timeout=600)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_thinks_then_answers_the_schema(reasoning_server: HttpServer, bias: Any) -> None:
    """The prompt opens ``<think>``; the model closes it after a few tokens of its own, then answers in the schema."""
    body = chat(
        reasoning_server,
        temperature=1.0,
        seed=0,
        logit_bias=bias(close=10.0),
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}},
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"], "the think block is reported apart"
    jsonschema.validate(json.loads(choice["message"]["content"]), VERDICT)
    assert 0 < body["usage"]["completion_tokens_details"]["reasoning_tokens"] < body["usage"]["completion_tokens"]


def test_a_model_that_never_closes_its_thinking_is_closed_by_the_budget(
    reasoning_server: HttpServer, bias: Any
) -> None:
    """``</think>`` all but banned: the budget forces it, after exactly that many reasoning tokens, under SGLang's
    field name and vLLM's alike; without a budget, ``max_tokens`` does (budget-aware constraints)."""
    common = {"temperature": 0.0, "logit_bias": bias(close=-100.0), "regex": ANSWER}
    vllm = chat(reasoning_server, thinking_token_budget=6, **common)
    sglang = chat(reasoning_server, custom_params={"thinking_budget": 6}, **common)
    assert vllm["choices"][0]["message"] == sglang["choices"][0]["message"]
    choice = vllm["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch(ANSWER, choice["message"]["content"])
    assert choice["message"]["reasoning_content"]
    assert vllm["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6 + 1  # and the forced </think>
    # without a thinking budget the thinking spends max_tokens, but is closed in time for the answer's shortest ending
    unlimited = chat(reasoning_server, max_tokens=24, **common)
    choice = unlimited["choices"][0]
    assert choice["finish_reason"] == "stop" and re.fullmatch(ANSWER, choice["message"]["content"])
    assert unlimited["usage"]["completion_tokens"] <= 24 and choice["message"]["reasoning_content"]


def test_thinking_turned_off_constrains_from_the_first_token(reasoning_server: HttpServer) -> None:
    body = chat(reasoning_server, temperature=0.0, regex=ANSWER, chat_template_kwargs={"enable_thinking": False})
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] is None
    assert re.fullmatch(ANSWER, choice["message"]["content"]) and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_an_answer_without_thinking_is_held_by_the_constraint_and_not_reported_as_reasoning(
    reasoning_server: HttpServer, bias: Any
) -> None:
    """A prompt without ``<think>`` and a model that does not open one: the constraint holds from its first token
    (vLLM #44012), and the answer is the text, not the reasoning (SGLang #4539)."""
    params = {"regex": ANSWER, "temperature": 0.0, "max_new_tokens": 32, "logit_bias": bias(open=-100.0)}
    result = generate(reasoning_server, sampling_params=params, separate_reasoning=True)
    assert re.fullmatch(ANSWER, result["text"]) and not result["reasoning_text"]
    assert result["meta_info"]["finish_reason"]["type"] == "stop"
    assert result["meta_info"]["reasoning_tokens"] == 0


def test_a_model_that_opens_its_thinking_itself(reasoning_server: HttpServer, bias: Any) -> None:
    """A prompt without ``<think>``: the model opens one (its first token), thinks within the budget, answers."""
    params = {
        "regex": ANSWER,
        "temperature": 1.0,
        "seed": 3,
        "max_new_tokens": 32,
        "logit_bias": bias(open=12.0),
        "custom_params": {"thinking_budget": 4},
    }
    result = generate(reasoning_server, sampling_params=params, separate_reasoning=True)
    assert result["reasoning_text"] and re.fullmatch(ANSWER, result["text"])
    assert result["meta_info"]["reasoning_tokens"] == 1 + 4 + 1  # <think>, the budget, </think>
    whole = generate(reasoning_server, sampling_params=params)  # SGLang's default: one text
    assert whole["output_ids"] == result["output_ids"] and "reasoning_text" not in whole


def stream_deltas(server: HttpServer, **body: Any) -> list[dict[str, Any]]:
    """The deltas of a streamed chat completion of ``MESSAGES``."""
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 64, "stream": True, **body},
        timeout=600,
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return [event["choices"][0]["delta"] for event in events if event["choices"]]


def test_streamed_reasoning_and_answer_add_up_to_the_whole_answer(reasoning_server: HttpServer, bias: Any) -> None:
    common = {"temperature": 1.0, "seed": 1, "logit_bias": bias(close=10.0), "regex": ANSWER}
    whole = chat(reasoning_server, **common)["choices"][0]["message"]
    deltas = stream_deltas(reasoning_server, **common)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:]), "the answer follows the reasoning"
    assert sum(bool(d.get("reasoning_content")) for d in deltas) > 1, "reasoning is streamed, not held back"
    held = stream_deltas(reasoning_server, stream_reasoning=False, **common)
    assert [d["reasoning_content"] for d in held if d.get("reasoning_content")] == [whole["reasoning_content"]]
    assert "".join(d.get("content") or "" for d in held) == whole["content"]
    first_held_content = next(i for i, d in enumerate(held) if d.get("content"))
    assert any(d.get("reasoning_content") for d in held[:first_held_content]), "SGLang's stream_reasoning=false"


def test_n_choices_each_think_and_answer(reasoning_server: HttpServer, bias: Any) -> None:
    body = chat(reasoning_server, n=2, temperature=1.0, seed=0, logit_bias=bias(close=10.0), regex=ANSWER)
    messages = [choice["message"] for choice in body["choices"]]
    assert all(m["reasoning_content"] and re.fullmatch(ANSWER, m["content"]) for m in messages)
    assert messages[0]["reasoning_content"] != messages[1]["reasoning_content"]


def test_tool_calls_are_read_from_the_answer_only(reasoning_server: HttpServer, bias: Any) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "is_prime",
            # bounded: the random-weight model, prompted with the tool by its template, writes digits at length
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9999}},
                "required": ["n"],
            },
        },
    }
    body = chat(
        reasoning_server,
        temperature=0.0,
        logit_bias=bias(close=-100.0),
        thinking_token_budget=5,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "is_prime"}},
        max_tokens=96,
    )
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] and body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "is_prime" and isinstance(json.loads(call["function"]["arguments"])["n"], int)


def test_separate_reasoning_off_gives_one_text(reasoning_server: HttpServer, bias: Any) -> None:
    common = {"temperature": 0.0, "logit_bias": bias(close=-100.0), "regex": ANSWER, "thinking_token_budget": 3}
    apart = chat(reasoning_server, **common)["choices"][0]["message"]
    together = chat(reasoning_server, separate_reasoning=False, **common)["choices"][0]["message"]
    assert together.get("reasoning_content") is None
    assert together["content"].endswith(apart["content"]) and apart["reasoning_content"] in together["content"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"thinking_token_budget": 4, "custom_params": {"thinking_budget": 5}}, "thinking_token_budget", "differ"),
        ({"custom_params": {"thinking_budget": -1}}, "custom_params", "integer >= 0"),
        ({"custom_params": {"temperature_schedule": 1}}, "custom_params", "custom logit processor"),
        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "may not set tokenize"),
    ],
)
def test_bad_reasoning_fields_are_refused_by_name(
    reasoning_server: HttpServer, fields: dict[str, Any], param: str, words: str
) -> None:
    response = httpx.post(
        f"{reasoning_server.url}/v1/chat/completions", json={"messages": MESSAGES, **fields}, timeout=600
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_the_qwen_template_names_its_tool_syntax_and_calls_come_in_it(reasoning_server: HttpServer, bias: Any) -> None:
    """The server picks ``qwen25`` from the template's markers (no ``--tool-call-parser``): on the Qwen3.5 tokenizer a
    required call is written ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` after the thinking, and
    reads back as OpenAI's ``tool_calls``; streamed, its deltas add up to the same call."""
    tool = {"type": "function", "function": {"name": "verdict", "parameters": VERDICT}}
    body = {
        "temperature": 0.0,
        "logit_bias": bias(close=-100.0),
        "thinking_token_budget": 5,
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 96,
    }
    whole = chat(reasoning_server, logprobs=True, **body)["choices"][0]
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "verdict" and whole["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), VERDICT)
    written = "".join(token["token"] for token in whole["logprobs"]["content"])
    assert f'<tool_call>\n{{"name": "verdict", "arguments": {call["function"]["arguments"]}}}\n</tool_call>' in written
    deltas = stream_deltas(reasoning_server, **body)
    pieces = [piece for delta in deltas for piece in delta.get("tool_calls") or []]
    header, *arguments = pieces
    assert header["index"] == 0 and header["function"] == {"name": "verdict", "arguments": ""} and header["id"]
    assert "".join(piece["function"]["arguments"] for piece in arguments) == call["function"]["arguments"]


def test_a_qwen3_coder_call_on_the_qwen35_tokenizer(reasoning_server: HttpServer, bias: Any) -> None:
    """The ``qwen3_coder`` constraint on the real Qwen3.5 tokenizer: the model writes a ``<function=...>`` block with a
    raw-text and a JSON parameter, which reads back as a call whose JSON arguments fit the schema."""
    schema = {
        "type": "object",
        "properties": {"prime": {"type": "boolean"}, "why": {"type": "string", "maxLength": 12}},
        "required": ["prime", "why"],
    }
    body = {
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "verdict", "parameters": schema}}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    plan = tool_plan(ChatCompletionRequest.model_validate(body), SYNTAXES["qwen3_coder"])
    assert plan is not None
    params = {**plan.constraint(), "temperature": 0.0, "max_new_tokens": 64, "logit_bias": bias(open=-100.0)}
    result = generate(reasoning_server, sampling_params=params, separate_reasoning=True)
    assert result["text"].startswith("<tool_call>\n<function=verdict>\n<parameter=prime>\n")
    assert result["meta_info"]["finish_reason"]["type"] == "stop"
    content, (call,) = plan.parse(result["text"])
    assert content is None and call["function"]["name"] == "verdict"
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
