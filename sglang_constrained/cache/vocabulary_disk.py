"""Token tables kept on disk: a decoded vocabulary as a file that reads back in milliseconds.

An entry is a JSON header line (what the reader needs besides the tokens), each token's byte length (uint32, little
endian), then the tokens' bytes one after the other. It is written whole or not at all (``atomic_file``); a file
that does not read back as a whole (another format, a damaged disk) is no entry. ``vocabulary.tokenizer_vocabulary``
names the entries and decides what goes in the header.
"""

from __future__ import annotations

import json
import logging
import sys
from array import array
from collections.abc import Sequence
from itertools import accumulate, pairwise
from pathlib import Path
from typing import Any

from sglang_constrained.cache.atomic_file import write_atomically

logger = logging.getLogger(__name__)


def _lengths_array() -> array[int]:
    return array("I")


def read_token_table(path: Path) -> tuple[dict[str, Any], tuple[bytes, ...]] | None:
    """The header and tokens of the entry at ``path``; None if there is none or it does not read as a whole."""
    try:
        data = path.read_bytes()
        header_end = data.index(b"\n")
        header = json.loads(data[:header_end])
        lengths = _lengths_array()
        lengths_end = header_end + 1 + header["num_tokens"] * lengths.itemsize
        lengths.frombytes(data[header_end + 1 : lengths_end])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if sys.byteorder != "little":
        lengths.byteswap()
    if len(lengths) != header["num_tokens"] or lengths_end + sum(lengths) != len(data):
        return None
    ends = list(accumulate(lengths, initial=lengths_end))
    return header, tuple(data[start:end] for start, end in pairwise(ends))


def write_token_table(path: Path, header: dict[str, Any], tokens: Sequence[bytes]) -> None:
    """Write the entry at ``path``; a directory that cannot be written is logged and left without it."""
    lengths = _lengths_array()
    lengths.extend(len(token) for token in tokens)
    if sys.byteorder != "little":
        lengths.byteswap()
    pieces = [json.dumps({**header, "num_tokens": len(tokens)}).encode() + b"\n", lengths.tobytes(), b"".join(tokens)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, pieces)
    except OSError as error:
        logger.warning("the decoded vocabulary is not kept in %s: %s", path.parent, error)
