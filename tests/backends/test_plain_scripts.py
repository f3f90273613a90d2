"""The library from plain scripts and worker processes: the xgrammar backend compiles without a ``__main__`` guard,
in a daemonic pool worker and at interpreter exit (in threads, with one warning line each), and a script that exits
without ``shutdown()`` leaves no traceback behind (its compile processes used to print ``ConnectionResetError``).

Each case is a fresh Python process running a script, because what is tested is how a process starts and ends; no
server is involved.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

COMPILE = """
from scheduler.server_args import ServerArgs
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.registry import create_grammar_backend
from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup


def compile_once(where):
    setup = load_tokenizer_setup("smollm2", ServerArgs().cache_path)
    backend = create_grammar_backend(
        ServerArgs(grammar_backend="xgrammar"), setup.tokenizer, setup.vocab_size, setup.eos_token_ids
    )
    value, _ = backend.get_cached_or_future_value(make_grammar_key("regex", "[0-9]{3}"))
    grammar = value.result(timeout=300)
    processes = "processes" if backend.compile_processes is not None else "threads"
    print(f"{where}: {type(grammar).__name__} in {processes}", flush=True)
    return backend
"""

WITHOUT_GUARD = (
    COMPILE
    + """
compile_once("top level")
"""
)

WITH_GUARD = (
    COMPILE
    + """
import atexit
import multiprocessing


def in_worker(_):
    compile_once("pool worker")


if __name__ == "__main__":
    compile_once("main")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.map(in_worker, [0])
    atexit.register(compile_once, "at exit")
"""
)


def run_script(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=environment, cwd=tmp_path
    )


def test_a_script_without_a_main_guard_compiles_in_threads(tmp_path: Path) -> None:
    done = run_script(tmp_path, "no_guard.py", WITHOUT_GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["top level: XGrammarGrammar in threads"]
    [warning] = done.stderr.splitlines()
    assert "no 'if __name__ == \"__main__\":' guard" in warning


def test_a_pool_worker_and_an_exiting_interpreter_compile_in_threads_and_nothing_prints_a_traceback(
    tmp_path: Path,
) -> None:
    """The main process compiles in processes and exits without shutdown(); no compile process complains."""
    done = run_script(tmp_path, "with_guard.py", WITH_GUARD)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "main: XGrammarGrammar in processes",
        "pool worker: XGrammarGrammar in threads",
        "at exit: XGrammarGrammar in threads",
    ]
    warnings = done.stderr.splitlines()
    assert len(warnings) == 2, done.stderr
    assert "daemonic process" in warnings[0] and "the interpreter is exiting" in warnings[1]
