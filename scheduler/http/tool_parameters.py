"""Tool-call arguments written one parameter at a time (Qwen3-Coder's ``<parameter=KEY>`` blocks, pythonic
``KEY=VALUE``), as data: ``Parameters``, from which both the constraint of a function's parameters (a structural tag
``format`` node) and the way earlier calls are written follow; ``scheduler.http.tool_call_reader`` reads them back."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARAMETER_NAME = re.compile(r"[A-Za-z0-9_-]+")
"""The parameter names a syntax of parameters writes (and its reader reads)."""
RAW_STRING_KEYWORDS = frozenset(
    {"type", "title", "description", "enum", "const", "default", "examples", "minLength", "maxLength"}
)
"""What a raw-text string parameter's schema may say: its text is free up to ``value_end``, one of its values, or of
bounded length (then without ``<``, so that it cannot hold ``value_end``)."""


@dataclass(frozen=True)
class Parameters:
    """Arguments written one parameter at a time, ``begin KEY key_end VALUE value_end``, joined by ``separator``:
    required properties first (in the schema's order), then the optional ones that are given. A value is JSON valid
    for the property's schema; with ``raw_strings``, a string property's value is its text as it is (ending at the
    first ``value_end``), one of its ``enum`` values if it has them; other string keywords (``pattern``, ``format``)
    are refused by name, since raw text cannot be held to them."""

    begin: str
    key_end: str
    value_end: str
    separator: str
    raw_strings: bool = False

    def is_raw(self, schema: Any) -> bool:
        """Whether a property of ``schema`` is written as raw text."""
        return self.raw_strings and isinstance(schema, dict) and schema.get("type") == "string"

    def format(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The format node of an object's parameters (its ``properties``; nothing else is written)."""
        properties = schema.get("properties") or {}
        for key in properties:
            if not PARAMETER_NAME.fullmatch(key):
                raise ValueError(
                    f"the parameter {key!r} is not a name this syntax can write (letters, digits, _ and -)"
                )
        required = [key for key in properties if key in set(schema.get("required") or [])]
        optional_keys = [key for key in properties if key not in required]
        params = {key: self._parameter(key, properties[key]) for key in properties}
        if not params:
            return {"type": "const_string", "value": ""}
        if not self.separator:
            elements = [params[key] for key in required] + [optional(params[key]) for key in optional_keys]
            return sequence(elements)
        if required:
            first, *rest = required
            return sequence(
                [params[first]]
                + [self._after_separator(params[key]) for key in rest]
                + [optional(self._after_separator(params[key])) for key in optional_keys]
            )
        starts = [
            sequence([params[key]] + [optional(self._after_separator(params[k])) for k in optional_keys[i + 1 :]])
            for i, key in enumerate(optional_keys)
        ]
        return optional(starts[0] if len(starts) == 1 else {"type": "or", "elements": starts})

    def write(self, arguments: dict[str, Any], schema: dict[str, Any]) -> str:
        """``arguments`` as the model writes them."""
        properties = schema.get("properties") or {}
        written = []
        for key, value in arguments.items():
            raw = self.is_raw(properties.get(key)) and isinstance(value, str)
            text = value if raw else json.dumps(value, ensure_ascii=False)
            written.append(self.begin + key + self.key_end + text + self.value_end)
        return self.separator.join(written)

    def _parameter(self, key: str, schema: Any) -> dict[str, Any]:
        if not self.is_raw(schema):
            value = {"type": "json_schema", "json_schema": schema}
            return sequence([const(self.begin + key + self.key_end), value, const(self.value_end)])
        unsupported = sorted(set(schema) - RAW_STRING_KEYWORDS)
        if unsupported:
            raise ValueError(
                f"the parameter {key!r} is a string written as raw text in this tool syntax, which cannot hold it to "
                f"{', '.join(unsupported)}"
            )
        values = schema.get("enum", [schema["const"]] if "const" in schema else None)
        begin = const(self.begin + key + self.key_end)
        if values is not None:
            if not values or not all(isinstance(value, str) for value in values):
                raise ValueError(f"the parameter {key!r} is a string whose enum or const holds a value that is not one")
            return sequence([begin, {"type": "or", "elements": [const(v) for v in values]}, const(self.value_end)])
        if "minLength" in schema or "maxLength" in schema:
            bounds = f"{schema.get('minLength', 0)},{schema.get('maxLength', '')}"
            return sequence([begin, {"type": "regex", "pattern": f"[^<]{{{bounds}}}"}, const(self.value_end)])
        return {"type": "tag", "begin": begin["value"], "content": {"type": "any_text"}, "end": self.value_end}

    def _after_separator(self, parameter: dict[str, Any]) -> dict[str, Any]:
        return sequence([const(self.separator), parameter])


def const(value: str) -> dict[str, Any]:
    """A ``const_string`` format node."""
    return {"type": "const_string", "value": value}


def optional(content: dict[str, Any]) -> dict[str, Any]:
    """An ``optional`` format node."""
    return {"type": "optional", "content": content}


def sequence(elements: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``sequence`` format node of ``elements`` less empty strings (one element alone, an empty string for none)."""
    kept = [element for element in elements if element != const("")]
    if not kept:
        return const("")
    return kept[0] if len(kept) == 1 else {"type": "sequence", "elements": kept}
