"""Every way an OpenAI-style request can ask for a constraint (OpenAI's ``response_format``, SGLang's top-level
fields, vLLM's ``structured_outputs`` and legacy ``guided_*``: the names of each kind's entry in
``CONSTRAINT_KIND_TABLE``), gathered into one ``SamplingParams`` constraint."""

from __future__ import annotations

import json
from typing import Any

from scheduler.http.protocol import (
    CommonRequest,
    JsonSchemaFormat,
    ProtocolError,
    ResponseFormat,
    StructuralTagFormat,
    StructuredOutputs,
)
from sglang_constrained.constraint_spec import CONSTRAINT_KIND_TABLE

WHITESPACE_PATTERN_REFUSAL = (
    "the server's --constrained-json-whitespace-pattern applies to every JSON constraint, there is no per-request one"
)


def requested_constraint(request: CommonRequest) -> dict[str, Any]:
    """The request's constraint as ``{SamplingParams field: value}`` (empty for none); refuses more than one. Each
    kind's names are its entry's in ``CONSTRAINT_KIND_TABLE``."""
    found: list[tuple[str, str, Any]] = []
    fmt = request.response_format
    kind = _BY_RESPONSE_FORMAT.get(fmt.type) if fmt is not None else None
    if fmt is not None and kind is not None:
        found.append((f"response_format ({fmt.type})", kind.field, _response_format_value(fmt)))
    for kind in CONSTRAINT_KIND_TABLE:
        for source in kind.http_fields:
            value = getattr(request, source)
            if kind.is_requested(value):
                found.append((source, kind.field, value))
    if request.structured_outputs is not None:
        found.extend(_structured_outputs_constraints(request.structured_outputs))
    if len(found) > 1:
        names = [source for source, _, _ in found]
        raise ProtocolError(
            f"at most one constraint per request; got {', '.join(names[:-1])} and {names[-1]}",
            param=found[1][0].split(" ")[0],
            code="multiple_constraints",
        )
    # A boolean schema travels as its JSON text: as a value, false would read as "no constraint".
    return {
        field: json.dumps(value) if field == "json_schema" and isinstance(value, bool) else value
        for _, field, value in found
    }


def _structured_outputs_constraints(structured_outputs: StructuredOutputs) -> list[tuple[str, str, Any]]:
    """``(source, SamplingParams field, value)`` for each constraint vLLM's ``structured_outputs`` asks for."""
    if structured_outputs.whitespace_pattern is not None:
        raise ProtocolError(
            f"structured_outputs.whitespace_pattern is not supported by this server: {WHITESPACE_PATTERN_REFUSAL}",
            param="structured_outputs.whitespace_pattern",
            code="unsupported_parameter",
        )
    found = []
    for kind in CONSTRAINT_KIND_TABLE:
        name = kind.structured_outputs_field
        value = getattr(structured_outputs, _STRUCTURED_OUTPUTS_ATTRIBUTES[name]) if name is not None else None
        if name is not None and kind.is_requested(value):
            found.append((f"structured_outputs.{name}", kind.field, value))
    return found


def _response_format_value(fmt: ResponseFormat) -> Any:
    """What an OpenAI ``response_format`` of a constraint kind asks for: a schema, a structural tag, or true (a
    flag)."""
    if isinstance(fmt, JsonSchemaFormat):
        return fmt.json_schema.schema_
    if isinstance(fmt, StructuralTagFormat):
        return fmt.model_dump()
    return True


_BY_RESPONSE_FORMAT = {kind.response_format: kind for kind in CONSTRAINT_KIND_TABLE if kind.response_format}
_STRUCTURED_OUTPUTS_ATTRIBUTES = {info.alias or name: name for name, info in StructuredOutputs.model_fields.items()}
"""``structured_outputs``' wire names (``json``) to its attributes (``json_``)."""
