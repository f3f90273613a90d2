"""Structured generation for LLM serving: grammar objects, backends, their registry and cache.

Engines (xgrammar, llguidance, outlines-core) are imported only when their backend is built.
"""

from sglang_constrained.base_grammar_backend import (
    GRAMMAR_BACKEND_REGISTRY,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
    GrammarStats,
    InvalidGrammarObject,
    TokenRejectedError,
    available_grammar_backends,
    create_grammar_backend,
    register_grammar_backend,
)
from sglang_constrained.constraint_spec import CONSTRAINT_KINDS, GrammarKey, GrammarSpecError, make_grammar_key

__all__ = [
    "CONSTRAINT_KINDS",
    "GRAMMAR_BACKEND_REGISTRY",
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarBackendArgs",
    "GrammarKey",
    "GrammarSpecError",
    "GrammarStats",
    "InvalidGrammarObject",
    "TokenRejectedError",
    "available_grammar_backends",
    "create_grammar_backend",
    "make_grammar_key",
    "register_grammar_backend",
]
