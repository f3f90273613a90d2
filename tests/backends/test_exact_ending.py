"""The shortest ending in tokens against brute force, on SmolLM2's tokenizer.

Regexes with finite languages (alternations, optional parts, repetition counts) are drawn by hypothesis together with
their languages; the brute force is the fewest vocabulary pieces spelling any string of the language, plus the stop
token. outlines-core and xgrammar key their states, so their ending is the exact minimum; llguidance does not, and its
ending is a bound at or above it that finishes the grammar. Small schemas are checked against an exhaustive search over
outlines-core's own index (every token from every state, breadth first), and xgrammar's compact JSON against it.
llguidance ends a string nothing can extend without a stop token, which the brute force counts.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.outlines.backend import OutlinesGrammar
from sglang_constrained.cache.vocabulary import TokenizerVocabulary, tokenizer_vocabulary
from sglang_constrained.endings.exact import MAX_SEARCH_STEPS, ExactEndingSearch, piece_trie
from sglang_constrained.endings.search import EndingSearch
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import compile_grammar

WORDS = ("a", "ab", "the", " b", "12", "0", "internationalization", "a b c d", "Hello world", "xyz")
"""Words whose fewest pieces and byte lengths disagree ("internationalization" is few tokens, "a b c d" many)."""


@st.composite
def finite_regexes(draw: st.DrawFn) -> tuple[str, set[str]]:
    """A regex of one to three parts, each an alternation of words, optional or repeated one to two, two to three or
    up to two times; and its language."""
    pattern, language = "", {""}
    for _ in range(draw(st.integers(1, 3))):
        words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=3, unique=True))
        quantifier = draw(st.sampled_from(("", "?", "{1,2}", "{2,3}", "{0,2}")))
        repeats = {"": (1,), "?": (0, 1), "{1,2}": (1, 2), "{2,3}": (2, 3), "{0,2}": (0, 1, 2)}[quantifier]
        pattern += "(" + "|".join(words) + ")" + quantifier
        part = {"".join(choice) for n in repeats for choice in _products(words, n)}
        language = {prefix + suffix for prefix in language for suffix in part}
    return pattern, language


def _products(words: list[str], n: int) -> list[tuple[str, ...]]:
    if n == 0:
        return [()]
    return [(word, *rest) for word in words for rest in _products(words, n - 1)]


@pytest.fixture(scope="module")
def search(smollm2_tokenizer: TokenizerSetup) -> EndingSearch:
    setup = smollm2_tokenizer
    return EndingSearch(tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids))


@pytest.fixture(scope="module")
def exact_search(smollm2_tokenizer: TokenizerSetup) -> ExactEndingSearch:
    setup = smollm2_tokenizer
    return ExactEndingSearch(tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(regex=finite_regexes())
def test_shortest_ending_matches_brute_force(
    regex: tuple[str, set[str]],
    build_backend: BackendBuilder,
    smollm2_tokenizer: TokenizerSetup,
    search: EndingSearch,
    exact_search: ExactEndingSearch,
) -> None:
    """outlines-core's and xgrammar's endings are the exact minimum wherever the exact search stays within its
    grammar steps (``MAX_SEARCH_STEPS``: about 1 in 300 of these regexes takes xgrammar past it, e.g.
    ``(a)(a|ab){2,3}(internationalization|12){2,3}`` 8,755 steps), a bound at or above it where it gives up there."""
    pattern, language = regex
    for backend_name in ("outlines", "xgrammar", "llguidance"):
        brute_force = min(ending_length(text, language, backend_name, search) for text in language)
        grammar = compile_grammar(build_backend(backend_name, smollm2_tokenizer), "regex", pattern)
        assert not isinstance(grammar, InvalidGrammarObject), grammar.error_message
        ending = search.find(grammar)
        assert ending is not None and search.finishes(grammar, ending), (backend_name, pattern)
        exact = exact_search.shortest(grammar) if backend_name != "llguidance" else None
        if exact is not None:
            assert len(ending) == len(exact) == brute_force, (backend_name, pattern, exact)
        else:
            assert backend_name == "llguidance" or exact_search.num_steps >= MAX_SEARCH_STEPS, (backend_name, pattern)
            assert len(ending) >= brute_force, (backend_name, pattern)


@pytest.mark.parametrize("backend_name", ["outlines", "xgrammar"])
def test_a_garbage_collection_does_not_cut_a_search_short(
    backend_name: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """A full collection runs in the thread that triggers it, on the clock of the search's deadline: in the suite's
    process (~630k objects) one took 0.34-0.49 s of CPU, and under load an exact search (half a second) gave up and
    found this regex's 6-token ending, not its 5. Here the first collection the search would trigger costs 0.6 s of
    its thread's CPU."""
    grammar = compile_grammar(build_backend(backend_name, smollm2_tokenizer), "regex", "(a){2,3}(ab|xyz|12)(ab){2,3}")
    searching, costs = threading.get_ident(), [0.6]
    fill_vocab_mask = grammar.fill_vocab_mask

    def filling(*args: Any) -> None:  # the search is under way once it reads a mask
        gc.callbacks.append(costly_collection)
        grammar.fill_vocab_mask = fill_vocab_mask  # type: ignore[method-assign]
        fill_vocab_mask(*args)

    def costly_collection(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.get_ident() == searching and costs:
            cost, started = costs.pop(), time.thread_time()
            while time.thread_time() - started < cost:
                pass

    grammar.fill_vocab_mask = filling  # type: ignore[method-assign]
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        ending = search.find(grammar)
    finally:
        if costly_collection in gc.callbacks:
            gc.callbacks.remove(costly_collection)
        gc.set_threshold(*thresholds)
    assert ending is not None and len(ending) == 5, smollm2_tokenizer.tokenizer.decode(ending or [])


def test_searches_over_one_vocabulary_share_its_trie_and_free_it_with_it() -> None:
    """Every scheduler on a tokenizer (its vocabulary object) builds the trie of pieces once, not at each one's first
    request (~0.3 s of the loop at 49k tokens, ~1.9 s at 248k); a vocabulary dropped takes its trie with it."""
    vocabulary = TokenizerVocabulary((b"a", b"b", b"ab", b""), 4, 4, (3,), frozenset({3}), "")
    first, second = ExactEndingSearch(vocabulary), ExactEndingSearch(vocabulary)
    assert first.is_walkable and second.is_walkable
    trie = weakref.ref(piece_trie(vocabulary))
    assert piece_trie(vocabulary) is trie()
    del first, second, vocabulary
    gc.collect()
    assert trie() is None


def ending_length(text: str, language: set[str], backend_name: str, search: EndingSearch) -> int:
    """Fewest tokens for ``text``: its fewest pieces, and a stop token unless llguidance ends by itself (no string
    of the language goes on from ``text``)."""
    spelling = search.spell(text.encode())
    assert spelling is not None
    goes_on = any(len(other) > len(text) and other.startswith(text) for other in language)
    ends_by_itself = backend_name == "llguidance" and not goes_on
    return len(spelling) + (0 if ends_by_itself else 1)


def index_shortest(grammar: OutlinesGrammar, eos_token_ids: list[int]) -> int:
    """Fewest tokens to a stop token from the start, breadth first over every token of every state of the index."""
    index = grammar.compiled.index
    start = index.get_initial_state()
    depth = {start: 0}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if index.is_final_state(state):
            return depth[state] + 1
        for token in index.get_allowed_tokens(state):
            after = index.get_next_state(state, token)
            if token not in eos_token_ids and after is not None and after not in depth:
                depth[after] = depth[state] + 1
                queue.append(after)
    raise AssertionError("no final state")


SMALL_SCHEMAS: list[Any] = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "array", "items": {"enum": ["internationalization", "a b c"]}, "minItems": 2},
    {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "y"]}}, "required": ["n", "tag"]},
]


