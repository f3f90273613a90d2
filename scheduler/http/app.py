"""The HTTP frontend's app: OpenAI's API (and SGLang's ``/generate``), answered by the scheduler over zmq.

FastAPI, as in SGLang and vLLM: request bodies are pydantic models, so a malformed body is refused with the field
named, and an OpenAI client meets the same server behaviour it knows from those projects. The process that
serves it is ``scheduler.http.server``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler.client import AsyncSchedulerClient
from scheduler.http.calls import FrontendState, collect_outputs
from scheduler.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ProtocolError,
    parse_body,
)
from scheduler.http.request_conversion import chat_calls, completion_calls, generate_calls
from scheduler.http.responses import (
    chat_completion_body,
    error_body,
    generate_result,
    text_completion_body,
)
from scheduler.http.streaming import (
    ChatStreamChunks,
    CompletionStreamChunks,
    GenerateStreamChunks,
    stream_response,
)
from scheduler.server_args import ServerArgs

logger = logging.getLogger("scheduler.http")

HEALTH_TIMEOUT_S = 5.0

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the scheduler answers a ping, else 503.

    ``running_requests``: scheduler requests this frontend has in flight; ``scheduler``: the scheduler's own
    counters from its answer (``num_*`` fields of ``Pong``, and the prefix cache's ``cache_hit_rate``).
    """
    frontend = _frontend(request)
    try:
        pong = await frontend.client.wait_until_ready(timeout_s=HEALTH_TIMEOUT_S)
    except TimeoutError:
        body = {"status": "unavailable", "running_requests": frontend.num_running_requests}
        return _json(body, status_code=503)
    counters = {
        name: value
        for name, value in msgspec.structs.asdict(pong).items()
        if name.startswith("num_") or name == "cache_hit_rate"
    }
    return _json(
        {
            "status": "ok",
            "model": pong.model,
            "grammar_backend": pong.grammar_backend,
            "running_requests": frontend.num_running_requests,
            "scheduler": counters,
        }
    )


@router.get("/v1/models")
async def models(request: Request) -> Response:
    frontend = _frontend(request)
    model = {
        "id": frontend.model_name,
        "object": "model",
        "created": frontend.started,
        "owned_by": "sglang-constrained",
        "max_model_len": frontend.max_seq_len,
    }
    return _json({"object": "list", "data": [model]})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = parse_body(ChatCompletionRequest, await request.body())
    frontend = _frontend(request)
    frontend.check_model(body.model)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    calls = chat_calls(body, completion_id, frontend.max_seq_len)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = ChatStreamChunks(completion_id, frontend.model_name, body.n, include_usage)
        return await stream_response(request, frontend, calls, chunks)
    outputs = await collect_outputs(request, frontend, calls)
    return _json(chat_completion_body(completion_id, frontend.model_name, outputs))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = parse_body(CompletionRequest, await request.body())
    frontend = _frontend(request)
    frontend.check_model(body.model)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    calls = completion_calls(body, completion_id)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = CompletionStreamChunks(completion_id, frontend.model_name, body.n, include_usage)
        return await stream_response(request, frontend, calls, chunks)
    outputs = await collect_outputs(request, frontend, calls)
    return _json(text_completion_body(completion_id, frontend.model_name, outputs, body.n))


@router.post("/generate")
async def generate(request: Request) -> Response:
    """SGLang's native endpoint: one result for one prompt, a list for a batch (``text`` or ``input_ids`` lists)."""
    body = parse_body(GenerateRequest, await request.body())
    frontend = _frontend(request)
    calls = generate_calls(body)
    if body.stream:
        return await stream_response(request, frontend, calls, GenerateStreamChunks())
    results = [generate_result(o, o.token_ids, o.text) for o in await collect_outputs(request, frontend, calls)]
    return _json(results if body.is_batch else results[0])


def create_app(server_args: ServerArgs) -> FastAPI:
    """The ASGI app; its scheduler client connects to ``server_args.zmq_endpoint`` at start-up."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncSchedulerClient(server_args.zmq_endpoint)
        app.state.frontend = FrontendState(client, server_args.model_name, server_args.max_seq_len)
        try:
            yield
        finally:
            await client.close()

    # Bodies are parsed by hand (any content type), so FastAPI's generated docs would be empty: none are served.
    app = FastAPI(title="sglang-constrained", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ProtocolError, _protocol_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app


async def _protocol_error(request: Request, error: ProtocolError) -> Response:
    if error.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, error.message)
    return _json(error_body(error), status_code=error.status_code)


async def _http_error(_: Request, error: StarletteHTTPException) -> Response:
    return _json(error_body(ProtocolError(str(error.detail), status_code=error.status_code)), error.status_code)


async def _internal_error(_: Request, error: Exception) -> Response:
    """A bug in the frontend: still an answer in OpenAI's shape (Starlette logs the traceback)."""
    body = error_body(ProtocolError(f"internal error: {type(error).__name__}: {error}", status_code=500))
    return _json(body, status_code=500)


def _frontend(request: Request) -> FrontendState:
    state: FrontendState = request.app.state.frontend
    return state


def _json(body: Any, status_code: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status_code, media_type="application/json")
