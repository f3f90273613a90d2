"""SGLang's import path for the grammar contract and its factory, kept for code written against SGLang.

``from sglang.srt.constrained.base_grammar_backend import BaseGrammarObject, create_grammar_backend`` becomes
``from sglang_constrained.base_grammar_backend import ...``. The contract lives in ``sglang_constrained.backends.base``
and the registry in ``sglang_constrained.backends.registry``; this module only names them together.
"""

from __future__ import annotations

from sglang_constrained.backends.base import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
    GrammarStats,
    InvalidGrammarObject,
)
from sglang_constrained.backends.registry import (
    GRAMMAR_BACKEND_REGISTRY,
    available_grammar_backends,
    create_grammar_backend,
    register_grammar_backend,
)
from sglang_constrained.errors import TokenRejectedError

__all__ = [
    "GRAMMAR_BACKEND_REGISTRY",
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarBackendArgs",
    "GrammarStats",
    "InvalidGrammarObject",
    "TokenRejectedError",
    "available_grammar_backends",
    "create_grammar_backend",
    "register_grammar_backend",
]
