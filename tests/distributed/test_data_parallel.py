"""Two data-parallel replicas under torchrun (``--dp-size 2``, real torch.distributed over gloo): each runs its own
batches, behind rank 0's sockets, with every grammar compiled once for both.

A replica is a whole model and the forward is batch-invariant, so every request's tokens are those one rank makes.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from scheduler.client import make_request
from scheduler.io_struct import GenerateOutput, GenerateReq, Pong
from scheduler.testing.process import SchedulerProcess, loopback_http, wait_until_healthy
from tests.helpers import (
    ANSWER_TAG,
    FEW_SHOT_JSON,
    FREE_PORT,
    JSON_SCHEMA_FORMAT,
    MODEL,
    QUESTION,
    YES_NO_EBNF,
    YES_NO_EBNF_LANGUAGE,
    flag_value,
    flush_prefix_cache,
    is_yes_no_json,
    launch_scheduler,
)

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CLOSED_PERSON_SCHEMA = {**PERSON_SCHEMA, "additionalProperties": False}
"""llguidance lets an open schema's output add properties (and run out of tokens); xgrammar is strict by default."""
PHONE_REGEX = r"\(\d{3}\) \d{3}-\d{4}"
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}
DP_FLAGS = ("--dp-size", "2")
WITH_HTTP = ("--port", FREE_PORT)
pytestmark = [pytest.mark.model, pytest.mark.multirank, pytest.mark.launches(*DP_FLAGS, *WITH_HTTP, ranks=2)]
LONG = {
    "text": "Once upon a time, there was a dragon who",
    "sampling_params": {"max_new_tokens": 400, "temperature": 0},
}


def mixed_requests() -> list[GenerateReq]:
    """One request of every constraint kind, greedy, and one seeded sample."""
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    question = [{"role": "user", "content": str(QUESTION[0]["content"])}]
    few_shot = [{"role": str(m["role"]), "content": str(m["content"])} for m in FEW_SHOT_JSON]
    greedy: dict[str, Any] = {"temperature": 0, "max_new_tokens": 48}
    return [
        make_request(rid="free", text="The best things about summer are", sampling_params={**greedy}),
        make_request(rid="json", messages=ask, sampling_params={**greedy, "json_schema": PERSON_SCHEMA}),
        make_request(rid="regex", text="Call me at", sampling_params={**greedy, "regex": PHONE_REGEX}),
        make_request(rid="choice", text="Pick one:", sampling_params={**greedy, "choice": ["yes", "no", "maybe"]}),
        make_request(rid="ebnf", messages=question, sampling_params={**greedy, "ebnf": YES_NO_EBNF}),
        make_request(rid="tag", messages=question, sampling_params={**greedy, "structural_tag": ANSWER_TAG}),
        make_request(rid="object", messages=few_shot, sampling_params={**greedy, "json_object": True}),
        make_request(rid="seeded", messages=ask, sampling_params={"json_schema": PERSON_SCHEMA, "seed": 7}),
    ]


def check_valid(outputs: list[GenerateOutput]) -> None:
    by_rid = {o.rid: o for o in outputs}
    assert all(o.finish_reason is not None and o.finish_reason.type != "abort" for o in outputs), outputs
    assert by_rid["free"].text.strip()
    jsonschema.validate(json.loads(by_rid["json"].text), PERSON_SCHEMA)
    jsonschema.validate(json.loads(by_rid["seeded"].text), PERSON_SCHEMA)
    assert re.fullmatch(PHONE_REGEX, by_rid["regex"].text)
    assert by_rid["choice"].text in ("yes", "no", "maybe")
    assert re.fullmatch(YES_NO_EBNF_LANGUAGE, by_rid["ebnf"].text)
    assert re.fullmatch(r"<answer>(yes|no)</answer>", by_rid["tag"].text)
    assert isinstance(json.loads(by_rid["object"].text), dict)


def finished_per_replica(process: SchedulerProcess) -> list[int]:
    pong = process.status()
    assert [r.rank for r in pong.replicas] == [0, 1]
    return [r.num_finished_requests for r in pong.replicas]


