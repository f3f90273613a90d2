"""The JSON schema every backend compiles: string formats and patterns in a form no engine can get wrong.

Applied after a backend's own refusals (which name the user's features), before its engine sees the schema:
formats of ``json_string_formats`` become patterns, and every pattern (``pattern``, and the keys of
``patternProperties``) is rewritten by ``json_string_patterns``. What the measured engine faults are, and why
this fixes them, is in those two modules.
"""

from __future__ import annotations

import copy
from typing import Any

from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.features import iter_subschemas
from sglang_constrained.schema.string_formats import format_pattern
from sglang_constrained.schema.string_patterns import json_safe_pattern


def sound_json_schema(schema: Any, originals: dict[str, str] | None = None) -> Any:
    """A copy of ``schema`` with its formats and patterns rewritten; raises ``GrammarSpecError`` for a pattern that
    cannot be, naming where it is. ``originals`` receives each rewritten pattern's own text, so that an engine's
    message about a pattern can quote the user's (``user_patterns_in``)."""
    originals = {} if originals is None else originals
    schema = copy.deepcopy(schema)
    for pointer, subschema in iter_subschemas(schema):
        where = pointer or "/"
        name = subschema.get("format")
        pattern = format_pattern(name) if isinstance(name, str) else None
        if pattern is not None:
            if "pattern" in subschema:
                raise GrammarSpecError(
                    f"'format': {name!r} together with 'pattern' (at {where}) is not supported: the format is "
                    "enforced as a pattern of its own; put both in one pattern"
                )
            del subschema["format"]
            subschema["pattern"] = pattern
        elif isinstance(subschema.get("pattern"), str):
            subschema["pattern"] = _rewritten(subschema["pattern"], f"the pattern at {where}", originals)
        pattern_properties = subschema.get("patternProperties")
        if isinstance(pattern_properties, dict):
            subschema["patternProperties"] = {
                _rewritten(key, f"the patternProperties key at {where}", originals): value
                for key, value in pattern_properties.items()
            }
    return schema


def user_patterns_in(message: str, originals: dict[str, str]) -> str:
    """``message`` with every rewritten pattern it quotes put back as the user wrote it."""
    for rewritten, original in sorted(originals.items(), key=lambda item: -len(item[0])):
        message = message.replace(rewritten, original)
    return message


def _rewritten(pattern: str, what: str, originals: dict[str, str]) -> str:
    try:
        rewritten = json_safe_pattern(pattern)
    except GrammarSpecError as e:
        raise GrammarSpecError(f"{what}: {e}") from e
    originals[rewritten] = pattern
    return rewritten
