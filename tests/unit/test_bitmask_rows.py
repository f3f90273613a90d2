"""The row addresser that guards raw-pointer mask writes (llguidance, outlines): checked once per buffer, yet a
buffer changed in place so that a write could leave its storage is checked again."""

import pytest
import torch

from sglang_constrained.backends.bitmask_rows import BitmaskRowAddresser


def test_rows_are_addressed_by_their_stride_and_negative_rows_count_from_the_end() -> None:
    buffer = torch.zeros(4, 10, dtype=torch.int32)
    view = buffer[:, :8]  # rows of 8 words, 10 apart
    rows = BitmaskRowAddresser(min_words=8, owner="test")
    assert rows.row_address(view, 2) == buffer[2].data_ptr()
    assert rows.row_address(view, -1) == buffer[3].data_ptr()
    assert rows.row_words == 8
    with pytest.raises(IndexError, match="row 4"):
        rows.row_address(view, 4)


@pytest.mark.parametrize(
    "bad",
    [
        torch.zeros(2, 7, dtype=torch.int32),  # too narrow
        torch.zeros(2, 8, dtype=torch.int64),
        torch.zeros(16, dtype=torch.int32),
        torch.zeros(8, 2, dtype=torch.int32).t(),  # words not contiguous
    ],
)
def test_buffers_an_engine_cannot_write_into_are_refused(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="at least 8 words"):
        BitmaskRowAddresser(min_words=8, owner="test").row_address(bad, 0)


def test_a_buffer_moved_in_place_is_checked_again() -> None:
    rows = BitmaskRowAddresser(min_words=8, owner="test")
    buffer = torch.zeros(2, 8, dtype=torch.int32)
    rows.row_address(buffer, 1)
    buffer.set_(torch.zeros(2, 4, dtype=torch.int32))  # now too narrow, at a new address
    with pytest.raises(ValueError, match="at least 8 words"):
        rows.row_address(buffer, 1)
    buffer.set_(torch.zeros(3, 8, dtype=torch.int32))
    assert rows.row_address(buffer, 2) == buffer[2].data_ptr()
