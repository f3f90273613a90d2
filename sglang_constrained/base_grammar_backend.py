"""The grammar contract: request-level grammar objects, engine-level backends, and the backend registry.

A backend turns a constraint key ``(key_type, spec)`` into a ``BaseGrammarObject``. The scheduler fills one
int32 bitmask row per constrained request from that object before sampling and feeds it every accepted token.
Compilation runs on the backend's thread pool; the backend keeps a bounded cache of compiled grammars and
deduplicates identical compiles that are in flight. Bad input never raises: it becomes an
``InvalidGrammarObject`` whose message says what is wrong.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import torch

from sglang_constrained.constraint_spec import GrammarKey, GrammarSpecError, lower_constraint
from sglang_constrained.grammar_cache import GrammarCache
from sglang_constrained.registry import (  # the registry's names stay importable from this contract module
    ENTRY_POINT_GROUP,
    GRAMMAR_BACKEND_REGISTRY,
    NO_GRAMMAR_BACKEND,
    GrammarBackendFactory,
    available_grammar_backends,
    create_grammar_backend,
    register_entry_point_backends,
    register_grammar_backend,
)
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


@dataclass(frozen=True)
class GrammarStats:
    """What it took to obtain a grammar object: which dispatch built it, how long, and whether it was cached."""

    dispatch_type: str
    compile_time_s: float
    is_cache_hit: bool = False


class TokenRejectedError(ValueError):
    """Raised by ``accept_token`` when the grammar does not allow the token in its current state."""

    def __init__(self, token: int, reason: str = "") -> None:
        self.token = token
        message = f"token {token} is not allowed by the grammar"
        super().__init__(f"{message}: {reason}" if reason else message)


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

    def memory_size_bytes(self) -> int:
        """Approximate bytes held by the compiled grammar; the cache's byte bound counts this.

        Objects that cannot tell return 0 and count only towards the cache's entry bound.
        """
        return 0

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: torch.device | str) -> torch.Tensor:
        """An all-allowed int32 bitmask ``[batch_size, ceil(vocab_size / 32)]`` on ``device``."""
        return torch.full((batch_size, math.ceil(vocab_size / 32)), -1, dtype=torch.int32, device=device)

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
    """Turns constraint keys into grammar objects: dispatch, a bounded cache and a compile thread pool.

    ``get_cached_or_future_value`` answers a cache hit with a copy at once and a miss with a ``Future`` that
    resolves to a grammar object of its own; identical misses share one compilation. The caller decides
    when a compiled grammar enters the cache (``set_cache``), so that every rank of a multi-rank server
    makes the same hit-or-miss decision for the same request.
    """

    name: ClassVar[str] = "base"

    def __init__(self, server_args: GrammarBackendArgs) -> None:
        self.max_spec_bytes = server_args.grammar_max_spec_bytes
        self.cache: GrammarCache[GrammarKey, BaseGrammarObject] = GrammarCache(
            server_args.grammar_cache_max_entries, server_args.grammar_cache_max_bytes
        )
        self.executor = ThreadPoolExecutor(
            max_workers=server_args.grammar_compile_threads, thread_name_prefix=f"{self.name}-compile"
        )
        self._in_flight: dict[GrammarKey, Future[BaseGrammarObject]] = {}
        self._lock = threading.Lock()
        self.num_compilations = 0

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("json")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("regex")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("ebnf")

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self._unsupported("structural_tag")

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        """Refuse schema features this backend would otherwise ignore; raises ``GrammarSpecError``."""

    def get_cached_or_future_value(
        self, key: GrammarKey, require_reasoning: bool = False
    ) -> tuple[BaseGrammarObject | Future[BaseGrammarObject], bool]:
        """``(copy, True)`` on a cache hit, else ``(future, False)`` resolving to a grammar object of its own."""
        with self._lock:
            cached = self.cache.get(key)
            if cached is not None:
                return _copy_with_stats(cached, is_cache_hit=True), True
            source = self._in_flight.get(key)
            if source is None:
                source = self.executor.submit(self._init_value_dispatch, key)
                self._in_flight[key] = source
                self.num_compilations += 1
        return _copy_when_done(source), False

    def set_cache(self, key: GrammarKey, value: BaseGrammarObject) -> None:
        """Store a compiled (or invalid) grammar for ``key``; its in-flight compile, if any, is done with."""
        with self._lock:
            self._in_flight.pop(key, None)
            self.cache.put(key, value, value.memory_size_bytes())

    def discard_pending(self, key: GrammarKey) -> None:
        """Forget an in-flight compile (after a timeout), so that the next request for ``key`` compiles anew.

        The compile itself goes on: other requests that joined it still receive its result.
        """
        with self._lock:
            self._in_flight.pop(key, None)

    def reset(self) -> None:
        with self._lock:
            for future in self._in_flight.values():
                future.cancel()
            self._in_flight.clear()
            self.cache.clear()

    def shutdown(self) -> None:
        self.reset()
        self.executor.shutdown(wait=False, cancel_futures=True)

    def _init_value_dispatch(self, key: GrammarKey) -> BaseGrammarObject:
        key_type = key[0]
        start = time.perf_counter()
        try:
            dispatch_type, spec = lower_constraint(key, self.max_spec_bytes, self.check_json_schema)
            grammar = self._dispatchers()[dispatch_type](spec)
        except GrammarSpecError as e:
            grammar = InvalidGrammarObject(str(e))
        except Exception as e:  # an engine's own error for bad input: report it, never raise out of the pool
            logger.debug("%s backend failed to compile a %s grammar", self.name, key_type, exc_info=True)
            grammar = InvalidGrammarObject(_engine_error_message(e))
        grammar.grammar_stats = GrammarStats(dispatch_type=key_type, compile_time_s=time.perf_counter() - start)
        return grammar

    def _dispatchers(self) -> dict[str, Callable[[str], BaseGrammarObject]]:
        return {
            "json": self.dispatch_json,
            "regex": self.dispatch_regex,
            "ebnf": self.dispatch_ebnf,
            "structural_tag": self.dispatch_structural_tag,
        }

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


def _copy_when_done(source: Future[BaseGrammarObject]) -> Future[BaseGrammarObject]:
    """A future of a private copy of ``source``'s result, so that requests sharing a compile share no state."""
    return map_future(source, lambda grammar: _copy_with_stats(grammar, is_cache_hit=False))


