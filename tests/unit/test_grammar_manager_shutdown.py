"""Shutting the grammar manager down while a compile is in flight: the compile that finishes afterwards writes
into no file the process opened since (closed descriptor numbers are handed out again)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from scheduler.grammar_manager import GrammarManager
from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.unit.test_registry_and_cache import SCHEMA_KEY, CountingBackend


@pytest.fixture
def held_backend(smollm2_tokenizer: TokenizerSetup) -> Iterator[GrammarPipeline]:
    backend = GrammarPipeline(
        CountingBackend(
            GrammarArgs(), smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, smollm2_tokenizer.eos_token_ids
        )
    )
    yield backend
    backend.backend.release.set()
    backend.shutdown()


def test_a_compile_finishing_after_close_writes_into_no_reopened_file(held_backend: GrammarPipeline) -> None:
    manager = GrammarManager(held_backend)
    req = Req(rid="late", client_id=b"test", prompt_ids=[1], sampling_params=SamplingParams(), grammar_key=SCHEMA_KEY)
    held_backend.backend.release.clear()
    assert manager.process_req_with_grammar(req), "the compile is held, so the request waits"
    closed_fds = {manager.wakeup_fd, manager._wakeup_write}
    manager.close()
    manager.close()  # a second close is harmless
    read_fd, write_fd = os.pipe()  # takes the lowest free numbers: the ones close() just gave back
    try:
        os.set_blocking(read_fd, False)
        held_backend.backend.release.set()
        compiling = req.grammar
        assert isinstance(compiling, Future)
        compiling.result(timeout=60)
        if {read_fd, write_fd} != closed_fds:
            pytest.skip("another thread took the closed descriptor numbers first")
        with pytest.raises(BlockingIOError):
            os.read(read_fd, 1)
    finally:
        os.close(read_fd)
        os.close(write_fd)
