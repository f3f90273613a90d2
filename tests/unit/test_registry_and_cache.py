"""The backend registry and the backend-level cache: registration, dedup of in-flight compiles, copies."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from scheduler.server_args import GrammarArgs, parse_server_args
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    InvalidGrammarObject,
    available_grammar_backends,
    create_grammar_backend,
    register_grammar_backend,
)
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup

SCHEMA_KEY = make_grammar_key("json", {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


class CountingBackend(XGrammarGrammarBackend):
    """The xgrammar backend, counting its dispatches and able to hold them until released."""

    name = "counting"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.num_dispatches = 0
        self.release = threading.Event()
        self.release.set()

    def dispatch_json(self, key_string: str) -> Any:
        self.num_dispatches += 1
        self.release.wait(timeout=30)
        return super().dispatch_json(key_string)


@pytest.fixture(scope="module")
def counting(smollm2_tokenizer: TokenizerSetup) -> Iterator[GrammarPipeline]:
    backend = GrammarPipeline(
        CountingBackend(
            GrammarArgs(), smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids
        )
    )
    yield backend
    backend.shutdown()


def make(setup: TokenizerSetup, **changes: Any) -> GrammarPipeline | None:
    return create_grammar_backend(GrammarArgs(**changes), setup.tokenizer, setup.vocab_size, setup.eos_token_ids)


def test_registered_name_wins_over_the_builtin(clean_registry: None, smollm2_tokenizer: TokenizerSetup) -> None:
    register_grammar_backend("xgrammar", CountingBackend)
    backend = make(smollm2_tokenizer, grammar_backend="xgrammar")
    assert backend is not None and isinstance(backend.backend, CountingBackend)
    backend.shutdown()


def test_a_registered_backend_is_a_valid_choice(clean_registry: None, smollm2_tokenizer: TokenizerSetup) -> None:
    with pytest.raises(ValueError, match="unknown grammar backend 'counting'"):
        GrammarArgs(grammar_backend="counting")
    register_grammar_backend("counting", CountingBackend)
    assert "counting" in available_grammar_backends()
    assert parse_server_args(["--grammar-backend", "counting"]).grammar.grammar_backend == "counting"
    backend = make(smollm2_tokenizer, grammar_backend="counting")
    assert backend is not None and isinstance(backend.backend, CountingBackend)
    backend.shutdown()


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines", "auto"])
def test_what_sglang_code_gets_is_a_backend_with_sglangs_interface(
    name: str, smollm2_tokenizer: TokenizerSetup
) -> None:
    """Code written against SGLang checks its class and compiles per kind at once, or through the cache."""
    backend = make(smollm2_tokenizer, grammar_backend=name)
    assert backend is not None and isinstance(backend, BaseGrammarBackend)
    try:
        grammar = backend.dispatch_regex("(yes|no)")
        assert not isinstance(grammar, InvalidGrammarObject)
        for token in smollm2_tokenizer.tokenizer.encode("yes", add_special_tokens=False):
            grammar.accept_token(token)
        grammar.accept_token(smollm2_tokenizer.eos_token_ids[0])
        assert grammar.is_terminated()
        refused = backend.dispatch_json('{"type": "string", "minLength": 3, "maxLength": 2}')
        assert isinstance(refused, InvalidGrammarObject) and refused.error_message
        value, cache_hit = backend.get_cached_or_future_value(("regex", "(yes|no)"))
        assert not cache_hit
        compiled = value if isinstance(value, BaseGrammarObject) else value.result(timeout=60)
        backend.set_cache(("regex", "(yes|no)"), compiled)
        assert backend.get_cached_or_future_value(("regex", "(yes|no)"))[1]
        backend.reset()
        assert not backend.get_cached_or_future_value(("regex", "(yes|no)"))[1]
    finally:
        backend.shutdown()


def test_engines_are_imported_only_when_their_backend_is_built() -> None:
    probe = (
        "import sys, sglang_constrained; print(sorted(m for m in ('llguidance', 'outlines_core') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


@pytest.mark.parametrize("name", ["", "none"])
def test_reserved_names_cannot_be_registered(name: str) -> None:
    with pytest.raises(ValueError, match="cannot register"):
        register_grammar_backend(name, CountingBackend)


def test_none_builds_no_backend(smollm2_tokenizer: TokenizerSetup) -> None:
    assert make(smollm2_tokenizer, grammar_backend="none") is None


def test_two_misses_on_one_key_share_one_compilation(counting: GrammarPipeline) -> None:
    counting.reset()
    counting.backend.release.clear()
    before = counting.backend.num_dispatches
    first, first_hit = counting.get_cached_or_future_value(SCHEMA_KEY)
    second, second_hit = counting.get_cached_or_future_value(SCHEMA_KEY)
    counting.backend.release.set()
    assert not first_hit and not second_hit
    assert isinstance(first, Future) and isinstance(second, Future)
    one, two = first.result(timeout=60), second.result(timeout=60)
    assert counting.backend.num_dispatches - before == 1
    assert one is not two  # each request gets its own grammar state


def test_a_hit_is_an_independent_copy(counting: GrammarPipeline, smollm2_tokenizer: TokenizerSetup) -> None:
    counting.reset()
    counting.set_cache(SCHEMA_KEY, compile_grammar(counting, SCHEMA_KEY))
    first, hit = counting.get_cached_or_future_value(SCHEMA_KEY)
    second, _ = counting.get_cached_or_future_value(SCHEMA_KEY)
    assert hit and isinstance(first, BaseGrammarObject) and isinstance(second, BaseGrammarObject)
    for token in smollm2_tokenizer.encode('{"n": 1'):
        first.accept_token(token)
    assert _allowed_count(second, smollm2_tokenizer.vocab_size) != _allowed_count(first, smollm2_tokenizer.vocab_size)
    assert second.grammar_stats is not None and second.grammar_stats.is_cache_hit


def test_compile_failures_are_cached_with_their_message(counting: GrammarPipeline) -> None:
    counting.reset()
    key = make_grammar_key("regex", "(unclosed")
    failed = compile_grammar(counting, key)
    assert isinstance(failed, InvalidGrammarObject) and failed.error_message
    counting.set_cache(key, failed)
    cached, hit = counting.get_cached_or_future_value(key)
    assert hit and cached is failed


def test_the_cache_evicts_the_least_recently_used(smollm2_tokenizer: TokenizerSetup) -> None:
    backend = make(smollm2_tokenizer, grammar_cache_max_entries=2)
    assert backend is not None
    keys = [make_grammar_key("regex", f"a{{{n}}}") for n in (1, 2, 3)]
    for key in keys:
        backend.set_cache(key, compile_grammar(backend, key))
    assert [backend.get_cached_or_future_value(k)[1] for k in keys[1:]] == [True, True]
    assert backend.get_cached_or_future_value(keys[0])[1] is False
    backend.shutdown()


def test_the_byte_bound_counts_compiled_sizes(smollm2_tokenizer: TokenizerSetup) -> None:
    backend = make(smollm2_tokenizer, grammar_cache_max_bytes=1)
    assert backend is not None
    grammar = compile_grammar(backend, SCHEMA_KEY)
    assert grammar.memory_size_bytes() > 1
    backend.set_cache(SCHEMA_KEY, grammar)
    assert backend.get_cached_or_future_value(SCHEMA_KEY)[1] is False
    backend.shutdown()


def _allowed_count(grammar: BaseGrammarObject, vocab_size: int) -> int:
    mask = grammar.allocate_vocab_mask(vocab_size, 1, "cpu")
    grammar.fill_vocab_mask(mask, 0)
    return int(sum(bin(word & 0xFFFFFFFF).count("1") for word in mask[0].tolist()))


def test_masks_start_all_allowed() -> None:
    mask = InvalidGrammarObject("x").allocate_vocab_mask(100, 2, "cpu")
    assert mask.shape == (2, 4) and mask.dtype == torch.int32 and bool((mask == -1).all())
