"""Constraints refused when they are compiled, never mid-generation: llguidance's silent acceptances and lazy errors
are found up front, and an xgrammar compile past its deadline is killed with its process."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psutil
import pytest

from scheduler.server_args import ServerArgs
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.errors import CompileTimeoutError
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.helpers import compile_grammar, compile_valid

REFUSED = [
    pytest.param("regex", "abc\\", "unfinished escape sequence", id="dangling-escape"),
    pytest.param("ebnf", "root ::=", "rule 'root' (line 1) has nothing after '::='", id="empty-rule"),
    pytest.param("ebnf", 'root ::= "a"\nroot ::= "b"', "rule 'root' is defined twice (lines 1 and 2)", id="duplicate"),
    pytest.param("ebnf", 'root ::= "a" b\nb ::= b "c"', "can produce nothing", id="unproductive-rule"),
    pytest.param("ebnf", 'root ::= a\na ::= "x" a', "Too many items", id="endless-rule"),
    pytest.param("json", {"$ref": "#"}, "can produce nothing", id="ref-to-root"),
    pytest.param("regex", "a{1000000}", "too many expressions", id="huge-repeat"),
]
ACCEPTED = [
    pytest.param("regex", "abc\\\\", id="escaped-backslash"),
    pytest.param("ebnf", 'root ::= ""', id="explicitly-empty"),
    pytest.param("ebnf", 'root ::= a\n# a comment\na ::= "x" | "x" a', id="recursive-rule"),
    pytest.param("json", {"type": "object", "properties": {"next": {"$ref": "#"}}}, id="recursive-schema"),
    pytest.param("regex", "a{1,100}", id="bounded-repeat"),
]


@pytest.fixture(scope="module")
def llguidance(server_args: ServerArgs, smollm2_tokenizer: TokenizerSetup) -> Iterator[GrammarPipeline]:
    setup = smollm2_tokenizer
    args = replace(server_args.grammar, grammar_backend="llguidance")
    backend = GrammarPipeline(GuidanceBackend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids))
    yield backend
    backend.shutdown()


@pytest.mark.parametrize(("kind", "spec", "words"), REFUSED)
def test_llguidance_refuses_at_compile_time(llguidance: GrammarPipeline, kind: str, spec: Any, words: str) -> None:
    grammar = compile_grammar(llguidance, kind, spec)
    assert words in getattr(grammar, "error_message", ""), grammar


@pytest.mark.parametrize(("kind", "spec"), ACCEPTED)
def test_llguidance_still_accepts_their_valid_neighbours(llguidance: GrammarPipeline, kind: str, spec: Any) -> None:
    compile_valid(llguidance, kind, spec)


def test_an_xgrammar_compile_past_its_deadline_is_killed(
    server_args: ServerArgs, smollm2_tokenizer: TokenizerSetup
) -> None:
    """The compile process is killed at the deadline: nothing spends CPU on the compile after it (a compile on a
    thread would go on for the tens of seconds this grammar takes)."""
    setup = smollm2_tokenizer
    args = replace(server_args.grammar, grammar_compile_timeout=5.0)  # ample for a regex on a busy machine
    xgrammar_backend = XGrammarGrammarBackend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    backend = GrammarPipeline(xgrammar_backend)
    # Tens of seconds (measured: 5.8 s for one string of 4,000 on an older EPYC; two of 6,000 compiled within 5 s on
    # a family-26 EPYC, four in 4.7 s on an AMD EPYC here, where the compiled grammar was then refused for its send
    # back, so six); a schema's bounds this long are refused up front.
    slow = "root ::= " + " ".join(f'"\\"" [^"\\\\{letter}]{{0,6000}} "\\""' for letter in "abcdef")
    try:
        assert xgrammar_backend.compile_processes is not None
        xgrammar_backend.compile_processes.wait_until_ready()
        compile_valid(backend, "regex", "[0-9]+")
        with pytest.raises(CompileTimeoutError, match="timed out after 5 s"):
            compile_grammar(backend, "ebnf", slow)
        before = _descendants_cpu_seconds()
        time.sleep(1.0)
        assert _descendants_cpu_seconds() - before < 0.3
        xgrammar_backend.compile_processes.wait_until_ready()
        compile_valid(backend, "regex", "[a-z]+")  # a new compile process serves the next compile
    finally:
        backend.shutdown()


def _descendants_cpu_seconds() -> float:
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            times = child.cpu_times()
            total += times.user + times.system
    return total
