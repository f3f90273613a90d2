"""Check a backend against cases of known answer: valid texts are accepted to their end, invalid ones rejected.

Shared by the conformance test suite and ``scripts/conformance_report.py``, so that the figures the script
prints are the ones the tests assert on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.constraint_spec import GrammarKey
from sglang_constrained.text_acceptance import walk_tokens
from sglang_constrained.tokenizer_loading import TokenizerSetup


@dataclass
class ConformanceResult:
    """Outcome of one constraint: did it compile, and which texts were wrongly rejected or accepted."""

    name: str
    compile_error: str | None = None
    num_valid: int = 0
    num_valid_accepted: int = 0
    num_invalid: int = 0
    num_invalid_rejected: int = 0
    wrongly_rejected: list[str] = field(default_factory=list)
    wrongly_accepted: list[str] = field(default_factory=list)

    @property
    def compiled(self) -> bool:
        return self.compile_error is None


def compile_grammar(backend: BaseGrammarBackend, key: GrammarKey) -> BaseGrammarObject:
    """The grammar for ``key``, waiting for its compile (a fresh object each call)."""
    value, _ = backend.get_cached_or_future_value(key)
    return value if isinstance(value, BaseGrammarObject) else value.result()


def check_constraint(
    backend: BaseGrammarBackend,
    setup: TokenizerSetup,
    name: str,
    key: GrammarKey,
    valid_texts: tuple[str, ...] | list[str],
    invalid_texts: tuple[str, ...] | list[str],
) -> ConformanceResult:
    """Compile ``key`` once, then walk every text through a fresh copy of the grammar."""
    result = ConformanceResult(name, num_valid=len(valid_texts), num_invalid=len(invalid_texts))
    grammar = compile_grammar(backend, key)
    if isinstance(grammar, InvalidGrammarObject):
        result.compile_error = grammar.error_message
        return result
    forbidden = setup.forbidden_token_ids
    for text in valid_texts:
        walk = walk_tokens(grammar.copy(), setup.encode(text), setup.vocab_size, setup.eos_token_ids, forbidden)
        if walk.is_accepted:
            result.num_valid_accepted += 1
        else:
            result.wrongly_rejected.append(text)
    for text in invalid_texts:
        walk = walk_tokens(grammar.copy(), setup.encode(text), setup.vocab_size, setup.eos_token_ids, forbidden)
        if walk.is_accepted:
            result.wrongly_accepted.append(text)
        else:
            result.num_invalid_rejected += 1
    return result