def metric(pong: Pong, name: str) -> float:
    found = re.search(rf'^{re.escape(name)}{{constraint="json"}} ([\d.e+]+)$', pong.metrics_text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def shared_compiles(process: SchedulerProcess) -> tuple[float, float]:
    """Compiles rank 0 ran for both replicas, and the distinct JSON constraints among them."""
    pong = process.status()
    return metric(pong, "sglang:grammar_shared_compiles_total"), metric(pong, "sglang:grammar_shared_constraints_total")


@pytest.fixture(scope="module")
def replicas() -> Iterator[SchedulerProcess]:
    """Two replicas with the default backend (xgrammar) and the HTTP frontend."""
    with launch_scheduler(*DP_FLAGS, *WITH_HTTP, ranks=2) as launched:
        yield launched


@pytest.fixture(scope="module")
def http_port(replicas: SchedulerProcess) -> int:
    return int(flag_value(replicas, "--port"))


def test_replicas_give_one_ranks_outputs_and_both_serve(
    replicas: SchedulerProcess, one_rank_server: SchedulerProcess
) -> None:
    before = finished_per_replica(replicas)
    with replicas.client() as client:
        two = client.generate_batch(mixed_requests())
    flush_prefix_cache(one_rank_server)
    with one_rank_server.client() as client:
        one = client.generate_batch(mixed_requests())
    served = [after - earlier for after, earlier in zip(finished_per_replica(replicas), before, strict=True)]
    assert sum(served) == len(two) and min(served) >= 3, f"requests per replica: {served}"
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert [o.text for o in two] == [o.text for o in one]
    check_valid(two)


def test_a_schema_sent_to_both_replicas_is_compiled_once(replicas: SchedulerProcess) -> None:
    schema = {**PERSON_SCHEMA, "title": "compiled once"}
    before_compiles, before_constraints = shared_compiles(replicas)
    before = finished_per_replica(replicas)
    asks = ["Describe a baker as JSON.", "Describe a sailor as JSON.", "Describe a painter as JSON."]
    params = {"json_schema": schema, "temperature": 0, "max_new_tokens": 48}
    requests = [
        make_request(messages=[{"role": "user", "content": ask}], sampling_params=params)
        for ask in [*asks, "Describe a runner as JSON."]
    ]
    with replicas.client() as client:
        first = client.generate_batch(requests)
        again = client.generate_batch(requests[:2])
    after = finished_per_replica(replicas)
    assert [a - b for a, b in zip(after, before, strict=True)] == [3, 3], "the router alternates between idle replicas"
    compiles, constraints = shared_compiles(replicas)
    assert (compiles - before_compiles, constraints - before_constraints) == (1, 1)
    for output in [*first, *again]:
        assert output.finish_reason is not None and output.finish_reason.type != "abort"
        if output.finish_reason.type == "stop":
            jsonschema.validate(json.loads(output.text), schema)
    assert [o.grammar_cache_hit for o in again] == [True, True], "cached on both replicas from the one compile"


def test_a_bad_schema_fails_alone_with_one_ranks_message(
    replicas: SchedulerProcess, one_rank_server: SchedulerProcess
) -> None:
    good = {"sampling_params": {"json_schema": PERSON_SCHEMA, "max_new_tokens": 48}}
    requests = [
        make_request(text="JSON:", sampling_params={"json_schema": BAD_SCHEMA}),
        *(make_request(text=f"Person {i} as JSON:", **good) for i in range(3)),
    ]
    with replicas.client() as client:
        bad, *served = client.generate_batch(requests)
        repeated = client.generate_batch(
            [make_request(text="JSON:", sampling_params={"json_schema": BAD_SCHEMA}) for _ in range(2)]
        )
    with one_rank_server.client() as client:
        expected = client.generate(text="JSON:", sampling_params={"json_schema": BAD_SCHEMA})
    assert expected.finish_reason is not None and expected.finish_reason.type == "abort"
    for failed in (bad, *repeated):
        assert failed.finish_reason == expected.finish_reason
    assert [o.grammar_cache_hit for o in repeated] == [True, True], "the compile error is cached on both replicas"
    for output in served:
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)