def map_future(
    source: Future[BaseGrammarObject], transform: Callable[[BaseGrammarObject], BaseGrammarObject]
) -> Future[BaseGrammarObject]:
    """A future resolving to ``transform(source.result())``; cancelled or failed when ``source`` is."""
    derived: Future[BaseGrammarObject] = Future()

    def on_done(done: Future[BaseGrammarObject]) -> None:
        if done.cancelled():
            derived.cancel()
            return
        try:
            derived.set_result(transform(done.result()))
        except Exception as e:
            derived.set_exception(e)

    source.add_done_callback(on_done)
    return derived


_MAX_ENGINE_MESSAGE_CHARS = 300


def _engine_error_message(error: Exception) -> str:
    """An engine's error text, first line only and bounded, so that a message never echoes a whole spec."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    if len(text) > _MAX_ENGINE_MESSAGE_CHARS:
        text = text[:_MAX_ENGINE_MESSAGE_CHARS] + "..."
    return text


__all__ = [
    "ENTRY_POINT_GROUP",
    "GRAMMAR_BACKEND_REGISTRY",
    "NO_GRAMMAR_BACKEND",
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarBackendArgs",
    "GrammarBackendFactory",
    "GrammarStats",
    "InvalidGrammarObject",
    "TokenRejectedError",
    "available_grammar_backends",
    "create_grammar_backend",
    "map_future",
    "register_entry_point_backends",
    "register_grammar_backend",
]
