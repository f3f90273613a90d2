"""What backends derive from a tokenizer, built once per tokenizer object in a process.

A decoded vocabulary or an engine's tokenizer takes seconds to build at 248k tokens, and every backend built on the
same tokenizer (``auto``'s three, a test session's dozens) can share the immutable result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, cast

_T = TypeVar("_T")

_PER_TOKENIZER: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
"""Per tokenizer object (held weakly): what ``per_tokenizer`` built from it, by key."""


def per_tokenizer(tokenizer: Any, key: Hashable, build: Callable[[], _T]) -> _T:
    """``build()``, once per tokenizer object and ``key`` in this process (``build`` must return something
    immutable: every caller shares it). A tokenizer that has grown by added tokens since builds anew."""
    full_key = (len(tokenizer), key)
    try:
        built = _PER_TOKENIZER.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced or hashed builds every time
        built = {}
    if full_key not in built:
        built[full_key] = build()
    return cast(_T, built[full_key])
