"""Read JSONSchemaBench / MaskBench cases: a schema and its valid and invalid JSON instances."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MaskBenchCase:
    """One schema file; instances are serialised as MaskBench does (``json.dumps``, ``ensure_ascii=False``)."""

    name: str
    folder: str
    schema: Any
    valid_instances: tuple[str, ...]
    invalid_instances: tuple[str, ...]


def load_case(path: Path) -> MaskBenchCase:
    data = json.loads(path.read_text(encoding="utf-8"))
    tests = data.get("tests", [])
    return MaskBenchCase(
        name=path.stem,
        folder=path.parent.name,
        schema=data["schema"],
        valid_instances=tuple(_serialise(t["data"]) for t in tests if t["valid"]),
        invalid_instances=tuple(_serialise(t["data"]) for t in tests if not t["valid"]),
    )


def iter_case_paths(root: Path, folder: str, limit: int | None = None, stride: int = 1) -> Iterator[Path]:
    """Case files of ``folder`` in name order; ``stride`` and ``limit`` take a fixed, spread-out sample."""
    paths = sorted((root / folder).glob("*.json"))[::stride]
    yield from paths if limit is None else paths[:limit]


def _serialise(instance: Any) -> str:
    return json.dumps(instance, indent=None, ensure_ascii=False)
