"""Files written whole or not at all: a reader (another process, a later start) never sees half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

TEMPORARY_PREFIX = ".writing-"
"""How a file being written is named until it is renamed: a folder's owner can remove such files a writer left."""


def write_atomically(path: Path, pieces: Iterable[bytes]) -> None:
    """Write ``pieces`` to a temporary file beside ``path`` (its name starts with ``TEMPORARY_PREFIX``), flush it to
    the disk, then rename it to ``path``. On any failure the temporary file is removed and the error raised."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=TEMPORARY_PREFIX)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.writelines(pieces)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
