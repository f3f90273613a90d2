"""SGLang's own router (``sglang-router``, the ``router`` extra) in front of two real servers: the package's HTTP
server and one more. The router re-serialises every request with the fields of its own request types (0.3.2 adds
``continue_final_message``, ``separate_reasoning``, ``return_hidden_states``, ... to chat; ``model: null``,
``background``, ``return_entropy``, ... to ``/generate``; ``echo``, ``no_stop_trim``, ... to completions); each is
taken with SGLang's meaning, and a constraint of every kind the router forwards holds on the three endpoints, streamed
and not. What the router itself drops (chat's ``structural_tag``, ``guided_*`` and ``structured_outputs``;
``/generate``'s ``structural_tag``, ``choice`` and ``json_object``) never reaches a worker: README, "Behind SGLang's
router". Last, the one command (``--dp-size 2 --router sglang``): its replicas share the grammar disk cache, and one
dies under load. Skipped where the ``router`` extra is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import pytest

from scheduler.http.generate_conversion import GENERATE_REFUSED_FIELDS
from scheduler.testing.router import ReplicaSet, RouterProcess, num_generations, router_installed, server_metric
from sglang_constrained.cache.disk import ENTRY_SUFFIX
from tests.helpers import (
    ANSWER_TAG,
    COLD_GRAMMARS,
    COLORS,
    FEW_SHOT_JSON,
    HTTP_SERVER_FLAGS,
    JSON_SCHEMA_FORMAT,
    MODEL,
    PHONE_REGEX,
    QUESTION,
    YES_NO_EBNF,
    YES_NO_EBNF_LANGUAGE,
    YES_NO_SCHEMA,
    HttpServer,
    http_server,
    is_color,
    is_json_object,
    is_yes_no_json,
    matches,
    serving,
)

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not router_installed(), reason='the router extra is not installed: pip install -e ".[router]"'),
    pytest.mark.launches(http=True),
]

CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/generate"
ASK = "Q: Is the sky blue?\nA:"
FEW_SHOT_TEXT = 'JSON: {"a": 1}\nJSON: {"b": 2}\nJSON:'
SCHEMA_TEXT = json.dumps(YES_NO_SCHEMA)
IS_PHONE = matches(PHONE_REGEX)
IS_YES_NO_PAIR = matches(YES_NO_EBNF_LANGUAGE)
IS_ANSWER_TAG = matches(r"<answer>(yes|no)</answer>")


@dataclass(frozen=True)
class Case:
    """A constrained request through the router: its endpoint, its body's constraint fields and the output check."""

    id: str
    path: str
    fields: dict[str, Any]
    check: Callable[[str], None]
    few_shot_json: bool = False

    def body(self, stream: bool) -> dict[str, Any]:
        if self.path == GENERATE:
            text = FEW_SHOT_TEXT if self.few_shot_json else ASK
            params = {"temperature": 0, "max_new_tokens": 40, **self.fields}
            return {"text": text, "sampling_params": params, "stream": stream}
        common = {"model": MODEL, "temperature": 0, "max_tokens": 40, "stream": stream, **self.fields}
        if self.path == CHAT:
            return {"messages": FEW_SHOT_JSON if self.few_shot_json else QUESTION, **common}
        return {"prompt": FEW_SHOT_TEXT if self.few_shot_json else ASK, **common}


JSON_OBJECT = {"response_format": {"type": "json_object"}}
CASES = [
    # chat: the router keeps response_format (json_schema, json_object), SGLang's regex and ebnf
    Case("chat.json_schema", CHAT, {"response_format": JSON_SCHEMA_FORMAT}, is_yes_no_json),
    Case("chat.json_object", CHAT, JSON_OBJECT, is_json_object, few_shot_json=True),
    Case("chat.regex", CHAT, {"regex": PHONE_REGEX}, IS_PHONE),
    Case("chat.ebnf", CHAT, {"ebnf": YES_NO_EBNF}, IS_YES_NO_PAIR),
    # completions: the router forwards fields it does not know as they are, so every kind gets through
    Case("completions.json_schema", COMPLETIONS, {"json_schema": SCHEMA_TEXT}, is_yes_no_json),
    Case("completions.json_object", COMPLETIONS, JSON_OBJECT, is_json_object, few_shot_json=True),
    Case("completions.regex", COMPLETIONS, {"regex": PHONE_REGEX}, IS_PHONE),
    Case("completions.ebnf", COMPLETIONS, {"ebnf": YES_NO_EBNF}, IS_YES_NO_PAIR),
    Case("completions.structural_tag", COMPLETIONS, {"response_format": ANSWER_TAG}, IS_ANSWER_TAG),
    Case("completions.choice", COMPLETIONS, {"guided_choice": COLORS}, is_color),
    # /generate: the router's sampling_params keep json_schema, regex and ebnf
    Case("generate.json_schema", GENERATE, {"json_schema": SCHEMA_TEXT}, is_yes_no_json),
    Case("generate.regex", GENERATE, {"regex": PHONE_REGEX}, IS_PHONE),
    Case("generate.ebnf", GENERATE, {"ebnf": YES_NO_EBNF}, IS_YES_NO_PAIR),
]
RUNS = [(case, stream) for case in CASES for stream in (False, True)]


