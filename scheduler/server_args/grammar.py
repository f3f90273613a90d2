"""The grammar part of the settings: the backend, its compiles and caches, and the reasoning a constraint waits for.
It is what the grammar library receives: it satisfies ``sglang_constrained.base_grammar_backend.GrammarBackendArgs``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from scheduler.server_args.environment import available_cores, cache_path, default_compile_timeout
from scheduler.server_args.options import cache_dir_option, comma_separated, option
from sglang_constrained.backends.reasoning_formats import REASONING_FORMATS
from sglang_constrained.backends.registry import available_grammar_backends, check_grammar_backend_order

GRAMMAR_BACKEND_ORDER = ("xgrammar", "llguidance", "outlines")
COMPILE_THREADS = max(1, available_cores() - 1)
"""The cores less one, left to the loop."""


@dataclass(frozen=True)
class GrammarArgs:
    """How constraints are compiled, cached and applied; ``compile_timeout_s`` and the cache paths resolve the
    defaults a user left to the environment."""

    grammar_backend: str = option("auto", lambda: f"one of {available_grammar_backends()} or a registered name")
    grammar_backend_order: tuple[str, ...] = option(
        GRAMMAR_BACKEND_ORDER,
        "the backends --grammar-backend auto asks for each constraint, in turn (comma-separated; default: "
        f"{','.join(GRAMMAR_BACKEND_ORDER)}); the first that enforces it exactly compiles it",
        type=comma_separated,
    )
    constrained_json_whitespace_pattern: str | None = option(
        None, "regex for the whitespace allowed between JSON tokens"
    )
    constrained_json_disable_any_whitespace: bool = option(False, "compact JSON: no whitespace between tokens")
    reasoning_parser: str | None = option(
        None,
        "the model thinks in <think>...</think>: answers report it apart (reasoning_content), and a constraint "
        "applies from the think-end token on",
        choices=sorted(REASONING_FORMATS),
    )
    thinking_budget: int | None = option(
        None,
        "with --reasoning-parser: the most reasoning tokens a request may think before the think-end token is "
        "forced, unless the request sets its own (default: no limit)",
    )
    disable_budget_aware_constraints: bool = option(
        False,
        "cut constrained outputs at max_tokens as they stand (by default they are steered, near the budget, to end "
        "inside it in a state the constraint accepts, and a budget below the constraint's shortest output is "
        "refused)",
    )
    grammar_compile_timeout: float | None = option(None, "seconds (default: poll interval x max poll iterations)")
    grammar_compile_threads: int = option(
        COMPILE_THREADS,
        "grammars compiled at once, each on one core at low CPU priority (xgrammar's in a compile process each); "
        "default: the cores less one, left to the loop",
    )
    grammar_compile_slow_after: float = option(
        1.0,
        "seconds after which a running compile is slow: it leaves its compile thread's slot to the next compile (an "
        "xgrammar compile process drops to the lowest CPU priority), and auto starts the next backend of its order "
        "beside it",
    )
    grammar_max_slow_compiles: int = option(
        2 * COMPILE_THREADS,
        "slow compiles that may run beside the compile threads at once (default: twice the threads; each xgrammar "
        "one holds a compile process); 0: a slow compile keeps its slot",
    )
    grammar_compile_max_memory: int | None = option(
        4096, "MiB an xgrammar compile process may hold: past it the compile is killed and its request told so"
    )
    grammar_auto_allow_narrowing: bool = option(
        True,
        "auto closes each JSON schema as xgrammar's strict mode does (objects admit only the properties they list, "
        "arrays only the items they describe; a schema whose closing JSON Schema cannot say is left as written), as "
        "xgrammar alone does (the default: a model does not invent keys), "
        "and whichever backend compiles it enforces that exactly (one language, whichever auto chooses); the "
        "grammar's stats name the narrowing. --no-grammar-auto-allow-narrowing: every schema enforced as written",
        action=argparse.BooleanOptionalAction,
    )
    grammar_cache_max_entries: int = option(1024)
    grammar_cache_max_bytes: int = option(512 * 1024 * 1024)
    grammar_cache_dir: str | None = option(
        None,
        "where compiled grammars are kept for the next start and the other ranks and replicas to load instead of "
        "compiling (default: grammars/ in the cache dir); entries are named by the backend, its engine's version, "
        "the tokenizer, the flags that change a grammar and the constraint, so a stale one is never read",
    )
    disable_grammar_disk_cache: bool = option(
        False, "keep compiled grammars in memory only: every start compiles them anew"
    )
    grammar_disk_cache_max_bytes: int = option(
        2 * 1024 * 1024 * 1024,
        "bytes the grammar cache dir may hold; past it the least recently used grammars are removed",
    )
    grammar_max_spec_bytes: int = option(1024 * 1024, "larger constraint specs are refused")
    cache_dir: str | None = cache_dir_option()

    @property
    def compile_timeout_s(self) -> float:
        return default_compile_timeout() if self.grammar_compile_timeout is None else self.grammar_compile_timeout

    @property
    def grammar_disk_cache_path(self) -> Path | None:
        """Where compiled grammars are kept across restarts (``grammar_disk_cache``); None when that is off."""
        if self.disable_grammar_disk_cache:
            return None
        return (
            cache_path(self.cache_dir) / "grammars" if self.grammar_cache_dir is None else Path(self.grammar_cache_dir)
        )

    @property
    def vocabulary_cache_path(self) -> Path:
        """Where decoded tokenizer vocabularies are kept across restarts (``vocabulary_disk_cache``)."""
        return cache_path(self.cache_dir) / "vocabularies"

    def __post_init__(self) -> None:
        if self.grammar_backend not in available_grammar_backends():
            raise ValueError(
                f"unknown grammar backend {self.grammar_backend!r}; choose one of {available_grammar_backends()}"
            )
        check_grammar_backend_order(self.grammar_backend_order)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_FORMATS)}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError("--thinking-budget must be 0 or more")
        for name in ("grammar_compile_threads", "grammar_max_spec_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.grammar_compile_timeout is not None and self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be positive")
        if self.grammar_compile_slow_after <= 0:
            raise ValueError("--grammar-compile-slow-after must be positive")
        if self.grammar_max_slow_compiles < 0:
            raise ValueError("--grammar-max-slow-compiles must be 0 (compiles keep their slot) or more")
        if self.grammar_disk_cache_max_bytes < 0:
            raise ValueError("--grammar-disk-cache-max-bytes must be 0 (nothing kept) or more")
        if self.grammar_compile_max_memory is not None and self.grammar_compile_max_memory <= 0:
            raise ValueError("--grammar-compile-max-memory must be positive (MiB)")
