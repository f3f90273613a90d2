"""The scheduler on the embedded model, over real zmq: every constraint kind, concurrency, failures, aborts."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import psutil
import pytest
import zmq

from scheduler.client import make_request
from scheduler.io_struct import AbortCause, GenerateOutput, decode_server_message, encode
from scheduler.server_args import GrammarArgs
from scheduler.testing.process import SchedulerProcess, process_tree
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.base_grammar_backend import create_grammar_backend
from sglang_constrained.compile.forked_fork_server import can_fork_fork_server
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import flush_prefix_cache, launch_scheduler

pytestmark = pytest.mark.model

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
PHONE_REGEX = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = ["red", "green", "blue"]
EBNF = 'root ::= item ("," item)*\nitem ::= "cat" | "dog" | "bird"'
WEATHER_TAG = {"structures": [{"begin": "<f=weather>", "schema": WEATHER_SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
SLOW_EBNF = 'root ::= "\\"" [^"\\\\]{0,4000} "\\""'
"""A string of up to 4,000 characters: xgrammar takes seconds to compile it at 49k tokens (measured: 5.8 s on a busy
machine); the deadline server allows 1 s. An EBNF grammar is compiled as written, without the cost prediction that
refuses a schema's length bounds this long up front."""

CASES: dict[str, tuple[str, Any, str]] = {
    "json_schema": ("json", PERSON_SCHEMA, "Describe a person as JSON with a name and an age."),
    "regex": ("regex", PHONE_REGEX, "What is your phone number?"),
    "ebnf": ("ebnf", EBNF, "List some pets, separated by commas."),
    "choice": ("choice", COLORS, "What is your favourite colour?"),
    "structural_tag": ("structural_tag", WEATHER_TAG, "Call <f=weather> with a city to get the weather in Paris."),
    "json_object": ("json_object", True, "Give me a JSON object describing a cat."),
}


@pytest.fixture(scope="module")
def grammar_backend(smollm2_tokenizer: TokenizerSetup) -> Iterator[GrammarPipeline]:
    """An xgrammar backend in the test process, to check outputs with the grammar's own acceptance."""
    backend = create_grammar_backend(
        GrammarArgs(), smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids
    )
    assert backend is not None
    yield backend
    backend.shutdown()


def constrained_request(field: str, temperature: float = 0.0, **params: Any) -> dict[str, Any]:
    """48 new tokens at most: the JSON schema, regex and choice answers end well before; the EBNF list, the free text
    around a structural tag and an open JSON object may run on, and a prefix shows that each token obeyed as well."""
    _, spec, prompt = CASES[field]
    return {
        "messages": [{"role": "user", "content": prompt}],
        "sampling_params": {field: spec, "temperature": temperature, "max_new_tokens": 48, **params},
    }