@pytest.mark.parametrize("schema", SMALL_SCHEMAS)
def test_schema_ending_matches_an_exhaustive_search_of_the_index(
    schema: Any, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    grammar = compile_grammar(build_backend("outlines", smollm2_tokenizer), "json", schema)
    assert isinstance(grammar, OutlinesGrammar)
    ending = search.find(grammar)
    assert ending is not None and search.finishes(grammar, ending)
    assert len(ending) == index_shortest(grammar, smollm2_tokenizer.eos_token_ids)


NESTED = 'root ::= "a" X "b" | "c" X "ddd"\nX ::= "internationalization" | "a b c d" | "(" X ")"'
"""Recursive: after ``c((`` the end is an innermost word, ``))`` and ``ddd`` (the same rows print after ``a((``)."""


@pytest.mark.parametrize("prefix", ["", "c", "c((", "a(((", "c((internationalization)"])
def test_xgrammar_ending_in_a_recursive_grammar_matches_brute_force(
    prefix: str, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    grammar = compile_grammar(build_backend("xgrammar", smollm2_tokenizer), "ebnf", NESTED)
    prefix_tokens = search.spell(prefix.encode())
    assert prefix_tokens is not None
    for token in prefix_tokens:
        grammar.accept_token(token)
    ending = search.find(grammar)
    assert ending is not None and search.finishes(grammar, ending)
    texts = [text for text in nested_texts(5) if text.startswith(prefix)]
    assert len(ending) == min(ending_length(text[len(prefix) :], {text}, "xgrammar", search) for text in texts)


def nested_texts(depth: int) -> list[str]:
    """NESTED's language up to ``depth`` parentheses: deeper only adds bytes to an ending."""
    inner = [f"{'(' * d}{word}{')' * d}" for d in range(depth + 1) for word in ("internationalization", "a b c d")]
    return [f"a{x}b" for x in inner] + [f"c{x}ddd" for x in inner]


COMPACT_SCHEMAS: list[Any] = [
    *SMALL_SCHEMAS[:2],
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"q": {"enum": ["a b c d", "internationalization"]}},
                "required": ["q"],
            }
        },
        "required": ["p"],
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 4},
]


@pytest.mark.parametrize("schema", COMPACT_SCHEMAS)
def test_xgrammar_compact_json_ending_matches_an_exhaustive_search(
    schema: Any, build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, search: EndingSearch
) -> None:
    """xgrammar's schemas without whitespace against outlines-core's index searched exhaustively (the two languages
    share their shortest strings); whitespace between tokens makes xgrammar's search give up (its bound stays)."""
    outlines = compile_grammar(build_backend("outlines", smollm2_tokenizer), "json", schema)
    assert isinstance(outlines, OutlinesGrammar)
    xgrammar = compile_grammar(
        build_backend("xgrammar", smollm2_tokenizer, constrained_json_disable_any_whitespace=True), "json", schema
    )
    ending = search.find(xgrammar)
    assert ending is not None and search.finishes(xgrammar, ending)
    assert len(ending) == index_shortest(outlines, smollm2_tokenizer.eos_token_ids)
