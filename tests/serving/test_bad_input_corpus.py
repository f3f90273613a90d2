"""The bad-input corpus: hundreds of requests a server must refuse, over HTTP and over zmq, each with the status
it must get and words its message must contain; the server keeps serving after all of them.

Over HTTP every refusal is a 4xx in OpenAI's error shape; over zmq it is an aborted output whose message says what
is wrong. Nothing here generates a token: each case costs a parse, a compile or a tokenisation at most.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from scheduler.http.generate_conversion import GENERATE_REFUSED_FIELDS
from scheduler.io_struct import GenerateOutput, decode_server_message
from tests.helpers import HTTP_SERVER_FLAGS, QUESTION, HttpServer

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
MAX_SEQ_LEN = int(HTTP_SERVER_FLAGS[HTTP_SERVER_FLAGS.index("--max-seq-len") + 1])
MESSAGES = [dict(m) for m in QUESTION]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@dataclass(frozen=True)
class Case:
    """One bad request: where it goes, what it sends, the status it gets and words its message contains."""

    path: str
    body: dict[str, Any] | bytes
    status: int
    words: tuple[str, ...]


def chat(status: int, *words: str, **fields: Any) -> Case:
    return Case(CHAT, {"messages": MESSAGES, "max_tokens": 4, **fields}, status, words)


def completion(status: int, *words: str, **fields: Any) -> Case:
    return Case(COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, **fields}, status, words)


def generate(status: int, *words: str, **fields: Any) -> Case:
    return Case(GENERATE, {"text": "Hi", **fields}, status, words)


# --- constraints no backend of the server's (auto: xgrammar, then llguidance, then outlines) compiles, with words
# --- their refusal holds: the first backend's whole message (llguidance's for Lark), the others' short reasons ------

INVALID_REGEXES = {
    "(": "parenthesis is not closed",
    ")": "Unmatched ')'",
    "[a-": "Unclosed '['",
    "a{2,1}": "Lower bound is larger than upper bound",
    "*a": "Expect element",
    "abc\\": "Escape sequence is not finished",
    "\\": "Escape sequence is not finished",
    "(?<=a)b": "Lookbehind is not supported",
    "a{,": "Invalid repetition count",
    "[z-a]": "lower bound is larger than upper bound",
    "(?P<n>a)(?P=n)": "Group modifier flag is not supported",
    "a|(": "parenthesis is not closed",
    "[]": "Empty character class",
    "\\k<x>": "Backreference is not supported",
}
INVALID_EBNF = {
    "root ::=": "Expect element",
    'root ::= "a"\nroot ::= "b"': 'Rule "root" is defined multiple times',
    "root ::= (": "Expect element",
    "start": "an ebnf grammar is GBNF with a 'root ::= ...' rule, or Lark with a 'start: ...' rule",
    'x ::= "a"': 'root rule with name "root" is not found',
    'root ::= "a" b': 'Rule "b" is not defined',
    "root ::= [a-": "Unterminated character class",
    'root ::= "a': "in string literal",
    '::= "a"': "Assign should not be the first token",
    "root ::= 'a'": "Unexpected character",
}
INVALID_SCHEMAS: list[tuple[Any, str]] = [
    ({"type": "strin"}, "invalid JSON schema at /type"),
    ({"type": 5}, "invalid JSON schema at /type"),
    ({"properties": 5}, "invalid JSON schema at /properties"),
    ({"required": "a"}, "invalid JSON schema at /required"),
    ({"minLength": -1}, "invalid JSON schema at /minLength"),
    ({"$schema": 5, "type": "string"}, "invalid JSON schema at /$schema"),
    ({"$ref": "#/definitions/missing"}, "Cannot find field definitions"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
    ({"type": "string", "pattern": "("}, "cannot read the pattern"),
    ({"type": "string", "format": "no-such-format"}, "'no-such-format'"),
    ({"enum": []}, "enum array must not be empty"),
    ({"type": "array", "items": 5}, "invalid JSON schema at /items"),
    ({"type": "integer", "minimum": 2**70}, "Integer exceeds maximum limit"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"allOf": 5}, "invalid JSON schema at /allOf"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems is greater than maxItems"),
    ({"type": "object", "additionalProperties": 5}, "invalid JSON schema at /additionalProperties"),
    ({"const": {"a": 1}, "type": "string"}, "sibling 'type' forbids"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
]
INVALID_TAGS: list[tuple[dict[str, Any], str]] = [
    ({"type": "structural_tag"}, "needs 'format'"),
    ({"type": "structural_tag", "format": {"type": "nope"}}, "invalid structural tag at format"),
    ({"type": "structural_tag", "structures": [], "triggers": []}, "triggers must be non-empty"),
    (
        {
            "type": "structural_tag",
            "format": {"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "("}, "end": "</a>"},
        },
        "parenthesis is not closed",
    ),
]
COMPILE = "Failed to compile"
INVALID_CONSTRAINTS: list[tuple[str, Any, str]] = [
    *(("regex", spec, words) for spec, words in INVALID_REGEXES.items()),
    *(("ebnf", spec, words) for spec, words in INVALID_EBNF.items()),
    *(("json_schema", spec, words) for spec, words in INVALID_SCHEMAS),
    *(("structural_tag", spec, words) for spec, words in INVALID_TAGS),
]
"""``(SamplingParams field, spec, words)``: each is refused over chat (in its OpenAI spelling), /generate and zmq."""


def _deep_schema(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _openai_constraint(field: str, spec: Any) -> dict[str, Any]:
    """The request fields that ask for ``spec`` the OpenAI way (json_schema, structural_tag) or SGLang's."""
    if field == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": spec}}}
    if field == "structural_tag":
        return {"response_format": spec}
    return {field: spec}


