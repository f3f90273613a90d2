"""The compile pipeline around a grammar backend: what the server asks for a constraint, and where it comes from.

``GrammarPipeline(backend)`` answers ``get_cached_or_future_value`` (SGLang's name) with a copy of a cached grammar at
once, or with a ``Future`` of a grammar object of its own. A miss runs on a ``CompileService`` (compile slots, a
deadline per compile, a bounded memory cache, one compile per key): from the ``CompiledGrammarStore`` on disk when
one is attached (``use_disk_cache``), else the backend's ``build_exportable``, and then written to that store. The
caller decides when a compiled grammar enters the memory cache (``set_cache``), so that every rank of a multi-rank
server makes the same hit-or-miss decision for the same request. ``compile_elsewhere`` makes misses come from another
process that compiles once for many (data-parallel replicas, ranks in lockstep), which exports and imports through
the backend.

The backend knows nothing of this: it compiles on the caller's thread (``sglang_constrained.backends.base``). The
registry builds one pipeline per server; ``auto`` one per backend of its order (their compile slots); the reasoner
wraps one.

A pipeline is what SGLang's callers know as a grammar backend (``create_grammar_backend`` returns one): it answers
SGLang's whole ``BaseGrammarBackend`` interface, the served path above and the per-kind compiles at once
(``dispatch_json`` and the others, through the backend's own preparation), and is registered as a virtual subclass
of ``BaseGrammarBackend`` so that code written against SGLang's class recognises it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from sglang_constrained.backends.base import BaseGrammarBackend, BaseGrammarObject, GrammarBackend, InvalidGrammarObject
from sglang_constrained.cache.compiled import CompiledGrammarStore, GrammarExport, GrammarStats
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.service import CompileService
from sglang_constrained.constraint_spec import GrammarKey
from triton_ops.bitmask_format import VocabMaskLayout

logger = logging.getLogger(__name__)


class GrammarPipeline:
    """``backend``'s compiles, served: cached, deduplicated, under a deadline, through the disk cache when attached.

    ``compile_service``: share another pipeline's (slots, cache and all) instead of starting one.
    """

    def __init__(
        self,
        backend: GrammarBackend,
        compile_service: CompileService[GrammarKey, BaseGrammarObject] | None = None,
    ) -> None:
        args = backend.server_args
        self.backend = backend
        self.disk_cache: CompiledGrammarStore | None = None
        self.compile_service = compile_service or CompileService(
            self.compile_or_load,
            name=backend.name,
            threads=args.grammar_compile_threads,
            timeout_s=args.compile_timeout_s,
            cache_max_entries=args.grammar_cache_max_entries,
            cache_max_bytes=args.grammar_cache_max_bytes,
            size_of=lambda grammar: grammar.memory_size_bytes(),
            copy=_copy_with_stats,
            slow_after_s=args.grammar_compile_slow_after,
            max_slow=args.grammar_max_slow_compiles,
        )

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def mask_layout(self) -> VocabMaskLayout:
        """The backend's ``VocabMaskLayout``: how its grammars fill masks (the scheduler allocates its buffer by it)."""
        return self.backend.mask_layout

    def get_cached_or_future_value(
        self, key: GrammarKey, require_reasoning: bool = False
    ) -> tuple[BaseGrammarObject | Future[BaseGrammarObject], bool]:
        """``(copy, True)`` on a cache hit, else ``(future, False)`` resolving to a grammar object of its own;
        identical misses share one compile, and one past ``compile_timeout_s`` fails with ``CompileTimeoutError``.
        ``require_reasoning`` matters to the reasoner only."""
        return self.compile_service.get(key)

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        """SGLang's compile of a JSON schema at once, on the caller's thread, outside the cache."""
        return self.backend.build_grammar(("json", key_string))

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self.backend.build_grammar(("regex", key_string))

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self.backend.build_grammar(("ebnf", key_string))

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self.backend.build_grammar(("structural_tag", key_string))

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        """Store a compiled (or invalid) grammar for ``key``; its in-flight compile, if any, is done with."""
        self.compile_service.store(key, value)

    def discard_pending(self, key: GrammarKey) -> None:
        """Forget an in-flight compile (after a timeout), so that the next request for ``key`` compiles anew.

        The compile itself goes on: other requests that joined it still receive its result.
        """
        self.compile_service.forget(key)

    def reset(self) -> None:
        self.compile_service.reset()

    @property
    def can_share_grammars(self) -> bool:
        """Whether the backend exports and imports its grammars, so that one process compiles for many."""
        return self.backend.can_share_grammars

    def export_grammar(self, grammar: BaseGrammarObject) -> GrammarExport:
        return self.backend.export_grammar(grammar)

    def import_grammar(self, export: GrammarExport) -> BaseGrammarObject:
        return self.backend.import_grammar(export)

    def compile_identity(self) -> dict[str, Any]:
        return self.backend.compile_identity()

    def compile_elsewhere(self, fetch: Callable[[GrammarKey], Future[BaseGrammarObject]]) -> None:
        """Take each missed key's grammar from ``fetch`` (settled by another process that compiles it, say with
        ``import_grammar``) instead of compiling it here; the cache, dedup and deadline stay."""
        self.compile_service.compile_elsewhere(fetch)

    def use_disk_cache(self, disk_cache: CompiledGrammarStore) -> None:
        """Read compiled grammars from ``disk_cache`` before compiling them, and write there the ones compiled here
        (``compile_or_load``); it is closed with this pipeline. ``ValueError`` unless ``can_share_grammars``."""
        if not self.can_share_grammars:
            raise ValueError(f"the {self.name} grammar backend cannot export its grammars to cache them on disk")
        self.compile_identity()  # fingerprints the tokenizer now, at start-up, rather than in a request's compile
        self.disk_cache = disk_cache

    def compile_or_load(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """The backend's ``build_grammar(key, control)``, or the grammar the disk cache holds for ``key`` (its stats
        then say ``is_disk_cache_hit``); a valid grammar compiled here is written to the disk cache after it is
        returned, if reading it back costs clearly less than compiling it did. What the compile service runs for a
        miss."""
        return self.compile_or_load_exportable(key, control)[0]

    def compile_or_load_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        """``compile_or_load``, and how to export its grammar without serialising anew what came serialised (the
        disk cache's entry as read, an xgrammar compile process's export as it came: ``build_exportable``). What
        rank 0's store hands to the other ranks: at SmolLM2's 49k tokens, serialising an xgrammar grammar again
        took 0.12-0.17 s, against a 0.11 s compile."""
        if self.disk_cache is None:
            return self.backend.build_exportable(key, control)
        start = time.perf_counter()
        identity = self.compile_identity()
        export = self.disk_cache.load(identity, key)
        if export is not None:
            try:
                grammar = self.import_grammar(export)
            except Exception:  # the entry is sound but this backend cannot use it: compile, and overwrite it
                logger.warning("%s: a grammar from the disk cache does not import", self.name, exc_info=True)
                self.disk_cache.discard(identity, key)
            else:
                stats = export.stats or GrammarStats(dispatch_type=key[0], compile_time_s=0.0)
                loaded_stats = replace(
                    stats, compile_time_s=time.perf_counter() - start, is_cache_hit=False, is_disk_cache_hit=True
                )
                grammar.grammar_stats = loaded_stats
                return grammar, lambda: replace(export, stats=loaded_stats)
        start = time.perf_counter()
        grammar, export_later = self.backend.build_exportable(key, control)
        if not isinstance(grammar, InvalidGrammarObject):  # errors are cached in memory only
            self.disk_cache.store_later(identity, key, export_later, time.perf_counter() - start, self.import_grammar)
        return grammar, export_later

    def wait_until_ready(self) -> None:
        """Block until the backend can compile at once, so that no request's deadline pays for start-up."""
        self.backend.wait_until_ready()

    def shutdown(self) -> None:
        """Stop the backend's own resources, cancel every compile and close the disk cache."""
        self.backend.shutdown()
        self.compile_service.shutdown()
        if self.disk_cache is not None:
            self.disk_cache.close()


BaseGrammarBackend.register(GrammarPipeline)


def _copy_with_stats(grammar: BaseGrammarObject, is_cache_hit: bool) -> BaseGrammarObject:
    copied = grammar.copy()
    if grammar.grammar_stats is not None and copied is not grammar:
        copied.grammar_stats = replace(grammar.grammar_stats, is_cache_hit=is_cache_hit)
    return copied