def assert_obeys(output: GenerateOutput, field: str, backend: GrammarPipeline, tokenizer: TokenizerSetup) -> None:
    """The output is valid for its constraint, or (cut by the length limit) a prefix of a valid output."""
    assert output.finish_reason is not None and output.finish_reason.type in ("stop", "length"), output
    kind, spec, _ = CASES[field]
    ids = [t for t in output.token_ids if t not in tokenizer.eos_token_ids]
    walk = walk_tokens(
        compile_grammar(backend, make_grammar_key(kind, spec)), ids, tokenizer.vocab_size, tokenizer.eos_token_ids
    )
    if output.finish_reason.type == "length":
        assert walk.rejected_at is None, f"not a prefix of a valid output: {output.text!r}"
        return
    assert walk.is_accepted, f"the grammar does not accept {output.text!r}"
    if field == "json_schema":
        jsonschema.validate(json.loads(output.text), PERSON_SCHEMA)
    elif field == "json_object":
        assert isinstance(json.loads(output.text), dict)
    elif field == "regex":
        assert re.fullmatch(PHONE_REGEX, output.text)
    elif field == "choice":
        assert output.text in COLORS
    elif field == "structural_tag":
        for call in re.findall(r"<f=weather>(.*?)</f>", output.text, re.DOTALL):
            jsonschema.validate(json.loads(call), WEATHER_SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("field", list(CASES))
def test_each_constraint_kind_is_obeyed(
    one_rank_server: SchedulerProcess,
    grammar_backend: GrammarPipeline,
    smollm2_tokenizer: TokenizerSetup,
    field: str,
    temperature: float,
) -> None:
    with one_rank_server.client() as client:
        output = client.generate(**constrained_request(field, temperature, seed=7))
    assert_obeys(output, field, grammar_backend, smollm2_tokenizer)


def test_forty_concurrent_requests_mixing_free_and_constrained(
    one_rank_server: SchedulerProcess, grammar_backend: GrammarPipeline, smollm2_tokenizer: TokenizerSetup
) -> None:
    free = {"text": "The three best things about summer are", "sampling_params": {"max_new_tokens": 24}}
    requests = [make_request(**(free if i % 4 < 2 else constrained_request("json_schema"))) for i in range(40)]
    with one_rank_server.client() as client:
        outputs = client.generate_batch(requests)
    for i, output in enumerate(outputs):
        if i % 4 < 2:
            assert output.finish_reason is not None and output.finish_reason.type in ("stop", "length")
            assert output.text.strip()
        else:
            assert output.finish_reason is not None and output.finish_reason.type == "stop", output
            assert_obeys(output, "json_schema", grammar_backend, smollm2_tokenizer)


def test_requests_sharing_a_prompt_under_other_constraints_answer_as_alone(one_rank_server: SchedulerProcess) -> None:
    """One new prompt asked under a regex, a choice and a JSON schema at once, greedily (their grammars compiled
    before, on another prompt, so that they start together): the batch computes the prompt's logits once, for the
    union of the requests' masks, and each answer is the one it gives alone afterwards."""
    params = {"temperature": 0.0, "max_new_tokens": 48}
    constraints = [{"regex": PHONE_REGEX}, {"choice": COLORS}, {"json_schema": json.dumps(PERSON_SCHEMA)}]
    asks = [
        {"messages": [{"role": "user", "content": content}], "sampling_params": {**c, **params}}
        for content in ("Warm up.", "Answer in the format asked.")
        for c in constraints
    ]
    with one_rank_server.client() as client:
        client.generate_batch([make_request(**ask) for ask in asks[:3]])
        together = [output.token_ids for output in client.generate_batch([make_request(**ask) for ask in asks[3:]])]
        alone = [client.generate(**ask).token_ids for ask in asks[3:]]
    assert together == alone


def test_invalid_schema_fails_alone_while_others_succeed(one_rank_server: SchedulerProcess) -> None:
    bad = {"text": "hi", "sampling_params": {"json_schema": "INVALID"}}
    requests = [
        make_request(**constrained_request("regex")),
        make_request(**bad),
        make_request(**constrained_request("choice")),
    ]
    with one_rank_server.client() as client:
        good_regex, invalid, good_choice = client.generate_batch(requests)
    assert invalid.finish_reason is not None and invalid.finish_reason.type == "abort"
    assert invalid.finish_reason.message is not None
    assert invalid.finish_reason.message.startswith("Failed to compile json grammar:")
    assert invalid.finish_reason.cause is AbortCause.INVALID_CONSTRAINT
    assert re.fullmatch(PHONE_REGEX, good_regex.text)
    assert good_choice.text in COLORS


def test_unsupported_schema_feature_is_named(one_rank_server: SchedulerProcess) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    with one_rank_server.client() as client:
        output = client.generate(text="hi", sampling_params={"json_schema": schema})
    assert output.finish_reason is not None and output.finish_reason.message is not None
    assert "'not'" in output.finish_reason.message and "/properties/n" in output.finish_reason.message


def test_same_schema_twice_is_a_cache_hit_the_second_time(one_rank_server: SchedulerProcess) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    request = {"text": "Answer in JSON:", "sampling_params": {"json_schema": schema, "temperature": 0}}
    with one_rank_server.client() as client:
        first = client.generate(**request)
        second = client.generate(**request)
    assert first.grammar_cache_hit is False and second.grammar_cache_hit is True
    assert first.text == second.text and json.loads(second.text)["ok"] in (True, False)


@pytest.mark.skipif(not can_fork_fork_server(), reason="this Python's fork server is not one the launcher forks")
def test_the_compile_processes_fork_from_the_scheduler_forked_not_from_a_new_interpreter(
    one_rank_server: SchedulerProcess,
) -> None:
    """The scheduler forks itself into its compile processes' fork server once its imports are done, so that no
    interpreter imports xgrammar (and torch) again at start-up (~2.5 s of CPU); compiles run in its children."""
    schema = {"type": "object", "properties": {"forked": {"type": "boolean"}}, "required": ["forked"]}
    with one_rank_server.client() as client:
        output = client.generate(text="JSON:", sampling_params={"json_schema": schema, "temperature": 0})
    assert isinstance(json.loads(output.text)["forked"], bool)
    scheduler = psutil.Process(one_rank_server.process.pid)
    children = scheduler.children()
    (fork_server,) = [child for child in children if child.cmdline() == scheduler.cmdline()]
    assert fork_server.children(), "the compile processes are the fork server's children"
    assert not any("multiprocessing.forkserver" in " ".join(child.cmdline()) for child in children)


def test_a_server_started_ahead_runs_at_normal_priority_once_taken(one_rank_server: SchedulerProcess) -> None:
    """The session's server was started ahead, at idle priority where it can be given back (``tests/launch_ahead.py``):
    taken, every thread of its tree (its fork server and compile processes too) is back under the normal policy, and
    the compile processes it starts after take that too."""
    schema = {"type": "object", "properties": {"normal": {"type": "boolean"}}, "required": ["normal"]}
    with one_rank_server.client() as client:
        client.generate(text="JSON:", sampling_params={"json_schema": schema, "temperature": 0})
    threads = [thread.id for process in process_tree(one_rank_server.process.pid) for thread in process.threads()]
    assert len(threads) > 1 and {os.sched_getscheduler(thread) for thread in threads} == {os.SCHED_OTHER}


def test_client_abort_mid_generation_returns_its_kv_tokens(one_rank_server: SchedulerProcess) -> None:
    free_tokens = one_rank_server.status().num_free_kv_tokens
    request = {
        "text": "Once upon a time, there was a dragon who",
        "sampling_params": {"max_new_tokens": 500, "temperature": 0},
    }
    with one_rank_server.client() as client:
        chunks = client.generate_stream(**request)
        first = next(chunks)
        assert one_rank_server.status().num_running_requests == 1
        client.abort(first.rid)
        rest = list(chunks)
    assert rest[-1].finished and rest[-1].finish_reason is not None and rest[-1].finish_reason.type == "abort"
    assert rest[-1].finish_reason.cause is AbortCause.CLIENT
    assert rest[-1].usage.completion_tokens < 500
    status = one_rank_server.status()
    assert status.num_running_requests == 0 and status.num_free_kv_tokens == free_tokens


BOUNDS_FLAGS = ("--max-total-tokens", "160", "--grammar-compile-timeout", "1")


@pytest.mark.launches(*BOUNDS_FLAGS)
def test_requests_beyond_the_kv_bound_wait_and_a_compile_past_the_deadline_times_out() -> None:
    """One server with both bounds. Admission reserves prompt + max_new_tokens, so the KV bound holds two of the
    first requests at a time: four run to the end in turn. One larger than the whole bound is refused with a message
    naming it; the others are served. Then a compile past the deadline times out, the loop keeps serving, and the
    shutdown does not wait for the compile still running."""
    fits = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 60, "temperature": 0}}
    never = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 200}}
    slow = {"text": "hi", "sampling_params": {"ebnf": SLOW_EBNF}}
    with launch_scheduler(*BOUNDS_FLAGS) as launched, launched.client() as client:
        outputs = client.generate_batch([make_request(**fits) for _ in range(4)] + [make_request(**never)])
        status = launched.status()
        timed_out = client.generate(**slow)
        served_choice = client.generate(**constrained_request("choice"))
        again = client.generate(**slow)
        stopping_at = time.monotonic()
    assert time.monotonic() - stopping_at < 20, "shutdown waited for the compile threads"
    *served, refused = outputs
    assert all(o.finish_reason is not None and o.finish_reason.type in ("stop", "length") for o in served)
    assert all(o.usage.completion_tokens > 0 for o in served)
    assert refused.finish_reason is not None and refused.finish_reason.type == "abort"
    assert "--max-total-tokens 160" in (refused.finish_reason.message or "")
    assert refused.finish_reason.cause is AbortCause.BAD_REQUEST
    assert status.num_running_requests == status.num_waiting_requests == 0
    assert timed_out.finish_reason is not None
    assert timed_out.finish_reason.message == "Grammar compilation timed out after 1 s"
    assert timed_out.finish_reason.cause is AbortCause.COMPILE_TIMEOUT
    assert served_choice.text in COLORS
    assert again.grammar_cache_hit is False  # a timeout is not cached: the schema compiles anew
    assert again.finish_reason is not None and again.finish_reason.message == timed_out.finish_reason.message


