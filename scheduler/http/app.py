"""The HTTP frontend's app: OpenAI's API (and SGLang's ``/generate``), answered by the scheduler over zmq.

FastAPI, as in SGLang and vLLM: request bodies are pydantic models, so a malformed body is refused with the field
named, and an OpenAI client meets the same server behaviour it knows from those projects. The process that
serves it is ``scheduler.http.server``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler.client import AsyncSchedulerClient
from scheduler.http.calls import FrontendState, collect_outputs
from scheduler.http.generate_conversion import generate_calls
from scheduler.http.logprobs import sglang_logprobs
from scheduler.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ProtocolError,
    parse_body,
)
from scheduler.http.request_conversion import RequestLimits, chat_calls, completion_calls
from scheduler.http.responses import (
    chat_completion_body,
    error_body,
    generate_result,
    text_completion_body,
)
from scheduler.http.routing import frontend_of, json_response, read_body
from scheduler.http.service_routes import HEALTH_TIMEOUT_S
from scheduler.http.service_routes import router as service_router
from scheduler.http.streaming import (
    ChatStreamChunks,
    CompletionStreamChunks,
    GenerateStreamChunks,
    stream_response,
)
from scheduler.http.tool_calls import server_tool_format, tool_plan
from scheduler.io_struct import Pong
from scheduler.prompt_encoder import PromptEncoder
from scheduler.server_args import ServerArgs
from scheduler.startup_heap import freeze_startup_heap, return_freed_memory
from sglang_constrained.tokenizer.loading import embedded_model_path, load_tokenizer

logger = logging.getLogger("scheduler.http")

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once the scheduler answers a ping, else 503.

    ``running_requests``: scheduler requests this frontend has in flight; ``scheduler``: the scheduler's own
    counters from its answer (``num_*`` fields of ``Pong``, and the prefix cache's ``cache_hit_rate``).
    """
    frontend = frontend_of(request)
    try:
        pong = await frontend.client.wait_until_ready(timeout_s=HEALTH_TIMEOUT_S)
    except TimeoutError:
        body = {"status": "unavailable", "running_requests": frontend.num_running_requests}
        return json_response(body, status_code=503)
    counters = {
        name: value
        for name, value in msgspec.structs.asdict(pong).items()
        if name.startswith("num_") or name == "cache_hit_rate"
    }
    return json_response(
        {
            "status": "ok",
            "model": pong.model,
            "grammar_backend": pong.grammar_backend,
            "running_requests": frontend.num_running_requests,
            "scheduler": counters,
        }
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus metrics: the frontend's, and the scheduler's when it answers within ``HEALTH_TIMEOUT_S``."""
    frontend = frontend_of(request)
    try:
        pong: Pong | None = await frontend.client.wait_until_ready(timeout_s=HEALTH_TIMEOUT_S)
    except TimeoutError:
        pong = None
    return Response(frontend.metrics.render(pong), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    frontend = frontend_of(request)
    model = {
        "id": frontend.model_name,
        "object": "model",
        "created": frontend.started,
        "owned_by": "sglang-constrained",
        "max_model_len": frontend.limits.max_seq_len,
    }
    return json_response({"object": "list", "data": [model]})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = parse_body(ChatCompletionRequest, await read_body(request))
    frontend = frontend_of(request)
    frontend.check_model(body.model)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    plan = tool_plan(body, frontend.tool_format.syntax)
    calls = await frontend.tokenized(chat_calls(body, completion_id, frontend.limits, plan, frontend.tool_format))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = ChatStreamChunks(
            completion_id, frontend.model_name, body.n, include_usage, frontend.token_text, plan, body.stream_reasoning
        )
        return await stream_response(request, frontend, calls, chunks)
    outputs = await collect_outputs(request, frontend, calls)
    body_out = chat_completion_body(completion_id, frontend.model_name, outputs, frontend.token_text, plan)
    return json_response(body_out)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = parse_body(CompletionRequest, await read_body(request))
    frontend = frontend_of(request)
    frontend.check_model(body.model)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    calls = await frontend.tokenized(completion_calls(body, completion_id, frontend.limits))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = CompletionStreamChunks(completion_id, frontend.model_name, body.n, include_usage, frontend.token_text)
        return await stream_response(request, frontend, calls, chunks)
    outputs = await collect_outputs(request, frontend, calls)
    return json_response(text_completion_body(completion_id, frontend.model_name, outputs, body.n, frontend.token_text))


@router.post("/generate")
async def generate(request: Request) -> Response:
    """SGLang's native endpoint: one result for one prompt of ``n`` 1, else a list (prompt-major: each prompt's ``n``
    choices in turn) for a batch (``text`` or ``input_ids`` lists) or ``n`` > 1."""
    body = parse_body(GenerateRequest, await read_body(request))
    frontend = frontend_of(request)
    frontend.check_model(body.model)
    calls = await frontend.tokenized(generate_calls(body, frontend.limits))
    num_top = body.top_logprobs_num if body.return_logprob else None
    logprob_text = frontend.token_text if body.return_text_in_logprobs else None
    if body.stream:
        return await stream_response(request, frontend, calls, GenerateStreamChunks(num_top, logprob_text))
    results = [
        generate_result(
            o,
            o.token_ids,
            o.text,
            sglang_logprobs(o.logprobs or [], num_top, logprob_text) if num_top is not None else None,
            o.reasoning_text,
        )
        for o in await collect_outputs(request, frontend, calls)
    ]
    return json_response(results if body.is_batch or len(results) > 1 else results[0])


def create_app(server_args: ServerArgs) -> FastAPI:
    """The ASGI app; its scheduler client connects to ``server_args.serving.zmq_endpoint`` at start-up. The whole
    ``server_args``: the model part gives the tokenizer and limits, the grammar part the spec-size limit, and
    ``/get_server_info`` reports every setting."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        model = server_args.model
        source = Path(model.model_path) if model.model_path else embedded_model_path()
        tokenizer = await asyncio.to_thread(load_tokenizer, source, model.cache_path, model.chat_template)
        # Token ids are checked by the scheduler, which knows the model's vocabulary; the frontend sends only its own.
        prompt_encoder = PromptEncoder(tokenizer, len(tokenizer), model.max_seq_len)
        limits = RequestLimits(model.max_seq_len, server_args.grammar.grammar_max_spec_bytes)
        client = AsyncSchedulerClient(server_args.serving.zmq_endpoint)
        tool_format = server_tool_format(model.tool_call_parser, tokenizer)
        app.state.frontend = FrontendState(client, model.model_name, limits, prompt_encoder, tool_format)
        app.state.server_args = server_args
        logger.info(
            "frontend: %d objects of the start left out of garbage collections, %.0f MiB it freed given back",
            freeze_startup_heap(),
            return_freed_memory() / 2**20,
        )
        try:
            yield
        finally:
            await client.close()

    # Bodies are parsed by hand (any content type), so FastAPI's generated docs would be empty: none are served.
    app = FastAPI(title="sglang-constrained", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(ArrivalTime)
    app.add_exception_handler(ProtocolError, _protocol_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    app.include_router(service_router)
    return app


class ArrivalTime:
    """ASGI middleware: ``request.state.arrived``, the ``time.monotonic()`` of the request's arrival (latencies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope.setdefault("state", {})["arrived"] = time.monotonic()
        await self.app(scope, receive, send)


async def _protocol_error(request: Request, error: ProtocolError) -> Response:
    if error.status_code >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, error.message)
    return _refusal(request, error)


async def _http_error(request: Request, error: StarletteHTTPException) -> Response:
    return _refusal(request, ProtocolError(str(error.detail), status_code=error.status_code))


async def _internal_error(request: Request, error: Exception) -> Response:
    """A bug in the frontend: still an answer in OpenAI's shape (Starlette logs the traceback)."""
    return _refusal(request, ProtocolError(f"internal error: {type(error).__name__}: {error}", status_code=500))


def _refusal(request: Request, error: ProtocolError) -> Response:
    """The error answer, counted by reason (its code, else its status) in ``sglang:num_refused_requests``."""
    reason = error.code or f"http_{error.status_code}"
    frontend: FrontendState | None = getattr(request.app.state, "frontend", None)
    if frontend is not None:
        frontend.metrics.refused(reason)
    path, status = request.url.path, error.status_code
    logger.info("path=%s status=%d reason=%s message=%.200s", path, status, reason, error.message)
    return json_response(error_body(error), status_code=error.status_code)
