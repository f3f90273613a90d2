"""Budget-aware constraints through the real loop on the embedded model: small budgets end in valid outputs that
finish with "stop" (with speculation and jump-forward on, as by default); a budget below the constraint's shortest
output is refused with a 400 naming both (through the loop, and over HTTP on the shared server); outputs far from
their budget are the same token for token with the feature off; the metric counts the requests that were steered; a
new constraint whose shortest output is still being searched holds up no other request.

The schedulers run in this process over one model runner, as in ``test_speculative``.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import replace
from typing import Any

import jsonschema
import openai
import pytest

from scheduler.client import make_request
from scheduler.io_struct import AbortCause, GenerateOutput
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ServerArgs
from scheduler.start_endings import StartEndings
from scheduler.testing.in_process import serve, submit, turn_until_finished
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.endings.search import EndingSearch
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import MODEL, QUESTION
from tests.serving.test_speculative import MODEL_SETTINGS, in_process_scheduler
from tests.serving.test_speculative import PERSON as BOUNDED_PERSON

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "hobbies"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PETS = 'root ::= item ("," item)*\nitem ::= "cat" | "dog" | "bird"'
CASES: dict[str, tuple[str, Any, str]] = {
    "json_schema": ("json_schema", PERSON, "Describe a person with many hobbies as JSON."),
    "regex": ("regex", PHONE, "What is your phone number?"),
    "ebnf": ("ebnf", PETS, "List as many pets as you can, separated by commas."),
}
MINIMUM = re.compile(r"budget \(max_tokens / max_new_tokens\) of (\d+) is below the (\d+) tokens of the shortest")


def is_valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), PERSON)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(PHONE, text) is not None
    return re.fullmatch(r"(cat|dog|bird)(,(cat|dog|bird))*", text) is not None


def request(kind: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> Any:
    field, spec, prompt = CASES[kind]
    params = {field: spec, "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
    return make_request(messages=[{"role": "user", "content": prompt}], sampling_params=params)


def tokens_and_reasons(outputs: list[GenerateOutput]) -> list[tuple[list[int], str | None]]:
    return [(o.token_ids, o.finish_reason.type if o.finish_reason else None) for o in outputs]


@pytest.fixture(scope="module")
def runner(server_args: ServerArgs) -> ModelRunner:
    return ModelRunner(replace(server_args.model, **MODEL_SETTINGS))


def test_small_budgets_end_valid_with_stop(runner: ModelRunner) -> None:
    with in_process_scheduler(runner) as scheduler:
        refused = serve(scheduler, [request(kind, 1) for kind in CASES])
        minimums = {}
        for kind, output in zip(CASES, refused, strict=True):
            assert output.finish_reason is not None and output.finish_reason.cause is AbortCause.BAD_REQUEST
            found = MINIMUM.search(output.finish_reason.message or "")
            assert found is not None, output.finish_reason.message
            assert found.group(1) == "1"
            minimums[kind] = int(found.group(2))
        budgets = [(kind, minimums[kind] + extra) for kind in CASES for extra in (0, 2, 7, 15)]
        reqs = [request(kind, budget) for kind, budget in budgets]
        reqs += [request(kind, budget, temperature=0.8, seed=i) for i, (kind, budget) in enumerate(budgets)]
        outputs = serve(scheduler, reqs)
        metrics = scheduler.grammar_manager.metrics.render()
    for (kind, budget), output in zip(budgets + budgets, outputs, strict=True):
        assert output.finish_reason is not None and output.finish_reason.type == "stop", (kind, budget, output)
        assert len(output.token_ids) <= budget
        assert is_valid(kind, output.text), (kind, budget, output.text)
    steered = re.search(r"^sglang:budget_steered_requests_total (\S+)$", metrics, re.MULTILINE)
    assert steered is not None and float(steered.group(1)) > 0


def test_outputs_far_from_the_budget_are_unchanged(runner: ModelRunner) -> None:
    """Greedy answers that end long before their budget: the same tokens with the feature off and on."""
    person = {"messages": [{"role": "user", "content": "Describe a person who lives in Paris, as JSON."}]}
    params = {"json_schema": BOUNDED_PERSON, "max_new_tokens": 120, "temperature": 0.0}
    reqs = [request("regex", 200), make_request(**person, sampling_params=params)]
    with in_process_scheduler(runner, disable_budget_aware_constraints=True) as scheduler:
        plain = tokens_and_reasons(serve(scheduler, reqs))
    with in_process_scheduler(runner) as scheduler:
        steered = tokens_and_reasons(serve(scheduler, reqs))
    assert [reason for _, reason in plain] == ["stop", "stop"]
    assert steered == plain


def test_a_constraint_whose_shortest_output_is_being_searched_holds_up_no_other_request(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new constraint's shortest output is searched on a thread of its own (``scheduler.start_endings``), not in
    the loop: while that search is held, its request waits in the grammar queue and a free request decodes to its
    end; once released, the constrained request is admitted and ends valid with "stop" within its budget."""
    release = threading.Event()
    search = StartEndings._find

    def held_search(self: StartEndings, grammar: BaseGrammarObject) -> list[int] | None:
        assert release.wait(timeout=120)
        return search(self, grammar)

    monkeypatch.setattr(StartEndings, "_find", held_search)
    constrained = request("json_schema", 40)
    free = make_request(text="Once upon a time", sampling_params={"max_new_tokens": 12, "temperature": 0.0})
    with in_process_scheduler(runner) as scheduler:
        submit(scheduler, [constrained, free])
        finished = turn_until_finished(scheduler, [free.rid], timeout_s=120)
        assert [req.rid for req in scheduler.grammar_manager.grammar_queue] == [constrained.rid]
        release.set()
        finished |= turn_until_finished(scheduler, [constrained.rid], timeout_s=120)
    assert len(finished[free.rid].token_ids) == 12
    output = finished[constrained.rid]
    assert output.finish_reason is not None and output.finish_reason.type == "stop", output.finish_reason
    assert len(output.token_ids) <= 40 and is_valid("json_schema", output.text), output.text


