"""The grammar contract: what a backend writes, and the grammar objects it returns (SGLang's contract, plus vLLM's
``validate_tokens``).

A backend turns a constraint key ``(key_type, spec)`` into a ``BaseGrammarObject``; the scheduler fills one int32
bitmask row per constrained request from that object before sampling and feeds it every accepted token. A backend
subclasses ``BaseGrammarBackend`` and writes one compile per constraint kind (its abstract methods); everything
else it may write is an optional capability, grouped and defaulted there. Bad input never raises: it becomes an
``InvalidGrammarObject`` whose message says what is wrong. The compile pipeline around a backend (compile slots
and deadline, memory and disk caches, sharing with compile processes and replicas) is
``sglang_constrained.backends.pipeline.GrammarPipeline``; backends are named and built by
``sglang_constrained.backends.registry``.
"""

from __future__ import annotations

import copy
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from sglang_constrained.cache.compiled import GrammarExport, GrammarStats
from sglang_constrained.cache.identity import code_fingerprint
from sglang_constrained.compile.control import CompileControl
from sglang_constrained.constraint_spec import GrammarKey, compile_method, lower_constraint
from sglang_constrained.errors import GrammarSpecError, TokenRejectedError, bounded_message
from sglang_constrained.schema.soundness import sound_json_schema, user_patterns_in
from sglang_constrained.schema.strict_mode import close_as_strict_mode, closing_is_exact, strict_mode_narrowing
from triton_ops.bitmask_format import VocabMaskLayout, allocate_bitmask
from triton_ops.bitmask_ops import apply_token_bitmask_inplace

logger = logging.getLogger(__name__)


class GrammarBackendArgs(Protocol):
    """The server settings a grammar backend reads (``scheduler.server_args.GrammarArgs`` provides them)."""

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

    A grammar object writes ``accept_token``, ``rollback``, ``is_terminated``, ``fill_vocab_mask`` and ``copy`` (its
    abstract methods). It may write ``validate_tokens`` (speculative drafts), ``state_key`` (exact endings),
    ``memory_size_bytes`` (the cache's byte bound) and the jump-forward trio; a backend with another mask layout
    writes the ``*_vocab_mask`` methods together. Vocabulary masks are int32 bitmasks of shape
    ``[batch, ceil(vocab_size / 32)]``: token ``t`` is allowed iff bit ``t % 32`` of word ``t // 32`` is set.
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
        """True once the grammar has accepted a stop token where it may end. Where it can take nothing but a stop
        token it has not: the stop token is still an output token, on every backend alike."""

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

    def accepts_to_end(self, tokens: Sequence[int]) -> bool | None:
        """Whether ``tokens`` take the grammar from here to its end, in one call into the engine; None where the engine
        has no such call (the caller walks them token by token). The state does not change."""
        return None

    def state_key(self) -> Hashable | None:
        """A value equal for two states of this grammar object exactly when they allow the same token sequences from
        here on (equal keys must mean equal futures; unequal keys for equal futures only cost the search time), or None
        where the engine does not expose its state (llguidance's lexer and parser): ``endings.exact`` needs it to tell
        states apart. The state does not change."""
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


class GrammarBackend(ABC):
    """What a ``GrammarPipeline`` runs: constraint keys into grammar objects, on the caller's thread.

    Subclass ``BaseGrammarBackend``, which compiles each constraint kind; subclass this directly only to compile whole
    keys another way (``auto`` races other backends). Required: ``build_grammar``. Optional, each with a default:

    - compiling elsewhere: ``build_exportable`` (a compile process's export kept as it came);
    - sharing compiled grammars (compile processes, data-parallel replicas, the disk cache):
      ``can_share_grammars`` with ``serialize_grammar`` and ``deserialize_grammar`` (or ``export_grammar`` and
      ``import_grammar`` whole);
    - ``compile_identity``: extended with what else decides a compile (the engine's version, the tokenizer's
      fingerprint), which names disk-cache entries;
    - for ``auto``: ``takes_as_written``; ``auto`` also sets ``require_exact``;
    - resources of its own (compile processes): ``wait_until_ready`` and ``shutdown``.
    """

    name: str = "base"
    require_exact: bool = False
    """Compile each JSON schema exactly, or refuse it (``GrammarSpecError``) where this backend would narrow it
    (``json_schema_narrowing``). ``auto`` sets it on its backends."""
    closes_open_schemas: bool = False
    """Close each JSON schema as xgrammar's strict mode does (``close_as_strict_mode``) before compiling it exactly,
    where the closing can be written out (``closing_is_exact``; elsewhere the schema is taken as written). ``auto``
    sets it on its backends while narrowing is allowed, so that its choice, which a slow compile changes, changes no
    language: a schema is closed alike, or left alike, whichever backend compiles it."""

    def __init__(self, server_args: GrammarBackendArgs, vocab_size: int) -> None:
        self.server_args = server_args
        self.vocab_size = vocab_size
        self.mask_layout = VocabMaskLayout(vocab_size)
        """How this backend's grammars fill masks (the contract's int32 bitmask unless a backend says otherwise)."""
        self.max_spec_bytes = server_args.grammar_max_spec_bytes

    @abstractmethod
    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """Compile ``key`` on the caller's thread; ``control`` carries the compile's deadline and cancellation (a
        backend that compiles elsewhere stops there when asked). Never raises for a bad spec: a refusal is an
        ``InvalidGrammarObject``."""

    def build_exportable(
        self, key: GrammarKey, control: CompileControl | None = None
    ) -> tuple[BaseGrammarObject, Callable[[], GrammarExport]]:
        """``build_grammar``, and how to export its result later (on the disk cache's writer thread). A backend that
        receives a compiled grammar already exported (from a compile process) hands that export over instead."""
        grammar = self.build_grammar(key, control)
        return grammar, lambda: self.export_grammar(grammar)

    @property
    def can_share_grammars(self) -> bool:
        """Whether ``export_grammar`` / ``import_grammar`` work, so that one process compiles for many."""
        return False

    def serialize_grammar(self, grammar: BaseGrammarObject) -> bytes | str:
        """The compiled form of a valid ``grammar`` of this backend (backends with ``can_share_grammars``)."""
        raise NotImplementedError(f"the {self.name} grammar backend cannot share its compiled grammars")

    def deserialize_grammar(self, payload: bytes | str) -> BaseGrammarObject:
        """The inverse of ``serialize_grammar``."""
        raise NotImplementedError(f"the {self.name} grammar backend cannot share its compiled grammars")

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
            "closes_open_schemas": self.closes_open_schemas,
            "vocab_size": self.vocab_size,
        }

    def takes_as_written(self, key: GrammarKey) -> bool:
        """Whether this backend compiles ``key``'s spec in its own syntax, with no conversion first (a Lark grammar
        for llguidance, GBNF for xgrammar); ``--grammar-backend auto`` asks such backends first."""
        return False

    def wait_until_ready(self) -> None:
        """Block until the backend can compile at once (a backend that starts compile processes waits for them), so
        that no request's compile deadline pays for the server's start-up."""

    def shutdown(self) -> None:
        """Release what the backend started (compile processes); the pipeline calls it once, at its own shutdown."""