XGRAMMAR_FLAGS = ("--grammar-backend", "xgrammar")


@pytest.mark.launches(*XGRAMMAR_FLAGS)
def test_a_compile_whose_client_left_answers_the_same_constraint_sent_again() -> None:
    """A client disconnects after 1 s while its grammar compiles (SGLang's ``--grammar-backend xgrammar``, which takes
    seconds over ``SLOW_EBNF``), then sends it again: the new request joins the compile still running and is
    answered from it. One compile ran: one move to the slow lane in the log, where a new compile would log a second."""
    params = {"ebnf": SLOW_EBNF, "max_new_tokens": 4, "temperature": 0}
    with launch_scheduler(*XGRAMMAR_FLAGS) as launched, launched.client() as client:
        left = make_request(text="hi", sampling_params=params)
        client.socket.send(encode(left))
        time.sleep(1.0)
        client.abort(left.rid)
        again = client.generate(text="hi", sampling_params=params)
        status = launched.status()
        log = launched.log()
    assert status.grammar_backend == "xgrammar"
    assert f"request {left.rid} aborted by the client" in log
    assert again.finish_reason is not None and again.finish_reason.type in ("stop", "length"), again.finish_reason
    assert again.text.startswith('"')
    assert log.count("xgrammar: a compile running") == 1


