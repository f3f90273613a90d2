"""Every way an OpenAI-style request can ask for a constraint (OpenAI's ``response_format``, SGLang's top-level
fields, vLLM's ``structured_outputs`` and legacy ``guided_*``), gathered into one ``SamplingParams`` constraint."""

from __future__ import annotations

import json
from typing import Any

from scheduler.http.protocol import (
    CommonRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    ProtocolError,
    StructuralTagFormat,
)

WHITESPACE_PATTERN_REFUSAL = (
    "the server's --constrained-json-whitespace-pattern applies to every JSON constraint, there is no per-request one"
)


def requested_constraint(request: CommonRequest) -> dict[str, Any]:
    """The request's constraint as ``{SamplingParams field: value}`` (empty for none); refuses more than one."""
    found: list[tuple[str, str, Any]] = []
    fmt = request.response_format
    if isinstance(fmt, JsonSchemaFormat):
        found.append(("response_format (json_schema)", "json_schema", fmt.json_schema.schema_))
    elif isinstance(fmt, JsonObjectFormat):
        found.append(("response_format (json_object)", "json_object", True))
    elif isinstance(fmt, StructuralTagFormat):
        found.append(("response_format (structural_tag)", "structural_tag", fmt.model_dump()))
    for source, field in _TOP_LEVEL_CONSTRAINTS:
        value = getattr(request, source)
        if value is not None:
            found.append((source, field, value))
    if request.structured_outputs is not None:
        if request.structured_outputs.whitespace_pattern is not None:
            raise ProtocolError(
                f"structured_outputs.whitespace_pattern is not supported by this server: {WHITESPACE_PATTERN_REFUSAL}",
                param="structured_outputs.whitespace_pattern",
                code="unsupported_parameter",
            )
        for source, field in _STRUCTURED_OUTPUTS_FIELDS:
            value = getattr(request.structured_outputs, source)
            if value is not None and not (value is False and source == "json_object"):  # json: false is a schema
                found.append((f"structured_outputs.{source.rstrip('_')}", field, value))
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


_TOP_LEVEL_CONSTRAINTS = (
    ("regex", "regex"),
    ("ebnf", "ebnf"),
    ("json_schema", "json_schema"),
    ("guided_json", "json_schema"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "ebnf"),
)
_STRUCTURED_OUTPUTS_FIELDS = (
    ("json_", "json_schema"),
    ("regex", "regex"),
    ("choice", "choice"),
    ("grammar", "ebnf"),
    ("json_object", "json_object"),
    ("structural_tag", "structural_tag"),
)
