"""SGLang's and vLLM's service endpoints beside generation: model and server info, prefix-cache flush, a deep
health check that generates a token, tokenize / detokenize, and the version."""

from __future__ import annotations

import asyncio
import importlib.metadata
import uuid
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from scheduler.http.calls import FrontendState
from scheduler.http.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    ProtocolError,
    TokenizeRequest,
    parse_body,
)
from scheduler.http.request_conversion import chat_template_input
from scheduler.http.routing import frontend_of, json_response, read_body
from scheduler.http.tool_calls import tool_plan
from scheduler.io_struct import Pong, SamplingParams
from scheduler.server_args import ModelArgs, ServerArgs
from sglang_constrained.tokenizer.loading import embedded_model_path

HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0
"""How long ``/health_generate`` waits for its one-token generation before answering 503."""

router = APIRouter()


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    """SGLang's model description: where the weights and tokenizer come from; a generative model."""
    model: ModelArgs = request.app.state.server_args.model
    path = model.model_path or str(embedded_model_path())
    return json_response(
        {
            "model_path": path,
            "tokenizer_path": path,
            "served_model_name": model.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "max_context_length": model.max_seq_len,
        }
    )


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """SGLang's server description: every server argument, the version, and the scheduler's counters."""
    server_args: ServerArgs = request.app.state.server_args
    frontend = frontend_of(request)
    try:
        pong: Pong | None = await frontend.client.wait_until_ready(timeout_s=HEALTH_TIMEOUT_S)
    except TimeoutError:
        pong = None
    arguments = server_args.settings()
    states = [{k: v for k, v in msgspec.structs.asdict(pong).items() if k != "metrics_text"}] if pong else []
    return json_response(
        msgspec.to_builtins(arguments, enc_hook=str) | {"version": _version(), "internal_states": states}
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    """SGLang's: drop the prefix cache (200), refused (400) while requests run or wait."""
    try:
        done = await frontend_of(request).client.flush_cache(timeout_s=HEALTH_TIMEOUT_S)
    except TimeoutError as e:
        raise ProtocolError("the scheduler did not answer", status_code=503) from e
    status = 200 if done.success else 400
    return PlainTextResponse(("Cache flushed: " if done.success else "Cache not flushed: ") + done.message, status)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """SGLang's deep health check: 200 once the scheduler generates one token, 503 if it cannot in time."""
    frontend = frontend_of(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    try:
        await asyncio.wait_for(
            frontend.client.generate(input_ids=[0], sampling_params=params, rid=f"health-{uuid.uuid4().hex}"),
            timeout=HEALTH_GENERATE_TIMEOUT_S,
        )
    except TimeoutError:
        return json_response({"status": "unavailable"}, status_code=503)
    return json_response({"status": "ok"})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    """vLLM's: a prompt's (or chat's, templated) token ids, as the server would see them."""
    body = parse_body(TokenizeRequest, await read_body(request))
    frontend = frontend_of(request)
    frontend.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise ProtocolError("give exactly one of prompt or messages")
    tokenizer = frontend.prompt_encoder.tokenizer
    if body.prompt is not None:
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        ids = await asyncio.to_thread(_chat_ids, frontend, body)
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": frontend.limits.max_seq_len, "tokens": list(ids)}
    if body.return_token_strs:
        answer["token_strs"] = tokenizer.convert_ids_to_tokens(list(ids))
    return json_response(answer)


def _chat_ids(frontend: FrontendState, body: TokenizeRequest) -> list[int]:
    """The token ids of ``body``'s messages as a chat completion with its tools (``tool_choice`` auto), documents and
    template kwargs has them, but for the generation prompt, which ``add_generation_prompt`` chooses."""
    chat = ChatCompletionRequest.model_construct(messages=body.messages or [], tools=body.tools)
    plan = tool_plan(chat, frontend.tool_format.syntax)
    messages, tools = chat_template_input(chat, plan, frontend.tool_format)
    try:
        return frontend.prompt_encoder.chat_ids(
            messages, body.chat_template_kwargs or {}, tools, body.documents, body.add_generation_prompt
        )
    except ValueError as e:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(e) else "messages"
        raise ProtocolError(str(e), param=param) from e


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    """vLLM's: the text of token ids."""
    body = parse_body(DetokenizeRequest, await read_body(request))
    frontend = frontend_of(request)
    frontend.check_model(body.model)
    vocab_size = frontend.prompt_encoder.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ProtocolError(f"tokens must be token ids in [0, {vocab_size}); got {bad[:5]}", param="tokens")
    text = await asyncio.to_thread(frontend.prompt_encoder.tokenizer.decode, body.tokens)
    return json_response({"prompt": text})


@router.get("/version")
async def version() -> Response:
    return json_response({"version": _version()})


def _version() -> str:
    return importlib.metadata.version("sglang-constrained")