class BaseGrammarBackend(GrammarBackend):
    """SGLang's backend: one compile per constraint kind.

    A backend writes ``dispatch_json``, ``dispatch_regex``, ``dispatch_ebnf`` and ``dispatch_structural_tag``, each
    taking the spec as a string (a JSON schema already prepared, see below) and returning a grammar object; a kind it
    does not support returns ``self.unsupported(kind)``, and an engine's error for bad input may simply be raised
    (it becomes an ``InvalidGrammarObject`` with the engine's message). It may write, beside ``GrammarBackend``'s
    optional capabilities, the JSON-schema hooks: ``check_json_schema`` (refuse features it would ignore),
    ``json_schema_narrowing`` (say where its grammar would admit less than the schema) and ``prepare_json_schema``
    (rewrite a schema for its engine, after this class's checks).
    """

    @abstractmethod
    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        """The grammar of a JSON schema (the prepared schema's JSON text)."""

    @abstractmethod
    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        """The grammar of a regular expression."""

    @abstractmethod
    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        """The grammar of an EBNF grammar (GBNF, root rule ``root``, or Lark, rule ``start``)."""

    @abstractmethod
    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        """The grammar of a structural tag (its JSON text)."""

    def unsupported(self, key_type: str) -> InvalidGrammarObject:
        """The refusal of a constraint kind this backend does not compile."""
        return InvalidGrammarObject(f"the {self.name} grammar backend does not support {key_type} constraints")

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        """Refuse schema features this backend would otherwise ignore; raises ``GrammarSpecError``."""

    def json_schema_narrowing(self, schema: Any) -> str | None:
        """How this backend's grammar for ``schema`` would admit less than the schema allows, naming the feature
        and where (``"narrows 'unlisted properties' (at /a): ..."``); None when it enforces it exactly. Pure: looks
        at the schema only."""
        return None

    def closes(self, schema: Any) -> bool:
        """Whether this backend closes ``schema`` before its checks (``closes_open_schemas``, where the closing can
        be written out: ``closing_is_exact``; elsewhere it takes the schema as written)."""
        return self.closes_open_schemas and closing_is_exact(schema)

    def closed_schema(self, schema: Any) -> Any:
        """``schema`` as this backend takes it before its checks: closed as strict mode closes it (a copy) where it
        ``closes`` it, else itself."""
        return close_as_strict_mode(copy.deepcopy(schema)) if self.closes(schema) else schema

    def compiled_narrowing(self, schema: Any) -> str | None:
        """How the grammar this backend compiles for ``schema`` admits less than it allows (its closing first, then
        the backend's own narrowing of what it compiles), for the grammar's stats; None when exact."""
        if not self.closes(schema):
            return self.json_schema_narrowing(schema)
        return strict_mode_narrowing(schema) or self.json_schema_narrowing(close_as_strict_mode(copy.deepcopy(schema)))

    def prepare_json_schema(self, schema: Any, originals: dict[str, str] | None = None) -> Any:
        """The schema to compile for a request's ``schema``: closed as strict mode closes it (with
        ``closes_open_schemas``), checked (and, with ``require_exact``, refused where this backend would narrow it),
        then its formats and patterns made sound (``originals`` receives the user's text of each rewritten pattern,
        for messages)."""
        schema = self.closed_schema(schema)
        self.check_json_schema(schema)
        if self.require_exact and (narrowing := self.json_schema_narrowing(schema)) is not None:
            raise GrammarSpecError(
                f"the {self.name} grammar backend would not enforce this schema exactly: {narrowing}"
            )
        return sound_json_schema(schema, originals)

    def build_grammar(self, key: GrammarKey, control: CompileControl | None = None) -> BaseGrammarObject:
        """``key`` lowered to its kind's spec (JSON schemas prepared) and compiled by that kind's ``dispatch_*``;
        a refusal or an engine's error becomes an ``InvalidGrammarObject``. Here a compile runs to its end."""
        key_type = key[0]
        start = time.perf_counter()
        originals: dict[str, str] = {}
        schemas: list[Any] = []

        def prepare(schema: Any) -> Any:
            schemas.append(schema)
            return self.prepare_json_schema(schema, originals)

        try:
            grammar = self._dispatch(key, prepare)
        except GrammarSpecError as e:
            grammar = InvalidGrammarObject(user_patterns_in(str(e), originals))
        except Exception as e:  # an engine's own error for bad input: report it, never raise out of the pool
            logger.debug("%s backend failed to compile a %s grammar", self.name, key_type, exc_info=True)
            message = bounded_message(user_patterns_in(str(e), originals)) if str(e).strip() else type(e).__name__
            grammar = InvalidGrammarObject(message)
        narrowing = None
        if schemas and not isinstance(grammar, InvalidGrammarObject):
            narrowing = self.compiled_narrowing(schemas[0])
        grammar.grammar_stats = GrammarStats(
            dispatch_type=key_type, compile_time_s=time.perf_counter() - start, narrowing=narrowing
        )
        return grammar

    def _dispatch(self, key: GrammarKey, prepare: Callable[[Any], Any]) -> BaseGrammarObject:
        """The spec-size limit checked, ``key`` lowered to a kind this class compiles, and that kind's compile (the
        table's ``compile_method``; a kind a backend has no method for is refused as unsupported)."""
        compiled_kind, spec = lower_constraint(key, self.max_spec_bytes, prepare)
        compile_kind = getattr(self, compile_method(compiled_kind), None)
        grammar: BaseGrammarObject = compile_kind(spec) if compile_kind is not None else self.unsupported(compiled_kind)
        return grammar


def common_prefix_length(old_ids: Sequence[int], new_ids: Sequence[int]) -> int:
    """How many leading ids two token sequences share (where ``jump_and_retokenize`` rolls back to)."""
    for position, (old, new) in enumerate(zip(old_ids, new_ids, strict=False)):
        if old != new:
            return position
    return min(len(old_ids), len(new_ids))


__all__ = [
    "BaseGrammarBackend",
    "BaseGrammarObject",
    "GrammarBackend",
    "GrammarBackendArgs",
    "InvalidGrammarObject",
    "TokenRejectedError",
    "common_prefix_length",
]
