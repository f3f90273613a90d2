"""The llama.cpp model runner (``--model-runner llamacpp``, the ``llamacpp`` extra): one request at a time it gives
llama-cpp-python's own greedy tokens; a rollback drops the cells it rolled back; constrained requests through the
loop validate and come out the same alone and batched with others; every sequence id and KV row comes back; the
launcher serves on it. Skipped where llama-cpp-python is
not installed (the default install, and CI: it builds llama.cpp from source)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from scheduler.client import make_request
from scheduler.scheduler import Scheduler
from scheduler.server_args import ModelArgs, ServerArgs
from sglang_constrained.tokenizer.loading import embedded_model_path
from tests.helpers import launch_scheduler
from tests.serving.test_speculative import CONSTRAINTS, PERSON, serve

llama_cpp = pytest.importorskip("llama_cpp")
from scheduler.model.llamacpp_runner import LlamaCppModelRunner  # noqa: E402  (needs llama_cpp)

pytestmark = pytest.mark.model

SETTINGS: dict[str, Any] = {"model_runner": "llamacpp", "max_running_requests": 3, "max_seq_len": 640}
PROMPTS = ["The three best things about summer are", "Count from one to twenty: one, two, three,"]


@pytest.fixture(scope="module")
def runner() -> LlamaCppModelRunner:
    return LlamaCppModelRunner(ModelArgs(**SETTINGS, max_total_tokens=4096))


def greedy(runner: LlamaCppModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    seq = runner.kv.admit(prompt_ids, num_tokens)
    assert seq is not None
    logits = runner.prefill([seq], [prompt_ids])
    tokens: list[int] = []
    for _ in range(num_tokens):
        tokens.append(int(logits[0].argmax()))
        logits = runner.decode([seq], tokens[-1:])
    runner.kv.release(seq)
    return tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_one_request_at_a_time_gives_llama_cpp_pythons_own_greedy_tokens(
    runner: LlamaCppModelRunner, prompt: str
) -> None:
    prompt_ids = runner.tokenizer.encode(prompt)
    reference = llama_cpp.Llama(model_path=str(embedded_model_path()), n_ctx=1024, n_threads=2, verbose=False)
    theirs = [token for token, _ in zip(reference.generate(prompt_ids, temp=0.0, top_k=1), range(32), strict=False)]
    assert greedy(runner, prompt_ids, 32) == theirs


def test_a_rollback_drops_the_rolled_back_cells(runner: LlamaCppModelRunner) -> None:
    prompt_ids = runner.tokenizer.encode(PROMPTS[0])
    drafts = runner.tokenizer.encode(" the sun, the sea")
    seq = runner.kv.admit(prompt_ids, len(drafts) + 1)
    assert seq is not None
    runner.prefill([seq], [prompt_ids])
    first = runner.extend(seq, drafts, all_logits=True)
    runner.truncate(seq, len(prompt_ids))
    again = runner.extend(seq, drafts, all_logits=True)
    runner.truncate(seq, len(prompt_ids) + 1)
    after_rollback = runner.decode([seq], [drafts[-1]])[0]
    runner.kv.release(seq)
    assert bool((first == again).all()), "the same tokens at the same positions after a rollback"
    fresh = runner.kv.admit(prompt_ids, 2)
    assert fresh is not None
    runner.prefill([fresh], [prompt_ids])
    runner.decode([fresh], drafts[:1])
    alone = runner.decode([fresh], [drafts[-1]])[0]
    runner.kv.release(fresh)
    assert bool((after_rollback == alone).all()), "no rolled-back token is still attended to"


@pytest.fixture
def scheduler(runner: LlamaCppModelRunner) -> Iterator[Scheduler]:
    loop = Scheduler(ServerArgs.of(**SETTINGS, max_total_tokens=4096), runner)
    yield loop
    loop.shutdown(None)


def test_constrained_requests_validate_and_every_sequence_comes_back(
    runner: LlamaCppModelRunner, scheduler: Scheduler
) -> None:
    """Six requests on three sequence ids: the last wait for freed ids, and the constrained ones are valid."""
    kinds = ["json_schema", "regex", "choice", "json_schema"]
    requests = []
    for i, kind in enumerate(kinds):
        field, spec = CONSTRAINTS[kind]
        prompt = f"Describe person number {i}, from Lima, as JSON." if kind == "json_schema" else "Call Ana."
        params = {field: spec, "max_new_tokens": 64, "temperature": 0}
        requests.append(make_request(messages=[{"role": "user", "content": prompt}], sampling_params=params))
    for prompt in PROMPTS:
        requests.append(make_request(text=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0.8}))
    outputs = serve(scheduler, requests)
    texts = [runner.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    for kind, output, text in zip(kinds, outputs, texts, strict=False):
        assert output.finish_reason is not None and output.finish_reason.type == "stop", (kind, text)
        if kind == "json_schema":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(CONSTRAINTS["regex"][1], text)
        else:
            assert text in CONSTRAINTS["choice"][1]
    assert [len(o.token_ids) for o in outputs[len(kinds) :]] == [16, 16]
    assert runner.kv.seq_ids == {} and runner.kv.pool.num_free == runner.kv.capacity
    assert runner.kv.num_available == runner.kv.capacity


@pytest.mark.launches("--model-runner", "llamacpp")
def test_the_launcher_serves_on_llama_cpp() -> None:
    with launch_scheduler("--model-runner", "llamacpp") as server, server.client() as client:
        output = client.generate(
            messages=[{"role": "user", "content": "Give a person as JSON."}],
            sampling_params={"json_schema": PERSON, "max_new_tokens": 64, "temperature": 0},
        )
        assert "model runner on llama.cpp" in server.log()
    assert output.finish_reason is not None and output.finish_reason.type == "stop"
    jsonschema.validate(json.loads(output.text), PERSON)


def test_greedy_outputs_alone_and_batched_are_the_same(scheduler: Scheduler) -> None:
    """Each sequence has its own KV stream, so sharing decode steps with other requests leaves its logits alone (the
    default ``auto`` speculation is off on this runner: a multi-token forward would not)."""
    field, spec = CONSTRAINTS["json_schema"]
    requests = [
        {"messages": [{"role": "user", "content": f"Describe person {i} from Oslo as JSON."}], "sampling_params": {}}
        for i in range(2)
    ] + [{"text": prompt, "sampling_params": {}} for prompt in PROMPTS]
    for i, request in enumerate(requests):
        request["sampling_params"] = {"max_new_tokens": 40, "temperature": 0} | ({field: spec} if i < 2 else {})
    alone = [serve(scheduler, [make_request(**request)])[0].token_ids for request in requests]
    batched = [output.token_ids for output in serve(scheduler, [make_request(**request) for request in requests])]
    assert batched == alone
