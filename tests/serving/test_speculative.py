"""Speculative decoding and jump-forward change no output: the same requests through the loop with speculation off
and on give the same tokens, greedy and seeded, one at a time and in mixed batches, on every grammar backend.

The schedulers run in this process over one model runner (two loops, one model load); the batch-invariant forward
makes the comparison exact, so any difference is a bug, never rounding. The prefill's sharing of prompts (``n``
samples of one prompt, requests that begin alike) is checked here too, on the same runner, by the same equality.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from scheduler.client import make_request
from scheduler.io_struct import GenerateOutput, GenerateReq
from scheduler.model.runner import ModelRunner
from scheduler.prefill_admission import SHARED_PREFIX_MIN_TOKENS
from scheduler.scheduler import Scheduler
from scheduler.server_args import ServerArgs
from scheduler.testing.in_process import serve

pytestmark = pytest.mark.model

MODEL_SETTINGS: dict[str, Any] = {"max_running_requests": 64, "max_seq_len": 640, "max_total_tokens": 24576}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CONSTRAINTS: dict[str, tuple[str, Any]] = {
    "json_schema": ("json_schema", PERSON),
    "regex": ("regex", r"\(\d{3}\) \d{3}-\d{4}"),
    "ebnf": ("ebnf", 'root ::= item ("," item)*\nitem ::= "cat" | "dog" | "bird"'),
    "choice": ("choice", ["Java", "JavaScript", "Python"]),
    "structural_tag": (
        "structural_tag",
        {
            "structures": [{"begin": "<f=weather>", "schema": {"type": "object"}, "end": "</f>"}],
            "triggers": ["<f="],
        },
    ),
    "json_object": ("json_object", True),
}
BACKEND_KINDS = {
    "xgrammar": list(CONSTRAINTS),
    "llguidance": list(CONSTRAINTS),
    "outlines": ["json_schema", "regex", "choice", "json_object"],
}
PROMPTS = [
    "Describe a person who lives in Paris, as JSON.",
    "Give me a phone number and a JSON record for Ana, 31, from Lima.",
    "List some pets.",
    "Which language runs in browsers?",
    "Call <f=weather> for Oslo.",
    'Repeat this JSON exactly: {"name": "Bo", "age": 7, "city": "Oslo"}',
]
FREE_PROMPTS = [
    "The three best things about summer are",
    "Count from one to twenty: one, two, three,",
    "Write a haiku about autumn.",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]


@pytest.fixture(scope="module")
def runner(server_args: ServerArgs) -> ModelRunner:
    return ModelRunner(replace(server_args.model, **MODEL_SETTINGS))


@contextlib.contextmanager
def in_process_scheduler(runner: ModelRunner, **settings: Any) -> Iterator[Scheduler]:
    """A loop on ``runner`` with an empty prefix cache, as a fresh server would start."""
    runner.kv.flush()
    scheduler = Scheduler(ServerArgs.of(**MODEL_SETTINGS, **settings), runner)
    try:
        yield scheduler
    finally:
        scheduler.shutdown(None)


def serve_in_groups(scheduler: Scheduler, requests: list[GenerateReq], size: int) -> list[GenerateOutput]:
    """``serve`` ``size`` requests at a time, in order: batches small enough that their drafts fit the runner's token
    budget beside them, so that drafts are verified."""
    return [
        output for start in range(0, len(requests), size) for output in serve(scheduler, requests[start : start + size])
    ]


def request_set(kinds: list[str], temperature: float, copies: int) -> list[dict[str, Any]]:
    """Every constraint kind with several prompts, and free requests (with a stop string, a short length)."""
    requests = []
    for copy in range(copies):
        for i, kind in enumerate(kinds):
            field, spec = CONSTRAINTS[kind]
            prompt = PROMPTS[(i + copy) % len(PROMPTS)]
            params = {field: spec, "max_new_tokens": 32, "temperature": temperature, "seed": 100 + copy}
            requests.append({"messages": [{"role": "user", "content": prompt}], "sampling_params": params})
        for j, prompt in enumerate(FREE_PROMPTS):
            params = {"max_new_tokens": 12 + 8 * j, "temperature": temperature, "seed": 200 + copy}
            if j == 1:
                params["stop"] = ["seven"]
            requests.append({"text": prompt, "sampling_params": params})
    return requests


def outputs_with(
    runner: ModelRunner, backend: str, algorithm: str, batches: list[list[dict[str, Any]]], **settings: Any
) -> Any:
    with in_process_scheduler(
        runner, grammar_backend=backend, speculative_algorithm=algorithm, **settings
    ) as scheduler:
        outputs = [serve(scheduler, [make_request(**r) for r in batch]) for batch in batches]
        stats = scheduler.executor.stats
    return [[(o.token_ids, o.finish_reason) for o in batch] for batch in outputs], stats


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param(name, marks=pytest.mark.prepared_ahead("outlines any-JSON grammar") if name == "outlines" else ())
        for name in BACKEND_KINDS
    ],
)
def test_speculation_changes_no_output(runner: ModelRunner, backend: str) -> None:
    """Greedy and seeded requests, alone and in one mixed batch (50+ for xgrammar): token for token the same."""
    kinds = BACKEND_KINDS[backend]
    mixed = request_set(kinds, 0.0, copies=5 if backend == "xgrammar" else 2) + request_set(kinds, 0.8, copies=1)
    batches = [mixed]
    if backend == "xgrammar":
        batches += [[r] for r in request_set(kinds, 0.0, copies=1)[: len(kinds) + 2]]  # batch 1, each on its own
    plain, plain_stats = outputs_with(runner, backend, "none", batches)
    fast, fast_stats = outputs_with(runner, backend, "grammar+ngram", batches)
    num_outputs = sum(len(batch) for batch in plain)
    differing = [(i, j) for i, batch in enumerate(plain) for j, output in enumerate(batch) if fast[i][j] != output]
    assert not differing, f"{len(differing)} of {num_outputs} outputs differ with speculation on: {differing}"
    assert plain_stats.num_output_tokens == fast_stats.num_output_tokens
    assert fast_stats.num_forwards <= plain_stats.num_forwards
    if backend == "xgrammar":  # requests alone too, where every accepted draft shortens the run
        assert fast_stats.num_forwards < plain_stats.num_forwards
    assert sum(fast_stats.drafts_accepted.values()) + fast_stats.num_forced_tokens > 0


KNOBS: list[dict[str, Any]] = [
    {"frequency_penalty": 0.8, "presence_penalty": 0.4},
    {"repetition_penalty": 1.3, "min_p": 0.05},
    {"logit_bias": {"1345": 2.0, "28": -3.0}, "min_new_tokens": 6, "stop_token_ids": [30]},
    {"ignore_eos": True, "top_k": 20, "frequency_penalty": -0.5},
]


def knob_requests() -> list[dict[str, Any]]:
    """Every sampling knob on constrained and free requests (whose prompts invite grammar and prompt-lookup drafts),
    greedy and seeded, half of them asking for logprobs."""
    requests = []
    for i, knobs in enumerate(KNOBS):
        for temperature in (0.0, 0.8):
            common = {**knobs, "max_new_tokens": 32, "temperature": temperature, "seed": 300 + i}
            requests += [
                {"messages": [{"role": "user", "content": PROMPTS[5]}], "sampling_params": {"json_schema": PERSON}},
                {"messages": [{"role": "user", "content": PROMPTS[1]}], "sampling_params": {"regex": r"\d{3}-\d{4}"}},
                {"text": FREE_PROMPTS[3], "sampling_params": {}},
                {"text": FREE_PROMPTS[1], "sampling_params": {}},
            ]
            for j, request in enumerate(requests[-4:]):
                request["sampling_params"] |= common
                request["top_logprobs_num"] = 3 if j % 2 == 0 else None
    return requests


def test_speculation_changes_no_output_with_sampling_knobs(runner: ModelRunner) -> None:
    """Penalties (which count verified drafts as output), bias, min-p, min_new_tokens, stop tokens and ignore_eos:
    tokens, finish reasons and logprobs exactly as without speculation. Two requests at a time (``serve_in_groups``)."""
    requests = knob_requests()
    results = {}
    for algorithm in ("none", "grammar+ngram"):
        with in_process_scheduler(runner, grammar_backend="xgrammar", speculative_algorithm=algorithm) as scheduler:
            outputs = serve_in_groups(scheduler, [make_request(**r) for r in requests], 2)
            stats = scheduler.executor.stats
        results[algorithm] = ([(o.token_ids, o.finish_reason, o.logprobs) for o in outputs], stats)
    (plain, plain_stats), (fast, fast_stats) = results["none"], results["grammar+ngram"]
    differing = [i for i, output in enumerate(plain) if fast[i] != output]
    assert not differing, f"{len(differing)} of {len(plain)} outputs differ with speculation on: {differing}"
    assert fast_stats.num_forwards < plain_stats.num_forwards
    assert all(logprobs is not None for _, _, logprobs in plain[::2])


def assert_each_equals_its_output_alone(
    scheduler: Scheduler, requests: list[dict[str, Any]], outputs: list[GenerateOutput]
) -> None:
    """Each request, sent again alone on an empty prefix cache (so it computes its whole prompt), gives its output
    token for token."""
    for request, output in zip(requests, outputs, strict=True):
        scheduler.kv.flush()
        (alone,) = serve(scheduler, [make_request(**request)])
        assert alone.usage.cached_tokens == 0 and alone.token_ids == output.token_ids, request


def test_n_samples_of_one_prompt_share_its_prefill_and_equal_their_samples_alone(runner: ModelRunner) -> None:
    """Four seeded samples of one prompt sent together (as ``n`` sends them): the first computes the prompt, the
    others take all of its KV and its first logits, and each is token for token the sample its seed gives alone on
    an empty cache."""
    requests = [
        {"text": FREE_PROMPTS[0], "sampling_params": {"temperature": 0.9, "max_new_tokens": 12, "seed": seed}}
        for seed in (50, 51, 52, 53)
    ]
    with in_process_scheduler(runner, grammar_backend="none") as scheduler:
        together = serve(scheduler, [make_request(**request) for request in requests])
        num_prompt_tokens = together[0].usage.prompt_tokens
        assert [o.usage.cached_tokens for o in together] == [0] + [num_prompt_tokens] * 3
        assert_each_equals_its_output_alone(scheduler, requests, together)


SYSTEM_PROMPT = (
    "You are the booking assistant of a small hotel by the sea. Answer in one short sentence, politely, and never "
    "promise a room: say that the front desk confirms every booking by email within a day. The hotel has twelve "
    "rooms, a garden, a restaurant open from seven to ten, and bicycles that guests may borrow for free."
)
"""A system prompt long enough (over ``SHARED_PREFIX_MIN_TOKENS`` tokens) for requests sent together to share it."""


def test_requests_sharing_a_long_prefix_compute_it_once_and_equal_each_alone(runner: ModelRunner) -> None:
    """Four seeded chats sent at once with one long system prompt: the first computes it, the others wait a turn
    and take it from the prefix cache (their cached tokens say so), and each is token for token the output it gives
    alone on an empty cache."""
    questions = ["Do you have a room on Friday?", "When is breakfast?", "Can I bring a dog?", "Is there parking?"]
    requests = [
        {
            "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            "sampling_params": {"temperature": 0.9, "max_new_tokens": 10, "seed": seed},
        }
        for seed, question in enumerate(questions)
    ]
    with in_process_scheduler(runner, grammar_backend="none") as scheduler:
        together = serve(scheduler, [make_request(**request) for request in requests])
        assert together[0].usage.cached_tokens == 0
        assert all(output.usage.cached_tokens >= SHARED_PREFIX_MIN_TOKENS for output in together[1:]), together
        assert_each_equals_its_output_alone(scheduler, requests, together)


def test_the_ngram_cache_drafts_the_layout_earlier_answers_had_and_changes_no_output(runner: ModelRunner) -> None:
    """Greedy JSON answers one after another: from the second on, the n-gram cache of earlier outputs drafts the
    layout no prompt holds (``{`` then ``\\n  "``), its drafts stand, and every output is the one plain decoding
    gives, with the cache and without."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[5]]
    params = {"json_schema": PERSON, "max_new_tokens": 48, "temperature": 0.0}
    batches = [[{"messages": [{"role": "user", "content": p}], "sampling_params": params}] for p in prompts]
    plain, _ = outputs_with(runner, "xgrammar", "none", batches)
    cached, cached_stats = outputs_with(runner, "xgrammar", "grammar+ngram", batches)
    uncached, uncached_stats = outputs_with(runner, "xgrammar", "grammar+ngram", batches, speculative_ngram_capacity=0)
    assert cached == plain and uncached == plain
    assert "ngram_cache" not in uncached_stats.drafts_proposed
    assert cached_stats.drafts_accepted.get("ngram_cache", 0) > 0
    assert cached_stats.num_forwards < uncached_stats.num_forwards


PREDICTED_SCHEMA = {**PERSON, "properties": {**PERSON["properties"], "name": {"type": "string"}}}
"""``PERSON`` without a string length bound, which the outlines backend refuses."""
PREDICTED_CASES: dict[str, dict[str, Any]] = {
    "json": {
        "messages": [{"role": "user", "content": PROMPTS[5]}],
        "sampling_params": {"json_schema": PREDICTED_SCHEMA},
    },
    "free": {"text": FREE_PROMPTS[3], "sampling_params": {}},
}
UNRELATED_PREDICTION = 'Lorem ipsum dolor sit amet, {"name": "Zed", "age": 99} the quick brown fox'


@pytest.mark.parametrize("backend", list(BACKEND_KINDS))
def test_a_prediction_changes_no_output_and_counts_what_the_output_repeated(runner: ModelRunner, backend: str) -> None:
    """Free text and a JSON schema, greedy and seeded, with a predicted output: the answer itself, the answer with
    one token edited, or unrelated text. Every output is token for token the one without a prediction; the answer
    as prediction is all accepted, the edited one all but its edit, and prediction drafts stand."""
    requests = [
        {**case, "sampling_params": {**case["sampling_params"], "max_new_tokens": 24, "temperature": t, "seed": 7}}
        for case in PREDICTED_CASES.values()
        for t in (0.0, 0.8)
    ]
    with in_process_scheduler(runner, grammar_backend=backend) as scheduler:
        plain = serve(scheduler, [make_request(**r) for r in requests])
        scheduler.kv.flush()
        predictions: list[str | list[int]] = []
        for output in plain:
            middle = len(output.token_ids) // 2
            edited = [*output.token_ids[:middle], output.token_ids[middle] + 1, *output.token_ids[middle + 1 :]]
            predictions += [output.token_ids, edited, UNRELATED_PREDICTION]
        predicted = serve_in_groups(  # one request's three predictions at a time
            scheduler, [make_request(**requests[i // 3], prediction=p) for i, p in enumerate(predictions)], 3
        )
        stats = scheduler.executor.stats
    assert all(output.finish_reason.type != "abort" for output in plain if output.finish_reason is not None)
    for i, output in enumerate(predicted):
        expected = plain[i // 3]
        assert (output.token_ids, output.finish_reason) == (expected.token_ids, expected.finish_reason), i
        counts = (output.usage.accepted_prediction_tokens, output.usage.rejected_prediction_tokens)
        num_tokens = len(expected.token_ids)
        if i % 3 == 0:
            assert counts == (num_tokens, 0), i
        elif i % 3 == 1:
            assert counts == (num_tokens - 1, 1), i
    assert stats.drafts_accepted.get("prediction", 0) > 0


def test_without_speculation_a_prediction_drafts_nothing_and_is_still_counted(runner: ModelRunner) -> None:
    """``--speculative-algorithm none``: the operator verifies no drafts, so a prediction is a hint that goes unused;
    the output is the same and its usage still says the prediction was all repeated."""
    request = {"text": FREE_PROMPTS[1], "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}}
    with in_process_scheduler(runner, grammar_backend="none", speculative_algorithm="none") as scheduler:
        (plain,) = serve(scheduler, [make_request(**request)])
        scheduler.kv.flush()
        (predicted,) = serve(scheduler, [make_request(**request, prediction=plain.token_ids)])
        stats = scheduler.executor.stats
    assert predicted.token_ids == plain.token_ids
    assert (predicted.usage.accepted_prediction_tokens, predicted.usage.rejected_prediction_tokens) == (12, 0)
    assert stats.drafts_proposed == {} and stats.num_forwards == 2 * 12
