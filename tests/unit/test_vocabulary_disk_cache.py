"""A token table on disk reads back exactly as written, any bytes in any token, or not at all: a file cut short or
grown reads as no entry, and a folder that cannot be written is passed over with a warning."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_constrained.cache.vocabulary_disk import read_token_table, write_token_table

HEADER = {"xgrammar_metadata": '{"vocab_type": 0}'}


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.binary(max_size=12), max_size=40))
def test_a_table_reads_back_as_written_and_a_cut_or_grown_file_reads_as_none(tokens: list[bytes]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "entry.vocab"
        write_token_table(path, HEADER, tokens)
        assert read_token_table(path) == ({**HEADER, "num_tokens": len(tokens)}, tuple(tokens))
        data = path.read_bytes()
        for cut in range(len(data)):
            path.write_bytes(data[:cut])
            assert read_token_table(path) is None, cut
        path.write_bytes(data + b"\0")
        assert read_token_table(path) is None
        assert [p.name for p in Path(folder).iterdir()] == ["entry.vocab"], "no temporary file is left behind"


def test_a_missing_entry_reads_as_none(tmp_path: Path) -> None:
    assert read_token_table(tmp_path / "absent.vocab") is None


def test_a_folder_that_cannot_be_written_is_passed_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.WARNING):
        write_token_table(not_a_folder / "vocabularies" / "entry.vocab", HEADER, [b"a"])
    assert "the decoded vocabulary is not kept in" in caplog.text
