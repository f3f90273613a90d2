"""The backend contract as a backend author meets it: the four per-kind compiles are what a backend must write, and a
backend that writes only those is served (cached, refusals and all) once registered."""

from __future__ import annotations

from typing import Any

import pytest
import xgrammar

from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar
from sglang_constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
    InvalidGrammarObject,
    create_grammar_backend,
    register_grammar_backend,
)
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import PERSON_SCHEMA, accepts_text, compile_grammar, compile_valid


class RegexOnlyBackend(BaseGrammarBackend):
    """A backend written against the contract alone: xgrammar for regexes, every other kind refused."""

    name = "regex-only"

    def __init__(self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos: list[int]) -> None:
        super().__init__(server_args, vocab_size)
        vocabulary = tokenizer_vocabulary(tokenizer, vocab_size, eos, server_args.vocabulary_cache_path)
        info = xgrammar.TokenizerInfo.from_vocab_and_metadata(
            list(vocabulary.decoded_vocab), vocabulary.xgrammar_metadata
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.stop_token_ids = vocabulary.stop_token_ids

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return XGrammarGrammar(self.compiler.compile_regex(key_string), self.stop_token_ids)

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self.unsupported("json")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self.unsupported("ebnf")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self.unsupported("structural_tag")


def test_a_backend_that_writes_only_its_compiles_is_served(
    clean_registry: None, smollm2_tokenizer: TokenizerSetup
) -> None:
    setup = smollm2_tokenizer
    register_grammar_backend("regex-only", RegexOnlyBackend)
    args = GrammarArgs(grammar_backend="regex-only")
    backend = create_grammar_backend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert backend is not None and backend.name == "regex-only" and not backend.can_share_grammars
    try:
        digits = compile_valid(backend, "regex", "[0-9]{3}")
        assert accepts_text(digits.copy(), setup, "123") and not accepts_text(digits, setup, "12a")
        backend.set_cache(make_grammar_key("regex", "[0-9]{3}"), digits)
        hit, is_hit = backend.get_cached_or_future_value(make_grammar_key("regex", "[0-9]{3}"))
        assert is_hit and isinstance(hit, XGrammarGrammar) and hit is not digits
        refused = compile_grammar(backend, "json", PERSON_SCHEMA)
        assert isinstance(refused, InvalidGrammarObject)
        assert refused.error_message == "the regex-only grammar backend does not support json constraints"
    finally:
        backend.shutdown()


def test_a_backend_missing_a_kind_s_compile_is_refused_naming_it() -> None:
    class NoStructuralTags(BaseGrammarBackend):
        def dispatch_json(self, key_string: str) -> BaseGrammarObject:
            return self.unsupported("json")

        def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
            return self.unsupported("regex")

        def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
            return self.unsupported("ebnf")

    with pytest.raises(TypeError, match="dispatch_structural_tag"):
        NoStructuralTags(GrammarArgs(), 1000)  # type: ignore[abstract]
