"""Jump-forward and drafts on every backend, proved by walking the mask: a forced token is exactly the one token the
mask allows, and every draft is a token sequence the grammar accepts, leaving its state where it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from scheduler.io_struct import SamplingParams
from scheduler.ngram_cache import NgramCache
from scheduler.request import Req
from scheduler.speculative import NGRAM_MAX, NGRAM_MIN_CONTEXT, NO_DRAFTS, DraftProposer, prompt_lookup
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import allowed_tokens, encode_exactly

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"enum": ["Paris", "Lima"]}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
OUTPUT = '{"name": "Ana", "city": "Lima", "age": 31}'


def walk_with_proposer(grammar: BaseGrammarObject, setup: TokenizerSetup, proposer: DraftProposer) -> None:
    """Along ``OUTPUT``'s tokens and after them: at each state compare the forced token with the mask and check
    the drafts."""
    prompt = encode_exactly(setup, f"Answer as JSON. Example: {OUTPUT}")
    req = Req(rid="r", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
    for token in encode_exactly(setup, OUTPUT):
        allowed = assert_forced_token_is_the_mask_s_only_token(grammar, setup, proposer)
        drafts = proposer.propose([req], [[token]], [8])[0]
        assert len(drafts.token_ids) <= 8 and len(drafts.sources) == len(drafts.token_ids)
        assert grammar.validate_tokens(drafts.token_ids) == len(drafts.token_ids)
        assert allowed_tokens(grammar, setup.vocab_size) == allowed  # proposing changed nothing
        grammar.accept_token(token)
        req.output_ids.append(token)
    assert_forced_token_is_the_mask_s_only_token(grammar, setup, proposer)


def assert_forced_token_is_the_mask_s_only_token(
    grammar: BaseGrammarObject, setup: TokenizerSetup, proposer: DraftProposer
) -> set[int]:
    allowed = allowed_tokens(grammar, setup.vocab_size)
    assert proposer.forced_token(grammar) == (next(iter(allowed)) if len(allowed) == 1 else None)
    return allowed


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance", "outlines"])
def test_forced_tokens_and_drafts_follow_the_mask(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, backend_name: str
) -> None:
    backend = build_backend(backend_name, smollm2_tokenizer)
    grammar = compile_grammar(backend, make_grammar_key("json", SCHEMA))
    proposer = DraftProposer("grammar+ngram", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size)
    walk_with_proposer(grammar, smollm2_tokenizer, proposer)


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance", "outlines"])
def test_a_finished_choice_forces_the_stop_token(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, backend_name: str
) -> None:
    backend = build_backend(backend_name, smollm2_tokenizer)
    grammar = compile_grammar(backend, make_grammar_key("choice", ["Lima", "Oslo"]))
    proposer = DraftProposer("grammar", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size)
    for token in encode_exactly(smollm2_tokenizer, "Lima"):
        grammar.accept_token(token)
    assert proposer.forced_token(grammar) == smollm2_tokenizer.eos_token_ids[0]


def test_grammar_drafts_are_the_forced_text_less_its_last_token(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    backend = build_backend("xgrammar", smollm2_tokenizer)
    grammar = compile_grammar(backend, make_grammar_key("regex", r"The answer is: (yes|no)"))
    proposer = DraftProposer("grammar", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size)
    req = Req(rid="r", client_id=b"c", prompt_ids=[1, 2, 3], sampling_params=SamplingParams(), grammar=grammar)
    drafts = proposer.propose([req], [[1]], [8])[0]
    forced_text_tokens = smollm2_tokenizer.encode("The answer is: ")
    assert drafts.token_ids == forced_text_tokens[:-1] and set(drafts.sources) == {"grammar"}


def test_prompt_lookup_drafts_that_leave_the_grammar_are_cut(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    backend = build_backend("xgrammar", smollm2_tokenizer)
    grammar = compile_grammar(backend, make_grammar_key("regex", r"[0-9]+ apples"))
    proposer = DraftProposer("ngram", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size)
    prompt = smollm2_tokenizer.encode("12 apples and 12 pears, then 12 pears again")
    output = smollm2_tokenizer.encode("12")
    for token in output:
        grammar.accept_token(token)
    req = Req(rid="r", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
    req.output_ids = list(output)
    _, looked_up = prompt_lookup(prompt + output, 8)
    assert looked_up and smollm2_tokenizer.tokenizer.decode(looked_up).startswith(" pears")  # the latest match
    drafts = proposer.propose([req], [output[-1:]], [8])[0]
    assert len(drafts.token_ids) < len(looked_up)
    assert grammar.validate_tokens(drafts.token_ids) == len(drafts.token_ids)


def test_a_batch_of_lookup_max_batch_requests_takes_only_the_grammar_s_drafts(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    """Below the runner's ``lookup_max_batch`` every request of a batch drafts from prompt lookup too; from it on,
    only from the grammar (lookups are right less often than a batch's extra rows cost)."""
    backend = build_backend("xgrammar", smollm2_tokenizer)
    proposer = DraftProposer(
        "grammar+ngram", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, lookup_max_batch=4
    )
    prompt = smollm2_tokenizer.encode("12 apples and 12 pears, then 12 pears again")
    output = smollm2_tokenizer.encode("12")

    def sources(batch_size: int) -> set[str]:
        batch = []
        for i in range(batch_size):
            grammar = compile_grammar(backend, make_grammar_key("regex", r"[0-9]+ (apples|pears)( again)?"))
            for token in output:
                grammar.accept_token(token)
            req = Req(rid=f"r{i}", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
            req.output_ids = list(output)
            batch.append(req)
        drafts = proposer.propose(batch, [output[-1:]] * batch_size, [8] * batch_size)
        return {source for proposal in drafts for source in proposal.sources}

    assert sources(3) == {"ngram"}
    assert sources(4) <= {"grammar", "follower"}


def test_the_ngram_cache_drafts_what_earlier_outputs_agreed_on_cut_by_the_grammar(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    backend = build_backend("xgrammar", smollm2_tokenizer)
    cache = NgramCache(capacity=1000, max_ngram=4, max_continuation=8)
    proposer = DraftProposer("ngram", 8, smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, ngram_cache=cache)
    prompt = smollm2_tokenizer.encode("Count the fruit in the basket for me, please.")
    for rid, answer in (("a", "12 apples and 3 pears"), ("b", "12 apples and 3 pears, I think")):
        earlier = Req(rid=rid, client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams())
        earlier.output_ids = smollm2_tokenizer.encode(answer)
        proposer.record(earlier, NO_DRAFTS, 0)
        proposer.forget(earlier)  # finished: the cache takes all of its output
    assert len(cache) > 0
    grammar = compile_grammar(backend, make_grammar_key("regex", r"[0-9]+ apples"))
    output = smollm2_tokenizer.encode("12")
    for token in output:
        grammar.accept_token(token)
    req = Req(rid="c", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
    req.output_ids = list(output)
    assert prompt_lookup(prompt + output, 8) == (0, [])  # nothing in this request to look up
    drafts = proposer.propose([req], [output[-1:]], [8])[0]
    assert set(drafts.sources) == {"ngram_cache"}
    assert smollm2_tokenizer.tokenizer.decode(drafts.token_ids) == " apples"  # " and 3 pears" cut by the grammar
    assert grammar.validate_tokens(drafts.token_ids) == len(drafts.token_ids)


def test_prompt_lookup_finds_the_latest_longest_match() -> None:
    assert prompt_lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], 4) == (3, [4, 5, 6, 7])
    assert prompt_lookup([5, 1, 9, 9, 9, 9, 9, 9, 2, 1], 2) == (1, [9, 9])
    assert prompt_lookup(list(range(20)), 3) == (0, [])  # no earlier occurrence of any suffix
    assert prompt_lookup([1, 2, 3], 3) == (0, [])  # too little context


def _latest_longest_match(context: list[int], max_tokens: int) -> tuple[int, list[int]]:
    """prompt_lookup's definition, window by window."""
    if max_tokens <= 0 or len(context) < NGRAM_MIN_CONTEXT:
        return 0, []
    for n in range(NGRAM_MAX, 0, -1):
        starts = [i for i in range(len(context) - n) if context[i : i + n] == context[-n:]]
        if starts:
            return n, context[starts[-1] + n : starts[-1] + n + max_tokens]
    return 0, []


@given(st.lists(st.integers(0, 5), max_size=60), st.integers(0, 10))
def test_prompt_lookup_is_the_latest_longest_earlier_match(context: list[int], max_tokens: int) -> None:
    # a small alphabet: suffixes recur, at every length up to NGRAM_MAX and past it
    assert prompt_lookup(context, max_tokens) == _latest_longest_match(context, max_tokens)


def test_nothing_is_forced_while_a_reasoner_thinks(
    build_backend: BackendBuilder, qwen35_tokenizer: TokenizerSetup
) -> None:
    from sglang_constrained.backends.reasoner import ReasonerGrammarObject, think_end_token_id

    backend = build_backend("xgrammar", qwen35_tokenizer)
    inner = compile_grammar(backend, make_grammar_key("regex", r"7"))  # Qwen splits digits: one token
    think_end = think_end_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    assert think_end is not None
    grammar = ReasonerGrammarObject(inner, think_end)
    proposer = DraftProposer("grammar", 8, qwen35_tokenizer.tokenizer, qwen35_tokenizer.vocab_size)
    assert proposer.forced_token(grammar) is None  # thinking: every token is allowed
    grammar.accept_token(think_end)
    forced = proposer.forced_token(grammar)
    assert forced is not None and qwen35_tokenizer.tokenizer.decode([forced]) == "7"
    assert torch.tensor(sorted(allowed_tokens(grammar, qwen35_tokenizer.vocab_size))).tolist() == [forced]


def test_a_draft_run_crosses_the_think_end_where_the_thinking_budget_runs_out(
    build_backend: BackendBuilder, qwen35_tokenizer: TokenizerSetup
) -> None:
    from sglang_constrained.backends.reasoner import ReasonerGrammarObject, think_end_token_id

    think_end = think_end_token_id(qwen35_tokenizer.tokenizer, "qwen3")
    assert think_end is not None
    inner = compile_grammar(build_backend("xgrammar", qwen35_tokenizer), make_grammar_key("regex", "ANSWER: (yes|no)"))
    grammar = ReasonerGrammarObject(inner, think_end, thinking_budget=3)
    thought = encode_exactly(qwen35_tokenizer, " red green blue red green blue")
    prompt = encode_exactly(qwen35_tokenizer, "Think about colours: red green blue red green blue, then answer.")
    req = Req(rid="r", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
    req.output_ids = thought[:1]
    grammar.accept_token(thought[0])
    proposer = DraftProposer("grammar+ngram", 8, qwen35_tokenizer.tokenizer, qwen35_tokenizer.vocab_size)
    drafts = proposer.propose([req], [thought[:1]], [8])[0]
    # prompt lookup drafts the two thinking tokens the budget has left, then the grammar drafts the think-end token
    # and the answer's forced start ("ANSWER: " less its last token)
    assert drafts.token_ids[:3] == [*thought[1:3], think_end]
    assert drafts.sources[:3] == ["ngram", "ngram", "grammar"]
    assert qwen35_tokenizer.tokenizer.decode(drafts.token_ids[3:]) == "ANSWER:"
    assert grammar.validate_tokens(drafts.token_ids) == len(drafts.token_ids) and grammar.num_accepted == 1


def test_lookup_drafts_fill_the_forward_s_row_tile_and_the_grammar_s_go_past_it(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    """On block weights a row past the row tile starts another tile of every matmul (~0.4 of a decode step on Q4_1):
    lookup drafts fill the rows up to the runner's ``lookup_row_tile`` multiple, over the whole batch, and stop;
    the grammar's forced text, which mostly stands, goes past it, and lookups then fill the tile it opened (and no
    more)."""
    setup = smollm2_tokenizer
    prompt = setup.encode("alpha beta gamma delta epsilon zeta eta theta iota kappa, then alpha beta gamma delta")
    output = setup.encode(" alpha beta")

    def drafts(batch_size: int, lookup_row_tile: int | None, regex: str | None = None) -> list[list[str]]:
        proposer = DraftProposer("grammar+ngram", 8, setup.tokenizer, setup.vocab_size, lookup_row_tile=lookup_row_tile)
        batch = []
        for i in range(batch_size):
            grammar = None
            if regex is not None:
                grammar = compile_grammar(build_backend("xgrammar", setup), make_grammar_key("regex", regex))
            req = Req(rid=f"r{i}", client_id=b"c", prompt_ids=prompt, sampling_params=SamplingParams(), grammar=grammar)
            req.output_ids = list(output)
            batch.append(req)
        proposals = proposer.propose(batch, [output[-1:]] * batch_size, [8] * batch_size)
        return [proposal.sources for proposal in proposals]

    assert drafts(1, None) == [["ngram"] * 4]  # the adaptive prompt-lookup length's start
    assert drafts(1, 4) == [["ngram"] * 3]  # 1 pending row + 3 drafts: one tile
    assert drafts(3, 4) == [["ngram"], [], []]  # 3 pending rows + 1 draft
    assert drafts(1, 2) == [["ngram"]]
    forced_then_open = r" gamma delta epsilon zeta eta( [a-z]+)*"
    past_the_tile = drafts(1, 4, forced_then_open)[0]
    num_forced = past_the_tile.count("grammar")
    assert num_forced >= 4 and past_the_tile == ["grammar"] * num_forced + ["ngram"] * (3 - num_forced % 4)
    assert drafts(1, None, forced_then_open)[0] == ["grammar"] * num_forced + ["ngram"] * min(4, 8 - num_forced)
