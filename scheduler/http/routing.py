"""What every route handler shares: reading a bounded body, the frontend's state, and JSON answers."""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.responses import Response
from starlette.requests import Request

from scheduler.http.calls import FrontendState
from scheduler.http.protocol import ProtocolError

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Larger request bodies are refused (413) as they arrive, before they are parsed."""


async def read_body(request: Request) -> bytes:
    """The body, read up to ``MAX_BODY_BYTES``; raises ``ProtocolError`` (413) past that."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ProtocolError(
                f"the request body is over {MAX_BODY_BYTES:,} bytes", status_code=413, code="request_too_large"
            )
        chunks.append(chunk)
    return b"".join(chunks)


def frontend_of(request: Request) -> FrontendState:
    state: FrontendState = request.app.state.frontend
    return state


def json_response(body: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status_code, media_type="application/json")