@pytest.fixture(scope="module")
def router(server: HttpServer) -> Iterator[RouterProcess]:
    """The router, cache-aware, in front of the package's server and a second one."""
    second = http_server()
    with serving(second):
        router = RouterProcess([server.url, second.url], "cache_aware")
        try:
            router.wait_until_ready()
            yield router
        finally:
            router.stop()
            router.log_path.unlink(missing_ok=True)


async def post(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """``(text, finish reason)`` of one request, a streamed one's text joined from its events."""
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return final_text(path, response.json())
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1]
    return streamed_text(path, [json.loads(event) for event in events[:-1]])


def final_text(path: str, body: dict[str, Any]) -> tuple[str, str]:
    if path == GENERATE:
        return body["text"], body["meta_info"]["finish_reason"]["type"]
    choice = body["choices"][0]
    return (choice["message"]["content"] if path == CHAT else choice["text"]), choice["finish_reason"]


def streamed_text(path: str, events: list[dict[str, Any]]) -> tuple[str, str]:
    if path == GENERATE:  # SGLang streams the text so far
        return events[-1]["text"], events[-1]["meta_info"]["finish_reason"]["type"]
    choices = [choice for event in events for choice in event["choices"]]
    parts = [(choice["delta"].get("content") if path == CHAT else choice["text"]) or "" for choice in choices]
    finish = [choice["finish_reason"] for choice in choices if choice["finish_reason"] is not None]
    return "".join(parts), finish[-1]


@pytest.fixture(scope="module")
def outcomes(router: RouterProcess) -> dict[tuple[str, bool], Any]:
    """Every run's ``(text, finish reason)`` or the exception it raised, all sent through the router at once."""

    async def run_all() -> list[Any]:
        async with httpx.AsyncClient(base_url=router.url, timeout=600) as http:
            runs = (post(http, case.path, case.body(stream)) for case, stream in RUNS)
            return await asyncio.gather(*runs, return_exceptions=True)

    return {(case.id, stream): result for (case, stream), result in zip(RUNS, asyncio.run(run_all()), strict=True)}


@pytest.mark.parametrize(("case", "stream"), RUNS, ids=[f"{c.id}{'.stream' if s else ''}" for c, s in RUNS])
def test_constraints_hold_through_the_router(outcomes: dict[tuple[str, bool], Any], case: Case, stream: bool) -> None:
    result = outcomes[case.id, stream]
    if isinstance(result, BaseException):
        raise result
    text, finish_reason = result
    assert finish_reason == "stop", (text, finish_reason)
    case.check(text)


def test_both_workers_served(router: RouterProcess, outcomes: dict[tuple[str, bool], Any]) -> None:
    """The router spread the runs over both servers (each answered some: their frontends' request counters)."""
    served = [num_generations(url) for url in router.worker_urls]
    assert all(count > 0 for count in served), served


def test_continue_final_message_continues_the_assistant_text(router: RouterProcess, server: HttpServer) -> None:
    """SGLang's way: the messages before the final assistant message through the chat template with the generation
    prompt, then its text tokenised without special tokens; the answer is what follows it."""
    prefix = '{"answer": "'
    messages = [*QUESTION, {"role": "assistant", "content": prefix}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "continue_final_message": True}
    body |= {"regex": '(yes|no)"}', "temperature": 0}
    response = httpx.post(f"{router.url}{CHAT}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["message"]["content"] in ('yes"}', 'no"}')
    template = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}, timeout=60).json()
    text = httpx.post(f"{server.url}/tokenize", json={"prompt": prefix, "add_special_tokens": False}, timeout=60).json()
    assert answer["usage"]["prompt_tokens"] == template["count"] + text["count"]


def test_sglang_fields_are_honoured_through_the_router(router: RouterProcess) -> None:
    """``ignore_eos``, ``no_stop_trim`` and ``skip_special_tokens`` as the router forwards them (set by the client)."""
    eos = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "ignore_eos": True, "logit_bias": {"2": 100}}
    answer = httpx.post(f"{router.url}{COMPLETIONS}", json=eos, timeout=600).json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 6, answer
    stop = {"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0, "stop": [","]}
    for no_stop_trim in (False, True):
        answer = httpx.post(f"{router.url}{COMPLETIONS}", json=stop | {"no_stop_trim": no_stop_trim}, timeout=600)
        text = answer.json()["choices"][0]["text"]
        assert text.endswith(",") == no_stop_trim, text
    kept = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "logit_bias": {"2": 100}, "ignore_eos": True}
    for skip in (True, False):
        answer = httpx.post(f"{router.url}{COMPLETIONS}", json=kept | {"skip_special_tokens": skip}, timeout=600)
        assert answer.json()["choices"][0]["text"] == ("" if skip else "<|im_end|>"), answer.text


