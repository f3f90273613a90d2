"""The grammar contract: request-level grammar objects and engine-level backends (SGLang's, plus vLLM's
``validate_tokens``).

A backend turns a constraint key ``(key_type, spec)`` into a ``BaseGrammarObject``. The scheduler fills one
int32 bitmask row per constrained request from that object before sampling and feeds it every accepted token.
Compiles run on the backend's ``CompileService`` (slots, deadline, cache, in-flight dedup), through a
``CompiledGrammarStore`` on disk when one is attached (``use_disk_cache``). Bad input never raises: it becomes an
``InvalidGrammarObject`` whose message says what is wrong. Backends are named and built by
``sglang_constrained.backends.registry``.

Over 300 lines because the contract is one unit: the two base classes, the invalid object, the stats, the exports
and their store, and the JSON-schema preparation every backend runs before its engine sees a schema.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from sglang_constrained.cache.compiled import CompiledGrammarStore, GrammarExport, GrammarStats
from sglang_constrained.cache.identity import code_fingerprint
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.service import CompileService
from sglang_constrained.constraint_spec import GrammarKey, compile_method, lower_constraint
from sglang_constrained.errors import GrammarSpecError, TokenRejectedError, bounded_message
from sglang_constrained.schema.soundness import sound_json_schema, user_patterns_in
from triton_ops.bitmask_format import VocabMaskLayout, allocate_bitmask
from triton_ops.bitmask_ops import apply_token_bitmask_inplace

logger = logging.getLogger(__name__)


class GrammarBackendArgs(Protocol):
    """The server settings a grammar backend reads (``scheduler.server_args.ServerArgs`` provides them)."""

    @property
    def grammar_backend(self) -> str: ...
    @property
    def constrained_json_whitespace_pattern(self) -> str | None: ...
    @property
    def constrained_json_disable_any_whitespace(self) -> bool: ...
    @property
    def reasoning_parser(self) -> str | None: ...
    @property
    def grammar_cache_max_entries(self) -> int: ...
    @property
    def grammar_cache_max_bytes(self) -> int: ...
    @property
    def grammar_max_spec_bytes(self) -> int: ...
    @property
    def grammar_compile_threads(self) -> int: ...
    @property
    def compile_timeout_s(self) -> float: ...
    @property
    def grammar_backend_order(self) -> tuple[str, ...]: ...
    @property
    def grammar_compile_slow_after(self) -> float: ...
    @property
    def grammar_max_slow_compiles(self) -> int: ...
    @property
    def grammar_compile_max_memory(self) -> int | None: ...
    @property
    def grammar_auto_allow_narrowing(self) -> bool: ...
    @property
    def vocabulary_cache_path(self) -> Path | None: ...


class BaseGrammarObject(ABC):
    """The grammar state of one request (SGLang's contract, plus ``validate_tokens`` from vLLM's).

    Vocabulary masks are int32 bitmasks of shape ``[batch, ceil(vocab_size / 32)]``: token ``t`` is allowed
    iff bit ``t % 32`` of word ``t // 32`` is set. Backends with another mask layout override the
    ``*_vocab_mask`` methods together.
    """

    def __init__(self) -> None:
        self._finished = False
        self.grammar_stats: GrammarStats | None = None

    @abstractmethod
    def accept_token(self, token: int) -> None:
        """Advance the grammar by one token; raises ``TokenRejectedError`` if the token is not allowed."""

    @abstractmethod
    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar has accepted a stop token or can accept nothing more."""

    @abstractmethod
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write the allowed tokens of the current state into row ``idx``; the state does not change."""

    @abstractmethod
    def copy(self) -> BaseGrammarObject:
        """A fresh grammar object at the start state that shares the compiled grammar (not the state)."""

    @property
    def finished(self) -> bool:
        return self._finished

    @finished.setter
    def finished(self, finished: bool) -> None:
        self._finished = finished

    def maybe_init_reasoning(self, reasoning: bool) -> None:
        """Start in the reasoning phase (unconstrained until the think-end token); only reasoner grammars care."""

    def validate_tokens(self, tokens: list[int]) -> int:
        """Length of the longest prefix of ``tokens`` the grammar accepts from here; the state does not change."""
        raise NotImplementedError(f"{type(self).__name__} cannot validate token sequences")

    def state_key(self) -> Hashable | None:
        """A value equal for two states of this grammar object exactly when they allow the same token sequences from
        here on, or None where the engine does not expose its state (xgrammar's Earley chart, llguidance's
        lexer and parser): ``exact_ending`` needs it to tell states apart. The state does not change."""
        return None

    def memory_size_bytes(self) -> int:
        """Approximate bytes held by the compiled grammar; the cache's byte bound counts this.

        Objects that cannot tell return 0 and count only towards the cache's entry bound.
        """
        return 0

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """An all-allowed int32 bitmask ``[batch_size, ceil(vocab_size / 32)]`` on ``device``."""
        return allocate_bitmask(batch_size, vocab_size, device)

    @staticmethod
    def move_vocab_mask(vocab_mask: torch.Tensor, device: torch.device | str) -> torch.Tensor:
        return vocab_mask.to(device, non_blocking=True)

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """Set disallowed logits to -inf in place (``logits`` is ``[batch, vocab]``)."""
        apply_token_bitmask_inplace(logits, vocab_mask)

    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """What the grammar forces next, or None when nothing is forced; the state does not change.

        ``(token_ids, text)``: ``token_ids`` are forced tokens to append as they are; ``text`` is forced text
        that comes after them (not repeating them), to be tokenised by the caller.
        """
        return None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        raise NotImplementedError(f"{type(self).__name__} has no jump-forward")

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no jump-forward")


class InvalidGrammarObject(BaseGrammarObject):
    """The result of a failed compile: carries the reason and is never put into a batch."""

    def __init__(self, error_message: str) -> None:
        super().__init__()
        self.error_message = error_message

    def accept_token(self, token: int) -> None:
        raise TokenRejectedError(token, self.error_message)

    def rollback(self, k: int) -> None:
        return None

    def is_terminated(self) -> bool:
        return True

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        raise ValueError(f"an invalid grammar has no vocabulary mask: {self.error_message}")

    def copy(self) -> InvalidGrammarObject:
        return self

    def __repr__(self) -> str:
        return f"InvalidGrammarObject({self.error_message!r})"


class BaseGrammarBackend:
    """Turns constraint keys into grammar objects: dispatch by kind, compiled on a ``CompileService``.

    ``get_cached_or_future_value`` answers a cache hit with a copy at once and a miss with a ``Future`` that
    resolves to a grammar object of its own; identical misses share one compilation, and a compile past
    ``server_args.compile_timeout_s`` fails with ``CompileTimeoutError``. The caller decides when a compiled
    grammar enters the cache (``set_cache``), so that every rank of a multi-rank server makes the same
    hit-or-miss decision for the same request. ``mask_layout`` says how this backend's grammars fill masks.
    """

    name: str = "base"
    require_exact: bool = False
    """Compile each JSON schema exactly, or refuse it (``GrammarSpecError``) where this backend would narrow it
    (``json_schema_narrowing``). ``auto`` sets it on its backends unless narrowing is allowed."""

    def __init__(
        self,
        server_args: GrammarBackendArgs,
        vocab_size: int,
        compile_service: CompileService[GrammarKey, BaseGrammarObject] | None = None,
    ) -> None:
        """``compile_service``: share another backend's (cache, pool and all) instead of starting one."""
        self.server_args = server_args
        self.vocab_size = vocab_size
        self.mask_layout = VocabMaskLayout(vocab_size)
        self.max_spec_bytes = server_args.grammar_max_spec_bytes
        self.disk_cache: CompiledGrammarStore | None = None
        self.compile_service = compile_service or CompileService(
            self.compile_or_load,
            name=self.name,
            threads=server_args.grammar_compile_threads,
            timeout_s=server_args.compile_timeout_s,
            cache_max_entries=server_args.grammar_cache_max_entries,
            cache_max_bytes=server_args.grammar_cache_max_bytes,
            size_of=lambda grammar: grammar.memory_size_bytes(),
            copy=_copy_with_stats,
            slow_after_s=server_args.grammar_compile_slow_after,
            max_slow=server_args.grammar_max_slow_compiles,
        )

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("json")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("regex")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("ebnf")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("structural_tag")

    def takes_as_written(self, key: GrammarKey) -> bool:
        """Whether this backend compiles ``key``'s spec in its own syntax, with no conversion first (a Lark grammar
        for llguidance, GBNF for xgrammar); ``--grammar-backend auto`` asks such backends first."""
        return False

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        """Refuse schema features this backend would otherwise ignore; raises ``GrammarSpecError``."""

    def json_schema_narrowing(self, schema: Any) -> str | None:
        """How this backend's grammar for ``schema`` would admit less than the schema allows, naming the feature
        and where (``"narrows 'unlisted properties' (at /a): ..."``); None when it enforces it exactly. Pure: looks
        at the schema only."""
        return None

    def prepare_json_schema(self, schema: Any, originals: dict[str, str] | None = None) -> Any:
        """The schema to compile for a request's ``schema``: checked (and, with ``require_exact``, refused where
        this backend would narrow it), then its formats and patterns made sound (``originals`` receives the user's
        text of each rewritten pattern, for messages)."""
        self.check_json_schema(schema)
        if self.require_exact and (narrowing := self.json_schema_narrowing(schema)) is not None:
            raise GrammarSpecError(
                f"the {self.name} grammar backend would not enforce this schema exactly: {narrowing}"
            )
        return sound_json_schema(schema, originals)

    def get_cached_or_future_value(
        self, key: GrammarKey, require_reasoning: bool = False
    ) -> tuple[BaseGrammarObject | Future[BaseGrammarObject], bool]:
        """``(copy, True)`` on a cache hit, else ``(future, False)`` resolving to a grammar object of its own."""
        return self.compile_service.get(key)

    @property
    def can_share_grammars(self) -> bool:
        """Whether ``export_grammar`` / ``import_grammar`` work, so that one process compiles for many."""
        return False

    def export_grammar(self, grammar: BaseGrammarObject) -> GrammarExport:
        """``grammar`` (valid or invalid, at its start state) as another process's backend imports it."""
        if isinstance(grammar, InvalidGrammarObject):
            return GrammarExport(None, grammar.error_message, grammar.grammar_stats)
        return GrammarExport(self.serialize_grammar(grammar), "", grammar.grammar_stats)

    def import_grammar(self, export: GrammarExport) -> BaseGrammarObject:
        """A grammar object at its start state from another backend's ``export_grammar``; nothing is compiled."""
        grammar: BaseGrammarObject
        if export.payload is None:
            grammar = InvalidGrammarObject(export.error_message)
        else:
            grammar = self.deserialize_grammar(export.payload)
        grammar.grammar_stats = export.stats
        return grammar

    def serialize_grammar(self, grammar: BaseGrammarObject) -> bytes | str:
        """The compiled form of a valid ``grammar`` of this backend (backends with ``can_share_grammars``)."""
        raise NotImplementedError(f"the {self.name} grammar backend cannot share its compiled grammars")

    def deserialize_grammar(self, payload: bytes | str) -> BaseGrammarObject:
        """The inverse of ``serialize_grammar``."""
        raise NotImplementedError(f"the {self.name} grammar backend cannot share its compiled grammars")

    def compile_elsewhere(self, fetch: Callable[[GrammarKey], Future[BaseGrammarObject]]) -> None:
        """Take each missed key's grammar from ``fetch`` (settled by another process that compiles it, say with
        ``import_grammar``) instead of compiling it here; this backend's cache, dedup and deadline stay."""
        self.compile_service.compile_elsewhere(fetch)

    def compile_identity(self) -> dict[str, Any]:
        """What, beside a constraint key, decides the grammar this backend compiles for it (JSON-serialisable): two
        backends with equal identities compile every key to the same grammar. Here the backend's name, class and
        code (``code_fingerprint``), the settings that change a compile and the model's vocab size; each engine's
        backend adds the engine's version and its tokenizer's fingerprint. The disk cache names entries by it. The
        compile deadline is left out: it decides whether a compile is tried, not what it compiles to."""
        args = self.server_args
        return {
            "backend": self.name,
            "class": f"{type(self).__module__}.{type(self).__qualname__}",
            "code": code_fingerprint(type(self)),
            "json_whitespace_pattern": args.constrained_json_whitespace_pattern,
            "json_disable_any_whitespace": args.constrained_json_disable_any_whitespace,
            "max_spec_bytes": self.max_spec_bytes,
            "require_exact": self.require_exact,
            "vocab_size": self.vocab_size,
        }

    def use_disk_cache(self, disk_cache: CompiledGrammarStore) -> None:
        """Read compiled grammars from ``disk_cache`` before compiling them, and write there the ones compiled here
        (``compile_or_load``); it is closed with this backend. ``ValueError`` unless ``can_share_grammars``."""
        if not self.can_share_grammars:
            raise ValueError(f"the {self.name} grammar backend cannot export its grammars to cache them on disk")
        self.compile_identity()  # fingerprints the tokenizer now, at start-up, rather than in a request's compile
        self.disk_cache = disk_cache

    def compile_or_load(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """``build_grammar(key, control)``, or the grammar the disk cache holds for ``key`` (its stats then say
        ``is_disk_cache_hit``); a valid grammar compiled here is written to the disk cache after it is returned,
        if reading it back costs clearly less than compiling it did. What the compile service runs for a miss."""
        if self.disk_cache is None:
            return self.build_grammar(key, control)
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
                grammar.grammar_stats = replace(
                    stats, compile_time_s=time.perf_counter() - start, is_cache_hit=False, is_disk_cache_hit=True
                )
                return grammar
        start = time.perf_counter()
        grammar, export_later = self.build_exportable(key, control)
        if not isinstance(grammar, InvalidGrammarObject):  # errors are cached in memory only
            self.disk_cache.store_later(identity, key, export_later, time.perf_counter() - start, self.import_grammar)
        return grammar

    def build_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        """``build_grammar``, and how to export its result later (on the disk cache's writer thread). A backend that
        receives a compiled grammar already exported (from a compile process) hands that export over instead."""
        grammar = self.build_grammar(key, control)
        return grammar, lambda: self.export_grammar(grammar)

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

    def wait_until_ready(self) -> None:
        """Block until the backend can compile at once (a backend that starts compile processes waits for them), so
        that no request's compile deadline pays for the server's start-up."""

    def shutdown(self) -> None:
        self.compile_service.shutdown()
        if self.disk_cache is not None:
            self.disk_cache.close()

    def allocate_vocab_mask(self, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """An all-allowed mask buffer for ``batch_size`` rows in this backend's layout."""
        return self.mask_layout.allocate(batch_size, device)

    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """Compile ``key`` on the caller's thread, outside the compile service's cache and the disk cache.

        What the compile service runs, with the compile's ``control`` (its deadline and cancellation: a backend
        that compiles elsewhere stops there when asked; here a thread's compile runs to its end). Never raises for
        a bad spec: a refusal is an ``InvalidGrammarObject``.
        """
        key_type = key[0]
        start = time.perf_counter()
        originals: dict[str, str] = {}
        schemas: list[Any] = []

        def prepare(schema: Any) -> Any:
            schemas.append(schema)
            return self.prepare_json_schema(schema, originals)

        try:
            compiled_kind, spec = lower_constraint(key, self.max_spec_bytes, prepare)
            compile_kind = getattr(self, compile_method(compiled_kind), None)
            grammar = compile_kind(spec) if compile_kind is not None else self._unsupported(compiled_kind)
        except GrammarSpecError as e:
            grammar = InvalidGrammarObject(user_patterns_in(str(e), originals))
        except Exception as e:  # an engine's own error for bad input: report it, never raise out of the pool
            logger.debug("%s backend failed to compile a %s grammar", self.name, key_type, exc_info=True)
            message = bounded_message(user_patterns_in(str(e), originals)) if str(e).strip() else type(e).__name__
            grammar = InvalidGrammarObject(message)
        narrowing = None
        if schemas and not isinstance(grammar, InvalidGrammarObject):
            narrowing = self.json_schema_narrowing(schemas[0])
        grammar.grammar_stats = GrammarStats(
            dispatch_type=key_type, compile_time_s=time.perf_counter() - start, narrowing=narrowing
        )
        return grammar

    def _unsupported(self, key_type: str) -> InvalidGrammarObject:
        return InvalidGrammarObject(f"the {self.name} grammar backend does not support {key_type} constraints")


def common_prefix_length(old_ids: list[int], new_ids: list[int]) -> int:
    """How many leading ids two token lists share (where ``jump_and_retokenize`` rolls back to)."""
    for position, (old, new) in enumerate(zip(old_ids, new_ids, strict=False)):
        if old != new:
            return position
    return min(len(old_ids), len(new_ids))


def _copy_with_stats(grammar: BaseGrammarObject, is_cache_hit: bool) -> BaseGrammarObject:
    copied = grammar.copy()
    if grammar.grammar_stats is not None and copied is not grammar:
        copied.grammar_stats = replace(grammar.grammar_stats, is_cache_hit=is_cache_hit)
    return copied


__all__ = [
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "CompiledGrammarStore",
    "GrammarBackendArgs",
    "GrammarExport",
    "GrammarSpecError",
    "GrammarStats",
    "InvalidGrammarObject",
    "TokenRejectedError",
    "VocabMaskLayout",
    "common_prefix_length",
]
