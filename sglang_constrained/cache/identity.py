"""Fingerprints of what decides a compiled grammar besides its constraint: the code that compiles it, the engine's
version and the tokenizer's vocabulary. ``GrammarBackend.compile_identity`` gathers them, and the grammar disk
cache names its entries by that identity, so that an entry is never read by a backend that would compile the key
to another grammar.

Imports no engine: a backend passes its own vocabulary's bytes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]


def tokens_fingerprint(token_bytes: Iterable[bytes], *facts: object) -> str:
    """A hex SHA-256 of every token's bytes, in id order, and of ``facts`` (JSON-serialisable: stop and special
    ids, the model's vocab size, an engine's tokenizer metadata)."""
    digest = hashlib.sha256()
    for token in token_bytes:
        digest.update(len(token).to_bytes(4, "little"))
        digest.update(token)
    digest.update(json.dumps(facts, sort_keys=True).encode())
    return digest.hexdigest()


@functools.cache
def engine_version(distribution: str) -> str:
    """``"<distribution> <installed version>"``."""
    return f"{distribution} {importlib.metadata.version(distribution)}"


def code_fingerprint(backend_class: type) -> str:
    """A hex SHA-256 of the source of every module of this package (its ``testing`` subpackage aside) and of the
    modules outside it that define ``backend_class`` or its bases (a registered backend): any change to the code
    that lowers and compiles constraints gives a new fingerprint. Read once per process."""
    return _modules_fingerprint(tuple(cls.__module__ for cls in backend_class.__mro__))


@functools.cache
def _modules_fingerprint(module_names: tuple[str, ...]) -> str:
    files = {path for path in PACKAGE_DIR.rglob("*.py") if path.relative_to(PACKAGE_DIR).parts[0] != "testing"}
    for name in module_names:
        source = getattr(sys.modules.get(name), "__file__", None)
        if source is not None and source.endswith(".py"):
            files.add(Path(source).resolve())
    digest = hashlib.sha256()
    for path in sorted(files):
        name = path.relative_to(PACKAGE_DIR).as_posix() if path.is_relative_to(PACKAGE_DIR) else path.name
        digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
