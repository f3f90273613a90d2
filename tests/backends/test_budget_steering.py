"""Budget-aware constraints by random walks through the steered masks: on every backend and constraint kind, with
budgets from the constraint's shortest output up, whatever the steered row allows ends inside the budget in an output
that parses and validates; hypothesis draws schemas from the vendored MaskBench sample.

A walk draws random logits, masks them with the grammar, lets ``BudgetSteering`` steer the row as the scheduler does,
samples among what is left, and feeds the token to the grammar and the steering; it must end with the grammar
terminated (a stop token accepted, or nothing more possible) within its budget. Walks run on SmolLM2's tokenizer.
A greedy walk whose ending grows a token at a time checks that the plan is kept current before the horizon.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.budget_steering import WATCH, BudgetSteering
from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.server_args import GrammarArgs
from scripts.serving_workload import person_schema_named
from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.endings.search import MAX_SEARCH_SECONDS, EndingSearch
from sglang_constrained.testing.maskbench import iter_case_paths, load_case
from sglang_constrained.testing.random_walk import Judge, choice_judge, json_judge, regex_judge
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.backends.test_soundness import legacy_tag, tagged_json_judge
from tests.helpers import compile_grammar
from triton_ops.bitmask_format import allocate_bitmask, unpack_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["name", "age", "tags"],
}
PETS = r"(cat|dog|bird)(,(cat|dog|bird))*"
AUTO_FALLBACK = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 1}
"""xgrammar refuses ``patternProperties``: ``auto`` compiles it with llguidance."""
CONSTRAINTS: dict[str, tuple[str, Any, Judge]] = {
    "json_schema": ("json", PERSON, json_judge(PERSON)),
    "regex": (
        "regex",
        r"\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,4})?",
        regex_judge(r"\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,4})?"),
    ),
    "ebnf": ("ebnf", 'root ::= item ("," item)*\nitem ::= "cat" | "dog" | "bird"', regex_judge(PETS)),
    "lark": ("ebnf", 'start: item ("," item)*\nitem: "cat" | "dog" | "bird"', regex_judge(PETS)),
    "choice": (
        "choice",
        ["yes", "no", "it depends on the weather"],
        choice_judge(["yes", "no", "it depends on the weather"]),
    ),
    "json_object": ("json_object", True, json_judge({"type": "object"})),
    "structural_tag": ("structural_tag", legacy_tag(PERSON), tagged_json_judge(PERSON)),
}
UNSUPPORTED = {("outlines", "ebnf"), ("outlines", "lark"), ("outlines", "structural_tag")}
BACKENDS = ("xgrammar", "llguidance", "outlines")
BUDGETS_ABOVE_MINIMUM = (0, 1, 3)
RANDOM_BUDGETS = 2
MASKBENCH_ROOT = Path(__file__).parents[1] / "data" / "maskbench"
MASKBENCH_PATHS = [path for folder in ("Github_easy", "Glaiveai2K") for path in iter_case_paths(MASKBENCH_ROOT, folder)]


@pytest.fixture(scope="module")
def search(smollm2_tokenizer: TokenizerSetup) -> EndingSearch:
    setup = smollm2_tokenizer
    return EndingSearch(tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids))


def steered_walk(
    grammar: BaseGrammarObject, key: Any, steering: BudgetSteering, budget: int, seed: int, vocab_size: int
) -> tuple[list[int], bool]:
    """One walk with ``budget`` tokens, sampled as the scheduler samples (a row within ``WATCH`` whose token steering
    refuses is sampled again, steered) by ``steering`` (shared by a constraint's walks, as a scheduler's is by its
    requests); its tokens and whether the grammar terminated (it must)."""
    params = SamplingParams(max_new_tokens=budget, temperature=1.0)
    req = Req(rid=str(seed), client_id=b"", prompt_ids=[], sampling_params=params, grammar_key=key, grammar=grammar)
    refusal = steering.refusal(req)
    assert refusal is None, refusal.message
    generator = torch.Generator().manual_seed(seed)
    mask = allocate_bitmask(1, vocab_size, "cpu")
    while len(req.output_ids) < budget and not grammar.is_terminated():
        grammar.fill_vocab_mask(mask, 0)
        logits = torch.randn(1, vocab_size, generator=generator) * 3
        logits[~unpack_bitmask(mask, vocab_size)] = float("-inf")
        steering.steer([req], [range(1)], logits, [False])
        watched = steering.watched_rows([req], [range(1)], [False])
        token = int(torch.multinomial(torch.softmax(logits[0], dim=0), 1, generator=generator))
        if steering.refused_samples([req], [range(1)], watched, logits, [token]):
            token = int(torch.multinomial(torch.softmax(logits[0], dim=0), 1, generator=generator))
        grammar.accept_token(token)
        req.output_ids.append(token)
        steering.record(req, token)
    return req.output_ids, grammar.is_terminated()


def check_budgets(
    backend: GrammarPipeline,
    setup: TokenizerSetup,
    search: EndingSearch,
    kind: str,
    spec: Any,
    judge: Judge,
    seed: int,
    require_ending: bool = True,
) -> list[str]:
    """Walks at budgets from the shortest output up; what went wrong with each that failed. The start's ending is
    searched once, by the steering the walks share (a search with a time limit, on a busy machine, may find an
    ending one time and none the next); without ``require_ending``, a constraint whose ending it does not find is
    not walked (it is not steered: nothing to check)."""
    grammar = compile_grammar(backend, kind, spec)
    assert not isinstance(grammar, InvalidGrammarObject), grammar.error_message
    key = make_grammar_key(kind, spec)
    steering = BudgetSteering(search, max_seq_len=1 << 20)
    params = SamplingParams(max_new_tokens=1 << 20)  # no budget to refuse: the start's ending alone
    start = Req(
        rid="start", client_id=b"", prompt_ids=[], sampling_params=params, grammar_key=key, grammar=grammar.copy()
    )
    assert steering.refusal(start) is None
    if start.ending is None and not require_ending:
        return []
    assert start.ending is not None, "no ending found from the start"
    ending = start.ending.tokens or []
    rng = random.Random(seed)
    budgets = [len(ending) + extra for extra in BUDGETS_ABOVE_MINIMUM]
    budgets += [len(ending) + rng.randint(0, 24) for _ in range(RANDOM_BUDGETS)]
    problems = []
    for i, budget in enumerate(budgets):
        tokens, terminated = steered_walk(grammar.copy(), key, steering, budget, seed + i, setup.vocab_size)
        text = setup.tokenizer.decode([t for t in tokens if t not in setup.eos_token_ids])
        if not terminated:
            problems.append(f"budget {budget}: cut at {len(tokens)} tokens: {text!r:.200}")
        elif (problem := judge(text)) is not None:
            problems.append(f"budget {budget}: {text!r:.200}: {problem}")
    return problems


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_steered_walks_end_valid_within_their_budget(
    backend_name: str,
    constraint: str,
    build_backend: BackendBuilder,
    smollm2_tokenizer: TokenizerSetup,
    search: EndingSearch,
) -> None:
    if (backend_name, constraint) in UNSUPPORTED:
        pytest.skip(f"{backend_name} does not take this constraint kind")
    kind, spec, judge = CONSTRAINTS[constraint]
    backend = build_backend(backend_name, smollm2_tokenizer)
    assert (
        check_budgets(
            backend, smollm2_tokenizer, search, kind, spec, judge, seed=zlib.crc32(constraint.encode()) % 1000
        )
        == []
    )


def test_shortest_output_is_found_through_the_grammar(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """The ending from the start is the constraint's shortest output, spelled in few tokens and ending in EOS."""
    backend = build_backend("xgrammar", smollm2_tokenizer)
    grammar = compile_grammar(backend, "regex", r"\(\d{3}\) \d{3}-\d{4}( ext\. \d{1,4})?")
    ending = search.find(grammar)
    assert ending is not None and ending[-1] in smollm2_tokenizer.eos_token_ids
    assert smollm2_tokenizer.tokenizer.decode(ending[:-1]) == "(000) 000-0000"
    assert search.finishes(grammar, ending)