HTTP_CASES: list[Case] = [
    # the body is not JSON, or not an object
    *(
        Case(path, body, 400, words)
        for path in (CHAT, COMPLETIONS, GENERATE)
        for body, words in (
            (b"", ("not valid JSON",)),
            (b"{", ("not valid JSON",)),
            (b'{"messages": [}', ("not valid JSON",)),
            (b"\xff\xfe", ("not valid JSON",)),
            (b"null", ("expected an object", "null")),
            (b"[1, 2]", ("expected an object", "an array")),
            (b'"text"', ("expected an object", "a string")),
        )
    ),
    # OpenAI's strict types: nothing is coerced
    *(
        make(400, f"Invalid type for '{field}'", expected, **{field: value})
        for make in (chat, completion)
        for field, value, expected in (
            ("stream", "yes", "expected a boolean"),
            ("stream", 1, "expected a boolean"),
            ("max_tokens", "8", "expected an integer"),
            ("max_tokens", 8.5, "expected an integer"),
            ("n", "2", "expected an integer"),
            ("temperature", "hot", "expected a number"),
            ("top_p", "1", "expected a number"),
            ("top_k", "5", "expected an integer"),
            ("seed", "1", "expected an integer"),
            ("stop", 3, "expected a string or an array"),
            ("user", 5, "expected a string"),
            ("model", 5, "expected a string"),
            ("regex", 5, "expected a string"),
            ("ebnf", ["root"], "expected a string"),
            ("guided_choice", "red", "expected an array"),
            ("stream_options", "usage", "expected an object"),
            ("response_format", "json", "expected an object"),
        )
    ),
    chat(400, "Invalid type for 'messages'", "expected an array", messages="Hi"),
    chat(400, "Invalid type for 'messages.0.content'", messages=[{"role": "user", "content": 5}]),
    chat(400, "Invalid type for 'max_completion_tokens'", max_completion_tokens="8"),
    completion(400, "Invalid type for 'prompt'", prompt=5),
    completion(400, "prompt", prompt=["a", 1]),
    # missing, unknown and unsupported parameters
    Case(CHAT, {"model": "x"}, 400, ("Missing required parameter: 'messages'",)),
    Case(COMPLETIONS, {"max_tokens": 4}, 400, ("Missing required parameter: 'prompt'",)),
    *(
        make(400, "Unrecognized request argument supplied", name, **{name: 1})
        for make in (chat, completion)
        for name in ("frobnicate", "max_token", "temprature", "guided_json_schema", "response_format_type")
    ),
    *(
        make(400, name, "not supported", **{name: value})
        for make, fields in (
            (chat, {"functions": [{"name": "f"}], "function_call": "auto", "guided_whitespace_pattern": " *"}),
            (completion, {"echo": True, "suffix": "x", "best_of": 2}),
            (chat, {"return_hidden_states": True}),
            (completion, {"return_hidden_states": True}),
            (generate, dict.fromkeys(GENERATE_REFUSED_FIELDS, True)),
        )
        for name, value in fields.items()
    ),
    chat(
        400,
        "continue_final_message",
        "at least one message before it",
        messages=[{"role": "assistant", "content": "Yes"}],
        continue_final_message=True,
    ),
    chat(400, "Invalid type for 'stream_reasoning'", stream_reasoning="no"),
    generate(400, "Invalid type for 'background'", background=1),
    chat(
        400,
        "messages[0].tool_calls",
        "not supported on a user message",
        messages=[{**MESSAGES[0], "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}]}],
    ),
    chat(
        400,
        "Missing required parameter: 'messages.0.tool_calls.0.function'",
        messages=[{**MESSAGES[0], "tool_calls": [{"id": "1"}]}],
    ),
    chat(400, "messages[1].tool_call_id is required", messages=[*MESSAGES, {"role": "tool", "content": "42"}]),
    # values out of range
    *(
        make(400, field, **{field: value})
        for make in (chat, completion)
        for field, value in (
            ("n", 0),
            ("n", 129),
            ("max_tokens", 0),
            ("max_tokens", -1),
            ("temperature", -1),
            ("top_p", 0),
            ("top_p", 1.5),
            ("top_k", -2),
            ("seed", 2**64),
            ("seed", -(2**63) - 1),
            ("frequency_penalty", 2.5),
            ("presence_penalty", -3),
            ("repetition_penalty", 0),
            ("min_p", 1.5),
            ("min_tokens", -1),
            ("logit_bias", {"1": 101.0}),
            ("logit_bias", {"a": 1.0}),
        )
    ),
    # predicted outputs: OpenAI's shape, text only, no longer than an output can be
    *(
        make(400, *words, prediction=prediction)
        for make in (chat, completion)
        for prediction, words in (
            ("Yes", ("Invalid type for 'prediction'", "expected an object")),
            ({"type": "text", "content": "Yes"}, ("prediction.type", "'content'")),
            ({"type": "content"}, ("Missing required parameter: 'prediction.content'",)),
            (
                {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                ("prediction.content.0.type", "'text'"),
            ),
            ({"type": "content", "content": 7}, ("Invalid type for 'prediction.content'",)),
            ({"type": "content", "content": "x" * 1_000_000}, ("prediction", "bytes", "--max-seq-len")),
            ({"type": "content", "content": "word " * (2 * MAX_SEQ_LEN)}, ("the prediction has", "--max-seq-len")),
        )
    ),
    generate(400, "Invalid type for 'prediction'", prediction={"type": "content", "content": "Yes"}),
    generate(400, "prediction token ids must be in", prediction=[5, -1]),
    chat(400, "Missing required parameter: 'tools.0.function'", tools=[{"type": "function"}]),
    chat(400, "tool_choice needs tools", tool_choice="required"),
    chat(
        400,
        "'g', which is not among the tools",
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ),
    chat(400, "distinct function names", tools=[TOOL, TOOL]),
    chat(400, "form", tools=[TOOL], response_format={"type": "structural_tag", "structures": [], "triggers": []}),
    chat(400, "tools.0.function.name", tools=[{"type": "function", "function": {"name": "a b"}}]),
    chat(400, "top_logprobs", top_logprobs=21, logprobs=True),
    chat(400, "top_logprobs needs logprobs", top_logprobs=2),
    chat(400, "Invalid type for 'logprobs'", logprobs=2),
    completion(400, "logprobs", logprobs=21),
    completion(400, "min_tokens", min_tokens=20, max_tokens=10),
    chat(400, "stop_token_ids and logit_bias must be below", stop_token_ids=[10**7]),
    chat(400, "structured_outputs.whitespace_pattern", structured_outputs={"regex": "a", "whitespace_pattern": " "}),
    generate(400, "custom_params", sampling_params={"custom_params": {"a": 1}}),
    generate(400, "sampling_params.n", sampling_params={"n": 0}),
    generate(400, "logprob_start_len", return_logprob=True, logprob_start_len=0),
    generate(400, "seed and sampling_seed differ", sampling_params={"seed": 1, "sampling_seed": 2}),
    chat(400, "messages", messages=[]),
    chat(400, "messages.0.role", messages=[{"role": "bot", "content": "Hi"}]),
    completion(400, "prompt must not be empty", prompt=[]),
    # the model's name, routes and methods
    chat(404, "does not exist", model="gpt-4"),
    completion(404, "does not exist", model="SmolLM2"),
    generate(404, "does not exist", model="gpt-4"),
    Case("/v1/nothing", {}, 404, ("Not Found",)),
    Case("/v1/embeddings", {"input": "x"}, 404, ("Not Found",)),
    # one constraint at most
    chat(400, "at most one constraint", "regex", "ebnf", regex="a", ebnf='root ::= "a"'),
    chat(400, "at most one constraint", "guided_json", "guided_regex", guided_json={}, guided_regex="a"),
    completion(400, "at most one constraint", "guided_choice", guided_choice=["a"], regex="a"),
    chat(
        400,
        "at most one constraint",
        "structured_outputs.json",
        "structured_outputs.choice",
        structured_outputs={"json": {}, "choice": ["a"]},
    ),
    chat(400, "at most one constraint", response_format={"type": "json_object"}, json_schema={"type": "object"}),
    generate(400, "at most one constraint", sampling_params={"regex": "a", "json_schema": {}}),
    # bounds on one request's work
    completion(400, "prompts x n=128", "at most 128", prompt=["Hi"] * 2, n=128),
    completion(400, "100 prompts x n=2", prompt=["Hi"] * 100, n=2),
    completion(400, "200 prompts x n=1", prompt=["Hi"] * 200),
    Case(GENERATE, {"text": ["Hi"] * 129}, 400, ("129 prompts", "at most 128")),
    completion(400, "maximum context length", "in the completion", max_tokens=MAX_SEQ_LEN),
    chat(400, "maximum context length", max_tokens=10**12),
    # token counts beyond int64: the field the client sent, with its bound
    chat(400, "max_tokens: Input should be less than 9223372036854775808", max_tokens=2**64),
    chat(400, "max_completion_tokens: Input should be less than 9223372036854775808", max_completion_tokens=10**30),
    completion(400, "max_tokens: Input should be less than 9223372036854775808", max_tokens=10**20),
    chat(400, "maximum context length", max_completion_tokens=MAX_SEQ_LEN),
    generate(400, "maximum context length", sampling_params={"max_new_tokens": MAX_SEQ_LEN}),
    completion(400, "maximum context length", prompt=list(range(100, 100 + MAX_SEQ_LEN))),
    completion(400, "the prompt has", "--max-seq-len", prompt="word " * (2 * MAX_SEQ_LEN)),
    completion(400, "bytes", "--max-seq-len", prompt="x" * 1_000_000),
    chat(400, "bytes", "--max-seq-len", messages=[{"role": "user", "content": "x" * 1_000_000}]),
    chat(413, "request body is over", messages=[{"role": "user", "content": "x" * 40_000_000}]),
    generate(400, "bytes", "--max-seq-len", text="x" * 1_000_000),
    *(
        chat(400, "nests objects and arrays", "at most 100 levels", **_openai_constraint("json_schema", schema))
        for schema in (_deep_schema(150), _deep_schema(400))
    ),
    chat(400, "nests objects and arrays too deeply", json_schema='{"a":' * 5000 + "1" + "}" * 5000),
    chat(400, "nests objects and arrays", guided_json=json.dumps(_deep_schema(200))),
    chat(400, "over the limit", "--grammar-max-spec-bytes", regex="a" * (1024 * 1024 + 1)),
    chat(400, "over the limit", "--grammar-max-spec-bytes", guided_json={"enum": ["x" * 1024 * 1024]}),
    # boolean schemas
    *(
        make(400, words, **fields)
        for make in (chat, completion)
        for fields, words in (
            (_openai_constraint("json_schema", True), "send {} for any JSON value"),
            (_openai_constraint("json_schema", False), "allows no value at all"),
            ({"guided_json": True}, "send {} for any JSON value"),
            ({"json_schema": "false"}, "allows no value at all"),
            ({"structured_outputs": {"json": True}}, "send {} for any JSON value"),
            ({"structured_outputs": {"json": False}}, "allows no value at all"),
        )
    ),
    generate(400, "send {} for any JSON value", sampling_params={"json_schema": True}),
    generate(400, "allows no value at all", sampling_params={"json_schema": False}),
    # numbers too large for any engine or the wire
    generate(400, "max_new_tokens must be below 2**63", sampling_params={"max_new_tokens": 2**70}),
    generate(400, "top_k must be below 2**63", sampling_params={"top_k": 2**64}),
    generate(400, "seed", sampling_params={"seed": 2**70}),
    chat(400, "Integer exceeds maximum limit", guided_json={"type": "integer", "minimum": 2**70}),
    # SGLang's /generate
    Case(GENERATE, {"text": "Hi", "input_ids": [1]}, 400, ("exactly one of text or input_ids",)),
    Case(GENERATE, {}, 400, ("exactly one of text or input_ids", "neither")),
    Case(GENERATE, {"input_ids": [10**6]}, 400, ("input_ids must be token ids",)),
    Case(GENERATE, {"input_ids": [-1]}, 400, ("input_ids must be token ids",)),
    Case(GENERATE, {"input_ids": []}, 400, ("empty",)),
    Case(GENERATE, {"text": ""}, 400, ("empty",)),
    Case(GENERATE, {"text": []}, 400, ("batch of prompts is empty",)),
    Case(GENERATE, {"text": ["a", "b"], "rid": ["r1"]}, 400, ("rid has 1 entries for 2 prompts",)),
    Case(GENERATE, {"text": ["a", "b"], "rid": ["r", "r"]}, 400, ("rid", "is running")),
    generate(400, "sampling_params", "frobnicate", sampling_params={"frobnicate": 1}),
    generate(400, "sampling_params", "Expected `int`, got `str`", sampling_params={"max_new_tokens": "8"}),
    generate(400, "sampling_params", "Expected `float`, got `str`", sampling_params={"temperature": "hot"}),
    generate(400, "temperature must be >= 0", sampling_params={"temperature": -1}),
    generate(400, "top_p must be in (0, 1]", sampling_params={"top_p": 0}),
    generate(400, "top_k must be >= 1", sampling_params={"top_k": 0}),
    generate(400, "max_new_tokens must be >= 1", sampling_params={"max_new_tokens": 0}),
    generate(400, "stop strings must be non-empty", sampling_params={"stop": [""]}),
    generate(400, "sampling_params", "Expected `array | null`, got `str`", sampling_params={"choice": "red"}),
    # constraints that cannot compile: over chat (OpenAI's spelling) and /generate
    *(chat(400, COMPILE, words, **_openai_constraint(field, spec)) for field, spec, words in INVALID_CONSTRAINTS),
    *(generate(400, COMPILE, words, sampling_params={field: spec}) for field, spec, words in INVALID_CONSTRAINTS),
    chat(400, "a choice constraint must be a non-empty list", guided_choice=[]),
    chat(400, COMPILE, "cannot read the pattern", structured_outputs={"json": {"type": "string", "pattern": "[a"}}),
    completion(400, COMPILE, "parenthesis is not closed", regex="(ab"),
    completion(400, COMPILE, "is not valid JSON", json_schema="{not json"),
    chat(400, COMPILE, "is not valid JSON", structured_outputs={"structural_tag": "{not json"}),
]


@dataclass(frozen=True)
class ZmqCase:
    """A message to the scheduler's socket (``make_request`` arguments, or raw msgpack) and its abort's words."""

    request: dict[str, Any] | bytes
    words: tuple[str, ...]


def zmq(*words: str, **request: Any) -> ZmqCase:
    return ZmqCase({"text": "Hi", **request}, words)


def raw(message: dict[str, Any], *words: str) -> ZmqCase:
    return ZmqCase(msgspec.msgpack.encode({"type": "generate", "rid": "raw", **message}), words)


ZMQ_CASES: list[ZmqCase] = [
    *(zmq(COMPILE, words, sampling_params={field: spec}) for field, spec, words in INVALID_CONSTRAINTS),
    zmq("nests objects and arrays", "151 levels deep", sampling_params={"json_schema": _deep_schema(150)}),
    zmq("too deeply", sampling_params={"json_schema": '{"a":' * 5000 + "1" + "}" * 5000}),
    zmq("over the limit", sampling_params={"regex": "a" * (1024 * 1024 + 1)}),
    zmq("temperature must be >= 0", sampling_params={"temperature": -0.5}),
    zmq("top_p must be in (0, 1]", sampling_params={"top_p": 2.0}),
    zmq("top_k must be >= 1", sampling_params={"top_k": -3}),
    zmq("max_new_tokens must be >= 1", sampling_params={"max_new_tokens": -1}),
    zmq("below 2**63", sampling_params={"max_new_tokens": 2**63}),
    zmq("stop strings must be non-empty", sampling_params={"stop": ["a", ""]}),
    zmq("top_logprobs_num must be in [0, 20]", top_logprobs_num=21),
    zmq("must be below", sampling_params={"stop_token_ids": [10**7]}),
    zmq("must be below", sampling_params={"logit_bias": {"10000000": 1.0}}),
    zmq("repetition_penalty must be in (0, 2]", sampling_params={"repetition_penalty": 0.0}),
    zmq("min_new_tokens must be in [0, max_new_tokens]", sampling_params={"min_new_tokens": 9, "max_new_tokens": 8}),
    zmq("min_p must be in [0, 1]", sampling_params={"min_p": -0.1}),
    zmq("at most one constraint", sampling_params={"regex": "a", "ebnf": 'root ::= "a"'}),
    zmq("at most one constraint", sampling_params={"choice": ["a"], "json_object": True}),
    ZmqCase({"sampling_params": {}}, ("exactly one of text, messages or input_ids",)),
    ZmqCase({"text": "Hi", "input_ids": [1]}, ("exactly one of text, messages or input_ids",)),
    ZmqCase({"input_ids": [10**6]}, ("input_ids must be token ids",)),
    ZmqCase({"input_ids": [5, -1]}, ("input_ids must be token ids",)),
    ZmqCase({"input_ids": []}, ("empty",)),
    ZmqCase({"text": ""}, ("empty",)),
    ZmqCase({"messages": []}, ("messages is empty",)),
    ZmqCase({"input_ids": [100] * (MAX_SEQ_LEN + 10)}, ("--max-seq-len",)),
    ZmqCase({"text": "x" * 1_000_000}, ("bytes", "--max-seq-len")),
    ZmqCase({"messages": [{"role": "user", "content": "x" * 1_000_000}]}, ("bytes", "--max-seq-len")),
    ZmqCase({"text": "Hi", "prediction": [10**7]}, ("prediction token ids must be in",)),
    ZmqCase({"text": "Hi", "prediction": "x" * 1_000_000}, ("prediction", "bytes", "--max-seq-len")),
    raw({"text": "Hi", "prediction": {"type": "content"}}, "malformed request", "prediction"),
    raw({"text": 5}, "malformed request", "Expected `str | null`, got `int`"),
    raw({"text": "Hi", "stream": "yes"}, "malformed request", "Expected `bool`"),
    raw({"text": "Hi", "frobnicate": 1}, "malformed request", "unknown field `frobnicate`"),
    raw({"text": "Hi", "sampling_params": {"max_new_tokens": "8"}}, "malformed request", "Expected `int`"),
    raw({"text": "Hi", "sampling_params": {"json_schema": True}}, "malformed request", "json_schema"),
    raw({"text": "Hi", "sampling_params": {"frob": 1}}, "malformed request", "unknown field `frob`"),
    raw({"input_ids": ["a"]}, "malformed request", "Expected `int`"),
    raw({"messages": [{"role": "user"}]}, "malformed request", "missing required field `content`"),
]


def _http_id(case: Case) -> str:
    body = case.body if isinstance(case.body, bytes) else json.dumps(case.body)[:60].encode()
    return f"{case.path}:{body[:60]!r}"


@pytest.mark.model
@pytest.mark.parametrize("case", HTTP_CASES, ids=_http_id)
def test_http_refuses_with_a_clear_4xx(server: HttpServer, case: Case) -> None:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    response = server.http.post(case.path, content=content)
    assert response.status_code == case.status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    assert all(word in error["message"] for word in case.words), (case.words, error["message"][:500])


@pytest.mark.model
@pytest.mark.parametrize("case", ZMQ_CASES, ids=lambda case: repr(case.request)[:70])
def test_zmq_aborts_with_the_reason(server: HttpServer, case: ZmqCase) -> None:
    with server.client(timeout_s=120) as client:
        if isinstance(case.request, bytes):
            client.socket.send(case.request)
            while not client.socket.poll(120_000):
                pytest.fail("no answer from the scheduler")
            output = decode_server_message(client.socket.recv())
        else:
            output = client.generate(**case.request)
    assert isinstance(output, GenerateOutput) and output.finished, output
    assert output.finish_reason is not None and output.finish_reason.type == "abort", output
    message = output.finish_reason.message or ""
    assert all(word in message for word in case.words), (case.words, message[:500])


def test_the_corpus_holds_over_300_cases() -> None:
    assert len(HTTP_CASES) + len(ZMQ_CASES) >= 300, (len(HTTP_CASES), len(ZMQ_CASES))


@pytest.mark.model
def test_the_server_serves_after_the_corpus(server: HttpServer) -> None:
    """Runs after the corpus (pytest keeps a module's order): a plain request still succeeds."""
    response = server.http.post(CHAT, json={"messages": MESSAGES, "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert server.health()["running_requests"] == 0