def test_an_abort_reaches_the_replica_holding_the_request(replicas: SchedulerProcess) -> None:
    with replicas.client() as first, replicas.client() as second:
        on_rank_0 = first.generate_stream(rid="dp-long-0", **LONG)
        next(on_rank_0)
        on_rank_1 = second.generate_stream(rid="dp-long-1", **LONG)
        next(on_rank_1)
        second.abort("dp-long-1")
        final = list(on_rank_1)[-1]
        first.abort("dp-long-0")
        list(on_rank_0)
    assert final.finish_reason is not None and final.finish_reason.type == "abort"
    log = replicas.log()
    assert "[rank 1] scheduler.scheduler: request dp-long-1 aborted by the client" in log
    assert "[rank 0] scheduler.scheduler: request dp-long-0 aborted by the client" in log
    assert "[rank 0] scheduler.scheduler: request dp-long-1 aborted" not in log
    assert replicas.status().num_running_requests == 0


def test_the_http_frontend_serves_through_the_replicas(replicas: SchedulerProcess, http_port: int) -> None:
    url = f"http://127.0.0.1:{http_port}"
    wait_until_healthy(url, replicas.process, replicas.log, timeout_s=120)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    completions = [
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, temperature=0, max_tokens=40, response_format=JSON_SCHEMA_FORMAT
        )
        for _ in range(2)
    ]
    for completion in completions:
        is_yes_no_json(str(completion.choices[0].message.content))
    assert "sglang:grammar_shared_compiles_total" in loopback_http().get(f"{url}/metrics", timeout=30).text


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=pytest.mark.launches(*DP_FLAGS, "--grammar-backend", name, ranks=2))
        for name in ("llguidance", "outlines")
    ],
)
def test_every_grammar_backend_shares_its_grammars(backend: str) -> None:
    with launch_scheduler(*DP_FLAGS, "--grammar-backend", backend, ranks=2) as launched:
        params = {"json_schema": CLOSED_PERSON_SCHEMA, "temperature": 0, "max_new_tokens": 48}
        asks = ["Describe a baker as JSON.", "Describe a sailor as JSON."]
        requests = [make_request(messages=[{"role": "user", "content": ask}], sampling_params=params) for ask in asks]
        with launched.client() as client:
            outputs = client.generate_batch(requests)
        assert finished_per_replica(launched) == [1, 1]
        assert shared_compiles(launched) == (1, 1)
    for output in outputs:
        jsonschema.validate(json.loads(output.text), CLOSED_PERSON_SCHEMA)


@pytest.mark.launches(*DP_FLAGS, "--grammar-backend", "none", ranks=2)
def test_a_dead_replica_stops_the_group_and_its_clients_get_aborts() -> None:
    """Without a grammar backend: constrained requests are refused, free ones served; then rank 1 is killed while
    it runs a request."""
    with launch_scheduler(*DP_FLAGS, "--grammar-backend", "none", ranks=2, check_clean_stop=False) as launched:
        with launched.client() as client:
            refused, free = client.generate_batch(
                [
                    make_request(text="JSON:", sampling_params={"json_schema": PERSON_SCHEMA}),
                    make_request(text="Hello", sampling_params={"max_new_tokens": 4}),
                ]
            )
        assert refused.finish_reason is not None and "--grammar-backend none" in str(refused.finish_reason.message)
        assert free.finish_reason is not None and free.finish_reason.type == "length"
        with launched.client(timeout_s=60) as first, launched.client(timeout_s=60) as second:
            on_rank_0 = first.generate_stream(rid="held-by-0", **LONG)
            next(on_rank_0)
            on_rank_1 = second.generate_stream(rid="held-by-1", **LONG)
            next(on_rank_1)
            os.kill(launched.rank_pids()[1], signal.SIGKILL)
            finals = [list(on_rank_0)[-1], list(on_rank_1)[-1]]
        exit_code = launched.process.wait(timeout=60)
        log = launched.log()
    assert [f.finish_reason.type if f.finish_reason else None for f in finals] == ["abort", "abort"]
    assert exit_code != 0
    assert "[rank 0] scheduler.launch: rank 0: a peer rank stopped answering" in log
