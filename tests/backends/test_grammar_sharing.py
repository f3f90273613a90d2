"""Grammars compiled once and shared (``--dp-size``, ``--tp-size``): every built-in backend's export imports into
another backend instance as a grammar that allows exactly what the compiled one allows; rank 0's store compiles each
key once and a replica's backend, which compiles nothing itself, gets valid grammars and compile errors from it and
caches both; ranks in lockstep take each grammar in the same turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace

import pytest

from scheduler.server_args import ServerArgs
from scheduler.shared_grammars import GrammarStore, SharedGrammars
from sglang_constrained.backends.base import InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BACKEND_CLASSES
from tests.helpers import PERSON_SCHEMA, accepts_text, allowed_tokens, compile_grammar, encode_exactly, wait_published

INSTANCE = '{"name": "Ada", "age": 36}'
BAD_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}


def new_backend(name: str, setup: TokenizerSetup, server_args: ServerArgs) -> GrammarPipeline:
    args = replace(server_args.grammar, grammar_backend=name)
    return GrammarPipeline(BACKEND_CLASSES[name](args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids))


@pytest.fixture(scope="module", params=sorted(BACKEND_CLASSES))
def two_backends(
    request: pytest.FixtureRequest, smollm2_tokenizer: TokenizerSetup, server_args: ServerArgs
) -> Iterator[tuple[GrammarPipeline, GrammarPipeline]]:
    """A backend that compiles (rank 0's) and another that will only import, as another process's would."""
    compiling = new_backend(request.param, smollm2_tokenizer, server_args)
    importing = new_backend(request.param, smollm2_tokenizer, server_args)
    yield compiling, importing
    compiling.shutdown()
    importing.shutdown()


def test_an_imported_grammar_allows_what_the_compiled_one_allows(
    two_backends: tuple[GrammarPipeline, GrammarPipeline], smollm2_tokenizer: TokenizerSetup
) -> None:
    compiling, importing = two_backends
    assert compiling.can_share_grammars
    compiled = compile_grammar(compiling, "json", PERSON_SCHEMA)
    imported = importing.import_grammar(compiling.export_grammar(compiled))
    assert type(imported) is type(compiled)
    assert imported.grammar_stats == compiled.grammar_stats
    vocab_size = smollm2_tokenizer.vocab_size
    for token in encode_exactly(smollm2_tokenizer, INSTANCE):
        assert allowed_tokens(imported, vocab_size) == allowed_tokens(compiled, vocab_size)
        imported.accept_token(token)
        compiled.accept_token(token)
    assert imported.is_terminated() == compiled.is_terminated()
    assert accepts_text(imported.copy(), smollm2_tokenizer, INSTANCE)


def test_a_compile_error_exports_as_itself(two_backends: tuple[GrammarPipeline, GrammarPipeline]) -> None:
    compiling, importing = two_backends
    invalid = compile_grammar(compiling, "json", BAD_SCHEMA)
    assert isinstance(invalid, InvalidGrammarObject)
    imported = importing.import_grammar(compiling.export_grammar(invalid))
    assert isinstance(imported, InvalidGrammarObject) and imported.error_message == invalid.error_message


def test_the_store_compiles_once_and_a_replica_caches_what_it_publishes(
    smollm2_tokenizer: TokenizerSetup, server_args: ServerArgs
) -> None:
    compiling = new_backend("llguidance", smollm2_tokenizer, server_args)
    replica = new_backend("llguidance", smollm2_tokenizer, server_args)
    store = GrammarStore(compiling, server_args.grammar)
    shared = SharedGrammars(replica)
    try:
        schema = {**PERSON_SCHEMA, "title": "shared once"}
        key = make_grammar_key("json", json.dumps(schema))
        waiting, is_hit = replica.get_cached_or_future_value(key)
        assert not is_hit and isinstance(waiting, Future)
        assert shared.take_asks() == [key], "the replica asks rank 0 instead of compiling"
        store.prefetch(key)  # as the router does when it routes the request
        store.ask(key)  # the replica's ask, while the compile runs: no second compile
        shared.receive(wait_published(store))
        grammar = waiting.result(timeout=5)
        assert not isinstance(grammar, InvalidGrammarObject)
        assert accepts_text(grammar, smollm2_tokenizer, INSTANCE)
        assert replica.get_cached_or_future_value(key)[1], "the published grammar is cached on the replica"
        store.prefetch(key)
        assert store.take_published() == [] and store.service.num_compilations == 1

        bad_key = make_grammar_key("json", json.dumps(BAD_SCHEMA))
        store.prefetch(bad_key)  # routed to another replica: this one only hears of it
        shared.receive(wait_published(store))
        cached_error, is_hit = replica.get_cached_or_future_value(bad_key)
        assert is_hit and isinstance(cached_error, InvalidGrammarObject)
        assert "missing" in cached_error.error_message
        assert store.service.num_compilations == 2
        assert 'sglang:grammar_shared_compiles_total{constraint="json"} 2.0' in store.render_metrics()
    finally:
        shared.cancel()
        store.shutdown()
        compiling.shutdown()
        replica.shutdown()


def test_ranks_in_lockstep_take_rank_0s_grammar_in_the_same_turn_and_compile_nothing(
    smollm2_tokenizer: TokenizerSetup, server_args: ServerArgs
) -> None:
    """``--tp-size``: rank 0's miss asks its store at once, the other rank's asks nothing (rank 0 missed the same key);
    one publication settles and caches the grammar on both, so their caches stay alike and both hold the grammar
    rank 0's backend chose."""
    leader = new_backend("llguidance", smollm2_tokenizer, server_args)
    follower = new_backend("llguidance", smollm2_tokenizer, server_args)
    store = GrammarStore(leader, server_args.grammar)
    ranks = [SharedGrammars(leader, store.ask), SharedGrammars(follower, lambda key: None)]
    try:
        key = make_grammar_key("json", json.dumps({**PERSON_SCHEMA, "title": "lockstep"}))
        waiting = [rank.backend.get_cached_or_future_value(key)[0] for rank in ranks]
        assert all(isinstance(future, Future) for future in waiting)
        assert [rank.take_asks() for rank in ranks] == [[], []], "rank 0 asked its store at once"
        published = wait_published(store)
        assert not any(future.done() for future in waiting), "nothing is settled before the turn's exchange"
        for rank in ranks:
            rank.receive(published)
        grammars = [future.result(timeout=0) for future in waiting]
        for grammar in grammars:
            assert accepts_text(grammar, smollm2_tokenizer, INSTANCE)
        assert grammars[0].grammar_stats == grammars[1].grammar_stats
        assert all(rank.backend.get_cached_or_future_value(key)[1] for rank in ranks)
        assert store.service.num_compilations == 1
        assert leader.compile_service.num_compilations == follower.compile_service.num_compilations == 0
    finally:
        for rank in ranks:
            rank.cancel()
        store.shutdown()
        leader.shutdown()
        follower.shutdown()