DOUBLED = person_schema_named("9b6b22")
"""Property names with a byte twice in a row after open strings: the search once took the second ``2`` of ``9b6b22``
(one byte allowed before it and after it) for a loop and ranked it behind the strings' escapes (``\\"\\"...``),
which filled its beam; it found no ending, and the request was cut at its budget unsteered. (outlines refuses
``minimum``.)"""


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_forced_byte_twice_is_no_loop_to_the_search(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    grammar = compile_grammar(build_backend(backend_name, smollm2_tokenizer), "json", DOUBLED)
    ending = search.find(grammar)
    assert ending is not None and ending[-1] in smollm2_tokenizer.eos_token_ids
    text = smollm2_tokenizer.tokenizer.decode(ending[:-1])
    assert text == '{"name_9b6b22":"","age_9b6b22":0,"city_9b6b22":"","hobbies_9b6b22":[]}'


SLOW_MASKS = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 255}},
    "required": ["name"],
}
"""MaskBench's o26589: xgrammar's mask inside a string of ``maxLength`` 255 takes milliseconds, and the breadth-first
search once spent the whole time the walk of first moves needed (``FIRST_MOVES_SHARE``); under load, the walk's share
alone was too short (``FIRST_MOVES_MIN_MASKS``)."""


@pytest.mark.parametrize(
    "max_seconds", [MAX_SEARCH_SECONDS, MAX_SEARCH_SECONDS / 100], ids=["this-machine", "100x-slower"]
)
def test_where_masks_are_slow_the_walk_of_first_moves_still_finds_an_ending(
    max_seconds: float, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """Found within the search's bound, and found on a machine a hundred times slower (a bound a hundredth as long)."""
    grammar = compile_grammar(build_backend("xgrammar", smollm2_tokenizer), "json", SLOW_MASKS)
    ending = search.find(grammar, max_seconds=max_seconds)
    assert ending is not None and ending[-1] in smollm2_tokenizer.eos_token_ids
    assert json_judge(SLOW_MASKS)(smollm2_tokenizer.tokenizer.decode(ending[:-1])) is None


SEPARATED = {
    "docker image": "(.+/)?.+:.+",
    "email": "^.+@.+\\..+$",
    "email by classes": "^[^@]+@[^@]+\\.[a-z]+$",
    "two words": "^\\S+ \\S+$",
}
"""Patterns whose separator keeps the string's mask: ``(.+/)?.+:.+`` is MaskBench's o76476."""


@pytest.mark.parametrize("pattern", SEPARATED.values(), ids=SEPARATED.keys())
def test_a_separator_that_keeps_the_strings_mask_is_placed_by_the_search(
    pattern: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """Inside ``.+:.+`` the text before the colon and after it allow the same bytes, and a space or a lowercase letter
    comes after the walk's first ``MAX_MOVES`` moves: these constraints got no ending, and their requests went
    unsteered (cut at their budget). xgrammar keys its states: the walk of first moves takes a move to a state it has
    not met, tries a move of each kind of byte, and the quote first (a ``)`` in ``[^@]`` led it back into the
    string)."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    grammar = compile_grammar(build_backend("xgrammar", smollm2_tokenizer), "json", schema)
    ending = search.find(grammar)
    assert ending is not None and ending[-1] in smollm2_tokenizer.eos_token_ids
    assert json_judge(schema)(smollm2_tokenizer.tokenizer.decode(ending[:-1])) is None


def test_auto_backend_grammars_end_valid_within_their_budget(
    smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """``auto``'s grammars are its chosen backends' (here xgrammar for the schema, llguidance for a pattern xgrammar
    refuses): the steering walks them through the same contract."""
    setup = smollm2_tokenizer
    args = GrammarArgs(grammar_backend="auto", grammar_compile_slow_after=600.0)
    backend = create_grammar_backend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert backend is not None
    try:
        backend.wait_until_ready()
        for spec in (PERSON, AUTO_FALLBACK):
            assert check_budgets(backend, setup, search, "json", spec, json_judge(spec), seed=7) == []
    finally:
        backend.shutdown()


@pytest.mark.parametrize("backend_name", BACKENDS)
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(MASKBENCH_PATHS), seed=st.integers(0, 10_000))
def test_maskbench_schemas_end_valid_within_their_budget(
    backend_name: str,
    path: Path,
    seed: int,
    build_backend: BackendBuilder,
    smollm2_tokenizer: TokenizerSetup,
    search: EndingSearch,
) -> None:
    case = load_case(path)
    backend = build_backend(backend_name, smollm2_tokenizer)
    grammar = compile_grammar(backend, "json", case.schema)
    if isinstance(grammar, InvalidGrammarObject):
        return  # refused by this backend
    judge = json_judge(case.schema)
    assert (
        check_budgets(backend, smollm2_tokenizer, search, "json", case.schema, judge, seed, require_ending=False) == []
    )


def greedy_walk(
    grammar: BaseGrammarObject,
    key: Any,
    search: EndingSearch,
    setup: TokenizerSetup,
    preferred: list[int],
    budget: int,
    steering: BudgetSteering | None = None,
) -> str:
    """A greedy model that picks ``preferred``'s next token while the grammar and the steering allow it (the first
    allowed token after it), steered as the scheduler steers a greedy row (by ``steering``, else a new one), within
    ``budget`` tokens; its text."""
    steering = steering or BudgetSteering(search, max_seq_len=1 << 20)
    params = SamplingParams(max_new_tokens=budget, temperature=0.0)
    req = Req(rid="greedy", client_id=b"", prompt_ids=[], sampling_params=params, grammar_key=key, grammar=grammar)
    assert steering.refusal(req) is None
    mask = allocate_bitmask(1, setup.vocab_size, "cpu")
    while len(req.output_ids) < budget and not grammar.is_terminated():
        grammar.fill_vocab_mask(mask, 0)
        logits = torch.zeros(1, setup.vocab_size)
        if len(req.output_ids) < len(preferred):
            logits[0, preferred[len(req.output_ids)]] = 10.0
        logits[~unpack_bitmask(mask, setup.vocab_size)] = float("-inf")
        steering.steer([req], [range(1)], logits, [True])
        token = int(logits[0].argmax())
        grammar.accept_token(token)
        req.output_ids.append(token)
        steering.record(req, token)
    return setup.tokenizer.decode([t for t in req.output_ids if t not in setup.eos_token_ids])


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_an_ending_that_grows_a_token_at_a_time_still_fits(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """A greedy model that opens one more bracket per token: every ``[`` grows the shortest ending by one, while the
    slack is still beyond the horizon. Kept current after every token, the plan brings the steering in on time, and
    the output closes every bracket within the budget (it was cut at 30 and 44 while the plan was stale). At 70 the
    plan goes stale at once (its slack is beyond ``WATCH``) and is searched anew as the output comes within it (it was
    left stale until the horizon, and cut)."""
    setup = smollm2_tokenizer
    tokenizer = setup.tokenizer
    preferred = tokenizer.encode('{"a": ') + tokenizer.encode("[") * 64
    backend = build_backend(backend_name, setup)
    for budget in (30, 44, 70):
        grammar = compile_grammar(backend, "json_object", True)
        key = make_grammar_key("json_object", True)
        text = greedy_walk(grammar, key, search, setup, preferred, budget)
        assert grammar.is_terminated(), f"budget {budget}: cut: {text!r}"
        assert text.count("[") >= 5 and json_judge({"type": "object"})(text) is None, text


ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {name: {"type": "string"} for name in ("alpha", "beta", "gamma", "delta", "epsilon")},
        "required": ["alpha", "beta", "gamma", "delta", "epsilon"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_greedy_row_does_not_open_an_item_its_budget_cannot_close(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """A greedy model that writes item after item of five required fields: after each item the output may end in two
    tokens, but one more comma opens an item whose shortest ending is longer than the horizon. Checked within
    ``WATCH``, the greedy row closes the array instead at every budget (at some budgets the comma was taken while
    the slack was beyond the horizon, and the output was cut)."""
    setup = smollm2_tokenizer
    tokenizer = setup.tokenizer
    item = '{"alpha": "a", "beta": "b", "gamma": "c", "delta": "d", "epsilon": "e"}'
    preferred = tokenizer.encode("[" + ", ".join([item] * 6) + "]")
    backend = build_backend(backend_name, setup)
    key = make_grammar_key("json", ITEMS)
    for budget in range(len(tokenizer.encode(item)) + 4, 2 * len(tokenizer.encode(item)) + 8, 3):
        grammar = compile_grammar(backend, "json", ITEMS)
        text = greedy_walk(grammar, key, search, setup, preferred, budget)
        assert grammar.is_terminated(), f"budget {budget}: cut: {text!r}"
        assert json_judge(ITEMS)(text) is None, text


class SlowClock:
    """A clock of ``time`` that runs ``extra`` seconds further between any two readings."""

    def __init__(self, clock: Callable[[], float], extra: float) -> None:
        self.clock = clock
        self.extra = extra
        self.num_readings = 0

    def __call__(self) -> float:
        self.num_readings += 1
        return self.clock() + self.num_readings * self.extra


@pytest.mark.parametrize(
    ("clock", "extra"),
    [("thread_time", 5e-4), ("perf_counter", 5e-2)],
    ids=["a-slower-cpu", "a-busy-machine"],
)
@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_what_the_steering_allows_does_not_depend_on_the_machines_speed_or_load(
    backend_name: str,
    clock: str,
    extra: float,
    build_backend: BackendBuilder,
    smollm2_tokenizer: TokenizerSetup,
    search: EndingSearch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The searches behind the steering stop at counts of steps, not at times: on a CPU 0.5 ms slower a step, or on
    a machine so busy that the wall clock runs 50 ms further between two readings of a search (its thread waiting
    for a core), the greedy walks above take the same tokens. Stopped at 5, 20 and 50 ms, the searches found less on
    AMD EPYC Zen 3 than on Zen 5, and Zen 3 cut outputs and steered greedy answers that Zen 5 left alone; their
    safety nets on the wall clock made two servers' outputs part under the test suite's load."""
    setup = smollm2_tokenizer
    item = '{"alpha": "a", "beta": "b", "gamma": "c", "delta": "d", "epsilon": "e"}'
    walks = [
        ("json_object", True, setup.tokenizer.encode('{"a": ') + setup.tokenizer.encode("[") * 64, 44),
        ("json", ITEMS, setup.tokenizer.encode("[" + ", ".join([item] * 6) + "]"), 52),
    ]
    backend = build_backend(backend_name, setup)
    texts: dict[bool, list[str]] = {}
    for is_slow in (False, True):
        if is_slow:
            monkeypatch.setattr(time, clock, SlowClock(getattr(time, clock), extra))
        texts[is_slow] = [
            greedy_walk(
                compile_grammar(backend, kind, spec), make_grammar_key(kind, spec), search, setup, preferred, budget
            )
            for kind, spec, preferred, budget in walks
        ]
        monkeypatch.undo()
    assert texts[True] == texts[False]


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_a_plan_the_output_left_far_from_the_budget_is_found_again_without_a_search(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """With a budget of ``WATCH`` tokens and more beyond the shortest output, the plan goes stale at the model's first
    token off it, and is needed again as the output comes within ``WATCH``: a suffix of the path it last held (spelled
    anew where it starts inside a token) ends the output, where each request used to run a search of up to 20 ms
    (at 32 requests in flight, a tenth of the JSON phase's time)."""
    setup = smollm2_tokenizer
    text = '{"name": "Jonathan Livingston Seagull the Third", "age": 41, "tags": ["flying", "gulls", "sea"]}'
    preferred = setup.tokenizer.encode(text)
    backend = build_backend(backend_name, setup)
    key = make_grammar_key("json", PERSON)
    steering = BudgetSteering(search, max_seq_len=1 << 20)
    budget = len(search.find(compile_grammar(backend, "json", PERSON)) or []) + WATCH + 8
    grammar = compile_grammar(backend, "json", PERSON)
    output = greedy_walk(grammar, key, search, setup, preferred, budget, steering)
    assert grammar.is_terminated() and json_judge(PERSON)(output) is None, output
    assert output == text
    assert steering.num_searches == 0


def step_through(grammar: BaseGrammarObject, search: EndingSearch, text: bytes) -> None:
    """Accept ``text`` as the search spells it (in few pieces)."""
    tokens = search.spell(text)
    assert tokens is not None
    for token in tokens:
        grammar.accept_token(token)


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_an_ending_is_spelled_again_after_a_token_it_did_not_expect(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """The checks of the model's choices keep the plan current without a search where the output leaves it by a few
    bytes: the quote that closes a word the plan would have made longer (the rest of its text after that quote), the
    plan's text from inside its first token (``, done`` from ``",`` after a ``"`` alone), and a space that opens a
    second word of ``[A-Z][a-z]+`` (two first moves, then the plan)."""
    stop = smollm2_tokenizer.eos_token_ids[0]
    backend = build_backend(backend_name, smollm2_tokenizer)
    words = r'"[a-z]{3,20}", done'
    grammar = compile_grammar(backend, "regex", words)
    step_through(grammar, search, b'"xyz"')
    plan = [*(search.spell(b'aa", done') or []), stop]
    assert search.replay(grammar, plan, len(plan), taken=b'"') == [*(search.spell(b", done") or []), stop]
    plan = [*(search.spell(b'", done') or []), stop]
    assert not search.finishes(grammar, plan[1:]), "the test needs a plan whose first token holds the quote"
    assert search.replay(grammar, plan, len(plan)) is None
    assert search.replay(grammar, plan, len(plan), respell=True) == [*(search.spell(b", done") or []), stop]
    names = r'"[A-Z][a-z]{1,12}( [A-Z][a-z]{1,12})?", done'
    grammar = compile_grammar(backend, "regex", names)
    step_through(grammar, search, b'"Ab ')
    plan = [*(search.spell(b'", done') or []), stop]
    assert search.bridge(grammar, plan) is None
    rejoined = search.rejoin(grammar, plan)
    assert rejoined is not None and len(rejoined) == len(plan) + 2 and search.finishes(grammar, rejoined)