REFUSED = [
    (CHAT, {"model": MODEL, "messages": QUESTION, "return_hidden_states": True}, "return_hidden_states"),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "return_hidden_states": True}, "return_hidden_states"),
    (COMPLETIONS, {"model": MODEL, "prompt": "Hi", "echo": True}, "echo"),
    *((GENERATE, {"text": "Hi", name: True}, name) for name in GENERATE_REFUSED_FIELDS),
]


@pytest.mark.parametrize(("path", "body", "name"), REFUSED, ids=[f"{p}:{n}" for p, _, n in REFUSED])
def test_what_is_not_built_is_refused_by_name(
    router: RouterProcess, path: str, body: dict[str, Any], name: str
) -> None:
    """The worker's 400 comes back through the router as it was sent: OpenAI's error shape, the field named."""
    response = httpx.post(f"{router.url}{path}", json=body, timeout=600)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter" and name in error["message"], error


def test_replicas_behind_the_router_outlive_each_other(tmp_path: Path) -> None:
    """``python -m scheduler.launch --dp-size 2 --router sglang``: two independent servers and the router in one
    command. They share one grammar disk cache: a schema compiled on one (by the default backend) is read from it by
    the other. One replica
    killed under load: every request in flight and every one after it is answered (the router retries what the dead
    one held on the live one), the launcher restarts it on its port (it too reads the schema from the disk cache)
    and the router counts it healthy again; SIGTERM stops them all. (Its own launch, not one started ahead: the
    launcher's replicas and router are what is tested.)"""
    flags = [flag for flag in HTTP_SERVER_FLAGS if flag not in COLD_GRAMMARS]
    replicas = ReplicaSet(2, *flags, "--grammar-cache-dir", str(tmp_path), policy="round_robin")
    try:
        replicas.wait_for_workers(healthy=2)
        first, second = replicas.current(0), replicas.current(1)
        schema = new_yes_no_schema()
        answer = ask_schema(second.url, schema)
        wait_for_entry(tmp_path)
        assert ask_schema(first.url, schema) == answer
        assert [disk_cache_loads(first.url), disk_cache_loads(second.url)] == [1, 0]

        async def load() -> tuple[list[int], list[int]]:
            async with httpx.AsyncClient(base_url=replicas.url, timeout=600) as http:

                async def tokens(i: int) -> int:
                    body = {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 24, "ignore_eos": True}
                    response = await http.post(COMPLETIONS, json=body)
                    assert response.status_code == 200, response.text
                    return int(response.json()["usage"]["completion_tokens"])

                in_flight = [asyncio.create_task(tokens(i)) for i in range(8)]
                await asyncio.sleep(0.5)
                os.kill(first.pid, signal.SIGKILL)
                during = await asyncio.gather(*in_flight)
                return during, list(await asyncio.gather(*(tokens(i) for i in range(8, 12))))

        during, after = asyncio.run(load())
        assert during == [24] * 8 and after == [24] * 4
        restarted = replicas.wait_for_restart(0, first.pid)
        assert ask_schema(restarted.url, schema) == answer and disk_cache_loads(restarted.url) == 1
        replicas.wait_for_workers(healthy=2)
        served, deadline = num_generations(restarted.url), time.monotonic() + 60
        while num_generations(restarted.url) == served:  # round robin: the rejoined replica gets its turns again
            assert time.monotonic() < deadline, replicas.log()[-3000:]
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            assert httpx.post(f"{replicas.url}{COMPLETIONS}", json=body, timeout=600).status_code == 200
        assert replicas.stop() == 0, replicas.log()[-3000:]
        assert not psutil.pid_exists(second.pid) or psutil.Process(second.pid).status() == "zombie"
    finally:
        if replicas.process.poll() is None:  # the test failed: its replicas and router go with it
            replicas.kill()
        replicas.log_path.unlink(missing_ok=True)


def new_yes_no_schema() -> dict[str, Any]:
    """``YES_NO_SCHEMA`` under a property name of its own: no cache, in memory or on disk, has its grammar."""
    name = f"answer_{uuid.uuid4().hex[:8]}"
    return {**YES_NO_SCHEMA, "properties": {name: YES_NO_SCHEMA["properties"]["answer"]}, "required": [name]}


def ask_schema(server_url: str, schema: dict[str, Any]) -> str:
    """A greedy chat answer constrained by ``schema``, straight from one server; checked against it."""
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 24,
        "temperature": 0,
        "response_format": response_format,
    }
    response = httpx.post(f"{server_url}{CHAT}", json=body, timeout=600)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    return str(text)


def wait_for_entry(cache_dir: Path, timeout_s: float = 60.0) -> None:
    """Until the grammar disk cache in ``cache_dir`` holds an entry (a compile's entry is written in the
    background, after its request has the grammar)."""
    deadline = time.monotonic() + timeout_s
    while not list(cache_dir.glob(f"*{ENTRY_SUFFIX}")):
        assert time.monotonic() < deadline, f"no grammar was written to {cache_dir}"
        time.sleep(0.1)


def disk_cache_loads(server_url: str) -> float:
    """Grammars a server read from the grammar disk cache rather than compiled."""
    return server_metric(server_url, "sglang:grammar_disk_cache_loads_total")
