"""The grammar-backend registry: built-in, registered and installed backends, and the factory the server calls.

Importing this module loads no engine and not torch: the built-in backends are resolved from ``module:attribute``
strings when one is built, and installed plugins (the ``sglang_constrained.grammar_backends`` entry-point group)
are imported only when their backend is built.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang_constrained.backends.base import GrammarBackend, GrammarBackendArgs
    from sglang_constrained.backends.pipeline import GrammarPipeline
    from sglang_constrained.cache.compiled import CompiledGrammarStore

logger = logging.getLogger(__name__)

GrammarBackendFactory = Callable[["GrammarBackendArgs", Any, int, list[int]], "GrammarBackend"]
"""``init_func(server_args, tokenizer, vocab_size, eos_token_ids) -> GrammarBackend`` (a ``BaseGrammarBackend``
subclass, as a rule)."""

GRAMMAR_BACKEND_REGISTRY: dict[str, GrammarBackendFactory] = {}
"""Backends registered by users: ``name -> init_func(server_args, tokenizer, vocab_size, eos_token_ids)``."""

AUTO_GRAMMAR_BACKEND = "auto"
"""Asks the backends of ``--grammar-backend-order`` in turn for each constraint (``auto_grammar_backend``)."""
_BUILTIN_BACKENDS: dict[str, str] = {
    "xgrammar": "sglang_constrained.backends.xgrammar.backend:XGrammarGrammarBackend",
    "llguidance": "sglang_constrained.backends.llguidance.backend:GuidanceBackend",
    "outlines": "sglang_constrained.backends.outlines.backend:OutlinesGrammarBackend",
    AUTO_GRAMMAR_BACKEND: "sglang_constrained.backends.auto:AutoGrammarBackend",
}
_PIPELINE = "sglang_constrained.backends.pipeline:GrammarPipeline"
_REASONER_BACKEND = "sglang_constrained.backends.reasoner:ReasonerGrammarBackend"
NO_GRAMMAR_BACKEND = "none"


ENTRY_POINT_GROUP = "sglang_constrained.grammar_backends"
"""Installed packages can provide backends: ``name = "package.module:init_func"`` in this entry-point group."""


def register_grammar_backend(name: str, init_func: GrammarBackendFactory) -> None:
    """Make ``name`` a valid ``--grammar-backend``; a registered name wins over a built-in one."""
    if not name or name == NO_GRAMMAR_BACKEND:
        raise ValueError(f"cannot register a grammar backend named {name!r}")
    GRAMMAR_BACKEND_REGISTRY[name] = init_func


def register_entry_point_backends() -> None:
    """Register the backends installed packages declare in ``ENTRY_POINT_GROUP``.

    Their modules are imported only when the backend is built. A name registered in code keeps precedence.
    """
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry_point.name not in GRAMMAR_BACKEND_REGISTRY:
            register_grammar_backend(entry_point.name, _load_on_call(entry_point))


def _load_on_call(entry_point: importlib.metadata.EntryPoint) -> GrammarBackendFactory:
    def init_func(server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos: list[int]) -> GrammarBackend:
        backend: GrammarBackend = entry_point.load()(server_args, tokenizer, vocab_size, eos)
        return backend

    return init_func


def available_grammar_backends() -> list[str]:
    """Every name ``--grammar-backend`` accepts: built-ins, registered and installed backends, and ``none``."""
    register_entry_point_backends()
    return [*sorted({*_BUILTIN_BACKENDS, *GRAMMAR_BACKEND_REGISTRY}), NO_GRAMMAR_BACKEND]


def check_grammar_backend_order(order: Sequence[str]) -> None:
    """Raise ``ValueError`` unless ``order`` names distinct backends that ``auto`` can ask (not itself, not none)."""
    choices = [name for name in available_grammar_backends() if name not in (AUTO_GRAMMAR_BACKEND, NO_GRAMMAR_BACKEND)]
    if not order:
        raise ValueError(f"--grammar-backend-order names no backend; give a comma-separated list of {choices}")
    unknown = [name for name in order if name not in choices]
    if unknown:
        raise ValueError(f"--grammar-backend-order cannot hold {unknown}; choose among {choices}")
    repeated = sorted({name for name in order if order.count(name) > 1})
    if repeated:
        raise ValueError(f"--grammar-backend-order names {repeated} more than once")


def grammar_backend_factory(name: str) -> GrammarBackendFactory:
    """The factory of backend ``name``: a registered or installed one, else the built-in; ``ValueError`` if unknown."""
    register_entry_point_backends()
    factory = GRAMMAR_BACKEND_REGISTRY.get(name)
    if factory is not None:
        return factory
    if name not in _BUILTIN_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; choose one of {available_grammar_backends()}")
    built_in: GrammarBackendFactory = _resolve(_BUILTIN_BACKENDS[name])
    return built_in


def create_grammar_backend(
    server_args: GrammarBackendArgs,
    tokenizer: Any,
    vocab_size: int,
    eos_token_ids: list[int],
    think_end_id: int | None = None,
    think_start_id: int | None = None,
    disk_cache: CompiledGrammarStore | None = None,
) -> GrammarPipeline | None:
    """Build the backend ``server_args.grammar_backend`` names, in the ``GrammarPipeline`` that serves its compiles
    (None for ``none``).

    For code that uses the library as SGLang's (the server's scheduler passes no think ids: its reasoning gate wraps
    the pipeline built here), the pipeline comes wrapped in a ``ReasonerGrammarBackend`` when ``--reasoning-parser``
    is set and a ``think_end_id`` is given (``think_start_id``, where the tokenizer has one, lets a model that may
    open its thinking do so); ``ReasonerGrammarBackend(pipeline, think_end_id, think_start_id)`` is the same wrapper
    built by hand. ``disk_cache``: where compiled grammars outlive the process (``grammar_disk_cache``), used by a
    backend that can export its grammars and closed otherwise.
    """
    if server_args.grammar_backend == NO_GRAMMAR_BACKEND:
        if disk_cache is not None:
            disk_cache.close()
        return None
    factory = grammar_backend_factory(server_args.grammar_backend)
    backend: GrammarPipeline = _resolve(_PIPELINE)(factory(server_args, tokenizer, vocab_size, eos_token_ids))
    if disk_cache is not None and backend.can_share_grammars:
        backend.use_disk_cache(disk_cache)
    elif disk_cache is not None:
        logger.info("the %s grammar backend cannot export its grammars: none are cached on disk", backend.name)
        disk_cache.close()
    if server_args.reasoning_parser and think_end_id is not None:
        backend = _resolve(_REASONER_BACKEND)(backend, think_end_id, think_start_id)
    return backend


def _resolve(target: str) -> Any:
    """Import ``module:attribute`` on first use, so that an engine loads only when its backend is built."""
    module_name, attribute = target.split(":")
    return getattr(importlib.import_module(module_name), attribute)
