"""Streamed HTTP answers: server-sent events in each endpoint's chunk format (OpenAI chat and text completions,
SGLang ``/generate``), built from the scheduler's streamed outputs as they arrive."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi.responses import StreamingResponse
from starlette.requests import Request

from scheduler.http.calls import ChoiceRun, FrontendState
from scheduler.http.logprobs import TokenText, chat_logprobs, completion_logprobs, sglang_logprobs
from scheduler.http.protocol import ProtocolError
from scheduler.http.request_conversion import SchedulerCall
from scheduler.http.responses import chat_finish_reason, error_body, generate_result, openai_finish_reason, usage_body
from scheduler.http.tool_call_parser import ToolCallStream
from scheduler.http.tool_calls import ToolPlan
from scheduler.io_struct import GenerateOutput, TokenLogprob


class StreamChunks:
    """Turns the outputs of a streamed request's choices into SSE events, one endpoint's format per subclass.

    ``events`` takes each choice's streamed increments in arrival order (``text`` and ``token_ids`` are new).
    """

    OBJECT = ""

    def __init__(self, completion_id: str, model: str, n: int, include_usage: bool) -> None:
        self.completion_id = completion_id
        self.model = model
        self.n = n
        self.include_usage = include_usage
        self.created = int(time.time())
        self.latest: dict[int, GenerateOutput] = {}

    def events(self, index: int, output: GenerateOutput) -> list[dict[str, Any]]:
        self.latest[index] = output
        return self.chunks(index, output)

    def chunks(self, index: int, output: GenerateOutput) -> list[dict[str, Any]]:
        raise NotImplementedError

    def closing_events(self) -> list[dict[str, Any]]:
        """OpenAI's usage chunk (``stream_options.include_usage``): no choices, the whole request's usage."""
        if not self.include_usage:
            return []
        return [self._chunk([]) | {"usage": usage_body(self.latest, self.n)}]

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.completion_id,
            "object": self.OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        return chunk | {"usage": None} if self.include_usage else chunk


class ChatStreamChunks(StreamChunks):
    """``chat.completion.chunk``: the role first, then content deltas, then an empty delta with the finish reason.
    A think block reported apart (``--reasoning-parser``) comes first, as ``reasoning_content`` deltas; without
    ``stream_reasoning`` (SGLang's field) it is held back and sent in one delta once it has closed (before the
    answer's first delta, or with the finish).

    With tools (``plan``) each call comes as OpenAI streams it (``tool_call_parser.ToolCallStream``): its ``index``,
    ``id``, ``type`` and ``name`` first, then its arguments in deltas as they are generated; the text outside calls
    comes as content deltas."""

    OBJECT = "chat.completion.chunk"

    def __init__(
        self,
        completion_id: str,
        model: str,
        n: int,
        include_usage: bool,
        token_text: TokenText,
        plan: ToolPlan | None = None,
        stream_reasoning: bool = True,
    ) -> None:
        super().__init__(completion_id, model, n, include_usage)
        self.token_text = token_text
        self.started: set[int] = set()
        self.plan = plan
        self.stream_reasoning = stream_reasoning
        self.held_reasoning: dict[int, str] = {}
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.num_calls: dict[int, int] = {}

    def chunks(self, index: int, output: GenerateOutput) -> list[dict[str, Any]]:
        """Logprobs ride with the first delta of their tokens (an empty delta if their text is held back)."""
        chunks = []
        if index not in self.started:
            self.started.add(index)
            # with tools the message may be calls only, whose content is null (as OpenAI streams it)
            role = {"role": "assistant", "content": "" if self.plan is None else None}
            chunks.append(self._choice(index, role, None))
        reasoning = output.reasoning_text
        if reasoning and not self.stream_reasoning:
            self.held_reasoning[index] = self.held_reasoning.get(index, "") + reasoning
            reasoning = None
        if index in self.held_reasoning and (output.text or output.finished):
            reasoning = self.held_reasoning.pop(index)
        if reasoning:
            chunks.append(self._choice(index, {"reasoning_content": reasoning}, None))
        logprobs = chat_logprobs(output.logprobs, self.token_text) if output.logprobs is not None else None
        if self.plan is not None:
            deltas = self._tool_deltas(index, output, self.plan)
        else:
            deltas = [{"content": output.text}] if output.text else []
        if logprobs is not None and not deltas:
            deltas = [{}]
        for position, delta in enumerate(deltas):
            chunks.append(self._choice(index, delta, None, logprobs if position == 0 else None))
        if output.finished:
            finish_reason = chat_finish_reason(output, self.plan, has_calls=self.num_calls.get(index, 0) > 0)
            chunks.append(self._choice(index, {}, finish_reason))
        return chunks

    def _tool_deltas(self, index: int, output: GenerateOutput, plan: ToolPlan) -> list[dict[str, Any]]:
        stream = self.tool_streams.setdefault(index, ToolCallStream(plan.read))
        deltas = stream.deltas(output.text, output.finished)
        self.num_calls[index] = self.num_calls.get(index, 0) + sum(
            1 for delta in deltas for call in delta.get("tool_calls", []) if "id" in call
        )
        return deltas

    def _choice(
        self, index: int, delta: dict[str, Any], finish_reason: str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}
        return self._chunk([choice])


class CompletionStreamChunks(StreamChunks):
    """``text_completion`` chunks: one per output with its new text, the last with the finish reason."""

    OBJECT = "text_completion"

    def __init__(self, completion_id: str, model: str, n: int, include_usage: bool, token_text: TokenText) -> None:
        super().__init__(completion_id, model, n, include_usage)
        self.token_text = token_text
        self.text_offsets: dict[int, int] = {}

    def chunks(self, index: int, output: GenerateOutput) -> list[dict[str, Any]]:
        logprobs = None
        if output.logprobs is not None:
            logprobs = completion_logprobs(output.logprobs, self.token_text, self.text_offsets.get(index, 0))
            self.text_offsets[index] = self.text_offsets.get(index, 0) + sum(map(len, logprobs["tokens"]))
        choice = {
            "index": index,
            "text": output.text,
            "finish_reason": openai_finish_reason(output),
            "logprobs": logprobs,
        }
        return [self._chunk([choice])]


class GenerateStreamChunks(StreamChunks):
    """SGLang's stream: every event holds the choice's text, output ids (and logprobs) so far, and its ``index``.

    ``num_top_logprobs``: None without ``return_logprob``; ``token_text`` None unless ``return_text_in_logprobs``.
    """

    def __init__(self, num_top_logprobs: int | None, token_text: TokenText | None) -> None:
        super().__init__("", "", n=1, include_usage=False)
        self.num_top_logprobs = num_top_logprobs
        self.token_text = token_text
        self.texts: dict[int, str] = {}
        self.reasoning_texts: dict[int, str] = {}
        self.output_ids: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}

    def chunks(self, index: int, output: GenerateOutput) -> list[dict[str, Any]]:
        self.texts[index] = self.texts.get(index, "") + output.text
        reasoning = None
        if output.reasoning_text is not None:
            reasoning = self.reasoning_texts[index] = self.reasoning_texts.get(index, "") + output.reasoning_text
        self.output_ids[index] = self.output_ids.get(index, []) + output.token_ids
        self.logprobs[index] = self.logprobs.get(index, []) + (output.logprobs or [])
        fields = None
        if self.num_top_logprobs is not None:
            fields = sglang_logprobs(self.logprobs[index], self.num_top_logprobs, self.token_text)
        result = generate_result(output, self.output_ids[index], self.texts[index], fields, reasoning)
        return [result | {"index": index}]


def sse_event(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``) and a blank line."""
    data = payload.encode() if isinstance(payload, str) else msgspec.json.encode(payload)
    return b"data: " + data + b"\n\n"


async def stream_response(
    request: Request, frontend: FrontendState, calls: list[SchedulerCall], chunks: StreamChunks
) -> StreamingResponse:
    """An SSE response; errors before every choice's first token (an invalid constraint) are HTTP errors."""
    run = ChoiceRun(frontend, calls, stream=True, arrived=request.state.arrived)
    watcher = asyncio.create_task(run.cancel_on_disconnect(request))
    try:
        received = await run.first_outputs()
    except BaseException:
        watcher.cancel()
        run.cancel()
        raise
    return StreamingResponse(_sse_events(run, received, chunks, watcher), media_type="text/event-stream")


async def _sse_events(
    run: ChoiceRun,
    received: list[tuple[int, GenerateOutput]],
    chunks: StreamChunks,
    watcher: asyncio.Task[None],
) -> AsyncIterator[bytes]:
    """The stream's events; an abort mid-stream becomes an error event (OpenAI's clients raise on it)."""
    try:
        for index, output in received:
            for event in chunks.events(index, output):
                yield sse_event(event)
        try:
            async for index, output in run:
                for event in chunks.events(index, output):
                    yield sse_event(event)
            for event in chunks.closing_events():
                yield sse_event(event)
        except ProtocolError as e:
            if e.status_code == ChoiceRun.DISCONNECTED:
                return
            run.cancel()
            yield sse_event(error_body(e))
        yield sse_event("[DONE]")
    finally:
        watcher.cancel()
        run.cancel()
