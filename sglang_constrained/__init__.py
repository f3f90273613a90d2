"""Structured generation for LLM serving: grammar objects, backends, their registry and cache.

Names are imported on first use, so that a process that only needs constraint keys (an HTTP frontend) does not
load torch, and engines (xgrammar, llguidance, outlines-core) load only when their backend is built.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_constrained.backends.base import (
        BaseGrammarBackend,
        BaseGrammarObject,
        GrammarBackendArgs,
        GrammarStats,
        InvalidGrammarObject,
        TokenRejectedError,
    )
    from sglang_constrained.backends.registry import (
        GRAMMAR_BACKEND_REGISTRY,
        available_grammar_backends,
        create_grammar_backend,
        register_grammar_backend,
    )
    from sglang_constrained.constraint_spec import CONSTRAINT_KINDS, GrammarKey, GrammarSpecError, make_grammar_key

_EXPORTS = {
    "GRAMMAR_BACKEND_REGISTRY": "backends.registry",
    "BaseGrammarBackend": "backends.base",
    "BaseGrammarObject": "backends.base",
    "GrammarBackendArgs": "backends.base",
    "GrammarStats": "backends.base",
    "InvalidGrammarObject": "backends.base",
    "TokenRejectedError": "backends.base",
    "available_grammar_backends": "backends.registry",
    "create_grammar_backend": "backends.registry",
    "register_grammar_backend": "backends.registry",
    "CONSTRAINT_KINDS": "constraint_spec",
    "GrammarKey": "constraint_spec",
    "GrammarSpecError": "constraint_spec",
    "make_grammar_key": "constraint_spec",
}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sglang_constrained' has no attribute {name!r}")
    return getattr(importlib.import_module(f"sglang_constrained.{module}"), name)
