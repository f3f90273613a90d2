"""A compiled grammar as it is kept and sent: what it took to obtain, its export, and the store that keeps exports
beyond a process."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from sglang_constrained.constraint_spec import GrammarKey


@dataclass(frozen=True)
class GrammarStats:
    """What it took to obtain a grammar object: which dispatch built it, how long, and whether it was cached.

    ``chosen_backend`` and ``fallback_reasons`` are set by ``auto``: the backend that compiled the grammar (None when
    every backend refused), and ``(backend, message)`` for each backend of the order it passed over (refused, failed,
    or still compiling when another finished). ``narrowing``: how the grammar admits less than the JSON schema
    allows (``json_schema_narrowing``), None when it enforces the schema exactly. ``is_disk_cache_hit``: the
    compiled grammar was read from the disk cache, not compiled; ``compile_time_s`` is then the time the read took.
    """

    dispatch_type: str
    compile_time_s: float
    is_cache_hit: bool = False
    chosen_backend: str | None = None
    fallback_reasons: tuple[tuple[str, str], ...] = ()
    narrowing: str | None = None
    is_disk_cache_hit: bool = False


@dataclass(frozen=True)
class GrammarExport:
    """A compiled grammar as another process imports it into a backend like the one that compiled it (same kind,
    tokenizer and settings): ``payload`` is the backend's serialised form, None for an invalid grammar, whose
    ``error_message`` says why. Plain data: it pickles."""

    payload: bytes | str | None
    error_message: str = ""
    stats: GrammarStats | None = None


class CompiledGrammarStore(Protocol):
    """Valid grammars' exports kept beyond this process, by backend identity (``compile_identity``) and constraint
    key (``cache.disk.GrammarDiskCache``). A backend reads it on a miss and writes what it compiles."""

    def load(self, identity: dict[str, Any], key: GrammarKey) -> GrammarExport | None:
        """The export stored for ``key`` by a backend of ``identity``, or None."""

    def store_later(
        self,
        identity: dict[str, Any],
        key: GrammarKey,
        export: Callable[[], GrammarExport],
        compile_s: float,
        read_back: Callable[[GrammarExport], object],
    ) -> None:
        """Store ``export()`` (a valid grammar's, which took ``compile_s`` to compile) for ``key``, off the caller's
        thread, if reading it back (``read_back``: the backend's import) is faster than compiling it; failures are
        not raised."""

    def discard(self, identity: dict[str, Any], key: GrammarKey) -> None:
        """Forget ``key``'s entry (it would not import)."""

    def close(self) -> None:
        """Finish the queued writes; store nothing more."""