def test_streamed_chunks_add_up_to_the_output(one_rank_server: SchedulerProcess) -> None:
    """One chunk per forward that commits tokens (speculation may commit many at once, so there are fewer chunks
    than tokens), and together they are the whole output."""
    request = constrained_request("json_schema")
    with one_rank_server.client() as client:
        chunks = list(client.generate_stream(**request))
        whole = client.generate(**request)
    assert len(chunks) > 1 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids


def test_stop_string_ends_the_output_before_it(one_rank_server: SchedulerProcess) -> None:
    request = {
        "text": "Count: 1, 2, 3, 4,",
        "sampling_params": {"temperature": 0, "stop": [" 7"], "max_new_tokens": 40},
    }
    with one_rank_server.client() as client:
        output = client.generate(**request)
    assert output.finish_reason is not None and output.finish_reason.type == "stop"
    assert output.finish_reason.matched == " 7" and output.text.endswith("6,")


def test_a_seed_makes_sampling_reproducible(one_rank_server: SchedulerProcess) -> None:
    request = {"text": "Once upon a time", "sampling_params": {"temperature": 1.0, "seed": 1234, "max_new_tokens": 16}}
    with one_rank_server.client() as client:
        first, second = client.generate(**request), client.generate(**request)
    assert first.token_ids == second.token_ids


def test_malformed_messages_get_an_error_and_the_loop_keeps_serving(one_rank_server: SchedulerProcess) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(one_rank_server.endpoint)
    try:
        socket.send(b"\xff not msgpack")
        socket.send(
            msgspec.msgpack.encode({"type": "generate", "rid": "bad-1", "sampling_params": {"temperature": "hot"}})
        )
        assert socket.poll(30_000)
        reply = decode_server_message(socket.recv())
        assert isinstance(reply, GenerateOutput) and reply.rid == "bad-1" and reply.finish_reason is not None
        assert reply.finish_reason.type == "abort" and "malformed request" in (reply.finish_reason.message or "")
        socket.send(encode(make_request(rid="good-1", text="Hello", sampling_params={"max_new_tokens": 4})))
        assert socket.poll(60_000)
        good = decode_server_message(socket.recv())
        assert isinstance(good, GenerateOutput) and good.rid == "good-1" and good.finish_reason is not None
        assert good.finish_reason.type == "length"
    finally:
        socket.close(linger=0)
        context.term()
    assert "malformed message" in one_rank_server.log()


def test_several_constraints_in_one_request_are_refused(one_rank_server: SchedulerProcess) -> None:
    with one_rank_server.client() as client:
        output = client.generate(text="hi", sampling_params={"regex": "a+", "choice": ["a"]})
    assert output.finish_reason is not None and output.finish_reason.message == (
        "at most one constraint per request, got regex, choice"
    )


OTHER_BACKEND_FIELDS = {
    "llguidance": tuple(CASES),
    "outlines": ("json_schema", "regex", "choice"),
}
"""The constraint kinds each other backend takes (outlines-core has no EBNF or structural tag; its any-JSON index
is served in ``test_tensor_parallel``)."""


@pytest.mark.parametrize(
    "backend",
    [pytest.param(name, marks=pytest.mark.launches("--grammar-backend", name)) for name in OTHER_BACKEND_FIELDS],
)
def test_other_backends_serve_the_same_tokens_as_auto(
    backend: str,
    one_rank_server: SchedulerProcess,
    grammar_backend: GrammarPipeline,
    smollm2_tokenizer: TokenizerSetup,
) -> None:
    """Each backend enforces the same language and ends its grammar on a stop token: these greedy outputs are the
    same tokens whichever backend serves them (``auto``'s choice, which a slow compile changes, changed a TP test's
    output in CI: llguidance ended a closed JSON object without its stop token, one token shorter than xgrammar's).
    The backends' masks may still differ in how a token splits a property name, which these outputs do not meet."""
    fields = OTHER_BACKEND_FIELDS[backend]
    requests = [make_request(rid=field, **constrained_request(field)) for field in fields]
    with launch_scheduler("--grammar-backend", backend) as launched, launched.client() as client:
        outputs = client.generate_batch(requests)
        status = launched.status()
    flush_prefix_cache(one_rank_server)
    with one_rank_server.client() as client:
        reference = client.generate_batch(requests)
    assert status.grammar_backend == backend
    for field, output in zip(fields, outputs, strict=True):
        assert_obeys(output, field, grammar_backend, smollm2_tokenizer)
    assert {o.rid: o.token_ids for o in outputs} == {o.rid: o.token_ids for o in reference}
