"""First-time preparations started in the background as the session starts, for the tests that need them later.

On a new machine some tests first wait for work whose result the cache then keeps: the float32 weights
de-quantised from the GGUF file (~15 s), the kernels built for narrower instruction sets (3-5 s of compiler each at
``-O0``; only those that differ from the native build, ``build.narrows_here``), and the any-JSON index outlines-core
builds for ``json_object`` at the model's vocabulary (~7 s), which the grammar disk cache keeps for the in-process
schedulers of ``test_speculative`` (test servers compile theirs: ``COLD_GRAMMARS``).
Started at the session's start, at the lowest CPU priority, they take the core that the in-process tests before
them leave idle, instead of their own tests' time. A test or module names what it needs with
``@pytest.mark.prepared_ahead(name, ...)``; only what the session's tests name is started. Each preparation is a
command that does what the test would do first (the same cache, the same lock file), so a test that comes to it
meanwhile waits for it instead of repeating it (a grammar has no lock: such a test compiles its own), and one whose
preparation failed does it again itself and fails with its own error. With warm caches each command finds its
result and exits.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from cpu_kernels import build

_LOWEST_PRIORITY = "import os; os.nice(19)\n"
_KERNELS = (
    "from scheduler.server_args import ModelArgs\n"
    "from cpu_kernels import library\n"
    "library.load(ModelArgs().kernel_build_path, {target!r})\n"
)
PREPARATIONS: dict[str, str] = {
    "float32 weights": (
        "from scheduler.model.loader import load_model\n"
        "from scheduler.server_args import ModelArgs\n"
        "load_model(ModelArgs(weight_dtype='float32'))\n"
    ),
    "outlines any-JSON grammar": (
        "from scheduler.model.runner import ModelRunner\n"
        "from scheduler.server_args import GrammarArgs, ModelArgs\n"
        "from sglang_constrained.constraint_spec import make_grammar_key\n"
        "from sglang_constrained.cache.disk import open_grammar_disk_cache\n"
        "from sglang_constrained.backends.registry import create_grammar_backend\n"
        "args = GrammarArgs(grammar_backend='outlines')\n"
        "runner = ModelRunner(ModelArgs())\n"
        "disk_cache = open_grammar_disk_cache(args.grammar_disk_cache_path, args.grammar_disk_cache_max_bytes)\n"
        "backend = create_grammar_backend(args, runner.tokenizer, runner.vocab_size, runner.eos_token_ids,\n"
        "                                 disk_cache=disk_cache)\n"
        "grammar, is_cache_hit = backend.get_cached_or_future_value(make_grammar_key('json_object', None))\n"
        "is_cache_hit or grammar.result()\n"
        "backend.shutdown()\n"
    ),
    **{f"{target} kernels": _KERNELS.format(target=target) for target in ("scalar", "avx2", "avx2-vnni", "avx512")},
}
"""What each name prepares: a script run in a new interpreter."""


def _needed_here(name: str) -> bool:
    return not name.endswith(" kernels") or build.narrows_here(name.removesuffix(" kernels"))


class PrepareAhead:
    """The preparations the session's tests name, started once."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen[bytes]] = []

    def start(self, items: list[pytest.Item]) -> None:
        names = {name for item in items for mark in item.iter_markers("prepared_ahead") for name in mark.args}
        unknown = names - PREPARATIONS.keys()
        if unknown:
            raise pytest.UsageError(f"prepared_ahead names unknown preparations {sorted(unknown)}")
        for name in sorted(filter(_needed_here, names)):
            script = _LOWEST_PRIORITY + PREPARATIONS[name]
            self._started.append(
                subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )

    def stop_all(self) -> None:
        for process in self._started:
            process.kill()
            process.wait()
        self._started.clear()