def test_budget_below_the_shortest_output_is_a_400_over_http(client: openai.OpenAI) -> None:
    """``max_completion_tokens`` below the schema's shortest output: a 400 naming both, and the server serves on."""
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_completion_tokens=3, response_format=schema)
    found = MINIMUM.search(str(error.value))
    assert found is not None and found.group(1) == "3" and int(found.group(2)) > 3, str(error.value)
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=int(found.group(2)), response_format=schema
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content or ""), PERSON)


FEW_PIECES = "(internationalization|a b c d)( b|xyz){1,2}"
"""A regex whose shortest string in bytes is not its shortest in tokens: the bound spells ``a b c d b`` (5 pieces and a
stop token) where ``internationalizationxyz`` takes 2 and a stop."""


def test_a_budget_at_the_exact_minimum_is_served_over_http(
    client: openai.OpenAI, smollm2_tokenizer: TokenizerSetup
) -> None:
    """The shared server's regexes go to xgrammar (``auto``), whose ending is now the exact minimum: a budget of
    exactly that many tokens (below the old bound) is served, one fewer is refused naming it."""
    search = EndingSearch(
        tokenizer_vocabulary(smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids)
    )
    words, tails = ("internationalization", "a b c d"), (" b", "xyz")
    language = [w + "".join(t) for w in words for n in (1, 2) for t in itertools.product(tails, repeat=n)]
    minimum = min(len(search.spell(text.encode()) or []) for text in language) + 1
    extra = {"regex": FEW_PIECES}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_completion_tokens=minimum - 1, extra_body=extra
        )
    found = MINIMUM.search(str(error.value))
    assert found is not None and int(found.group(2)) == minimum, str(error.value)
    completion = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_completion_tokens=minimum, extra_body=extra
    )
    assert completion.choices[0].finish_reason == "stop"
    assert re.fullmatch(FEW_PIECES, completion.choices[0].message.content or "")
