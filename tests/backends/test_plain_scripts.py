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
from collections.abc import Iterator

import pytest

from tests.fresh_interpreter import REPO_ROOT

COMPILE = """
from scheduler.server_args import GrammarArgs, ModelArgs
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup


def compile_once(where):
    setup = load_tokenizer_setup("smollm2", ModelArgs().cache_path)
    backend = create_grammar_backend(
        GrammarArgs(grammar_backend="xgrammar"), setup.tokenizer, setup.vocab_size, setup.eos_token_ids
    )
    value, _ = backend.get_cached_or_future_value(make_grammar_key("regex", "[0-9]{3}"))
    grammar = value.result(timeout=300)
    processes = "processes" if backend.backend.compile_processes is not None else "threads"
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


SCRIPTS = {"no_guard.py": WITHOUT_GUARD, "with_guard.py": WITH_GUARD}


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both scripts, started at once: each is seconds of imports in its processes, which the other core can run while
    the first test waits for its own script."""
    folder = tmp_path_factory.mktemp("plain_scripts")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    runs = {}
    for name, source in SCRIPTS.items():
        (folder / name).write_text(textwrap.dedent(source))
        runs[name] = subprocess.Popen(
            [sys.executable, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environment,
            cwd=folder,
        )
    yield runs
    for run in runs.values():
        run.kill()
        run.communicate()


def finished(started: dict[str, subprocess.Popen[str]], name: str) -> subprocess.CompletedProcess[str]:
    run = started[name]
    stdout, stderr = run.communicate(timeout=600)
    return subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)


def test_a_script_without_a_main_guard_compiles_in_threads(started: dict[str, subprocess.Popen[str]]) -> None:
    done = finished(started, "no_guard.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["top level: XGrammarGrammar in threads"]
    [warning] = done.stderr.splitlines()
    assert "no 'if __name__ == \"__main__\":' guard" in warning


def test_a_pool_worker_and_an_exiting_interpreter_compile_in_threads_and_nothing_prints_a_traceback(
    started: dict[str, subprocess.Popen[str]],
) -> None:
    """The main process compiles in processes and exits without shutdown(); no compile process complains."""
    done = finished(started, "with_guard.py")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "main: XGrammarGrammar in processes",
        "pool worker: XGrammarGrammar in threads",
        "at exit: XGrammarGrammar in threads",
    ]
    warnings = done.stderr.splitlines()
    assert len(warnings) == 2, done.stderr
    assert "daemonic process" in warnings[0] and "the interpreter is exiting" in warnings[1]
