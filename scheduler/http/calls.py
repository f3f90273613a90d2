"""The scheduler requests behind one HTTP request (one per choice and prompt): run concurrently, collected into one
answer (or streamed, by ``scheduler.http.streaming``), aborted when the client leaves; and the frontend's state."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.requests import Request

from scheduler.client import AsyncSchedulerClient, SchedulerGoneError
from scheduler.http.metrics import FrontendMetrics, GenerationTimer
from scheduler.http.protocol import ProtocolError
from scheduler.http.request_conversion import RequestLimits, SchedulerCall
from scheduler.http.responses import CLIENT_CLOSED_REQUEST, check_finished
from scheduler.http.tool_calls import DEFAULT_TOOL_FORMAT, ToolFormat
from scheduler.io_struct import GenerateOutput
from scheduler.prompt_encoder import PromptEncoder

logger = logging.getLogger("scheduler.http")

ROUTER_UNNAMED_MODEL = "unknown"
"""The model SGLang's router (0.3) writes into a chat request that names none: its id for workers registered without
a model name."""


@dataclass
class FrontendState:
    """What every handler shares. ``running_rids``: scheduler requests sent and not yet finished or aborted
    (an aborted one stays until its abort has been sent to the scheduler). ``prompt_encoder`` holds the model's
    tokenizer: prompts are tokenised here, never on the scheduler loop's thread. ``tool_format``: how tools are
    offered and calls written (``--tool-call-parser``, or what the chat template says)."""

    client: AsyncSchedulerClient
    model_name: str
    limits: RequestLimits
    prompt_encoder: PromptEncoder
    tool_format: ToolFormat = DEFAULT_TOOL_FORMAT
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)
    running_rids: set[str] = field(default_factory=set)
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def num_running_requests(self) -> int:
        return len(self.running_rids)

    async def tokenized(self, calls: list[SchedulerCall]) -> list[SchedulerCall]:
        """``calls`` with their prompts and predictions as token ids, each distinct prompt and prediction tokenised
        once on a worker thread (the choices of one prompt share it); raises ``ProtocolError`` for a prompt that
        cannot fit the context, or a prediction no output could repeat."""
        prompt_ids: dict[tuple[int, int], list[int]] = {}
        prediction_ids: dict[int, list[int]] = {}
        tokenized = []
        for call in calls:
            ids = call.input_ids
            if ids is None:
                prompt = (id(call.text), id(call.messages))
                if prompt not in prompt_ids:
                    prompt_ids[prompt] = await asyncio.to_thread(self._encode, call)
                ids = prompt_ids[prompt]
            predicted = None
            if call.prediction is not None:
                if id(call.prediction) not in prediction_ids:
                    encoded = await asyncio.to_thread(self._encode_prediction, call.prediction)
                    prediction_ids[id(call.prediction)] = encoded
                predicted = prediction_ids[id(call.prediction)]
            tokenized.append(call.with_prompt_ids(ids, self.limits.max_seq_len, predicted))
        return tokenized

    def _encode_prediction(self, prediction: str | list[int]) -> list[int]:
        try:
            return self.prompt_encoder.encode_prediction(prediction)
        except ValueError as e:
            raise ProtocolError(str(e), param="prediction") from e

    def token_text(self, token_id: int) -> str:
        """A token's text, decoded alone (logprobs show tokens this way)."""
        return str(self.prompt_encoder.tokenizer.decode([token_id]))

    def _encode(self, call: SchedulerCall) -> list[int]:
        try:
            return self.prompt_encoder.encode(
                text=call.text,
                messages=call.messages,
                chat_template_kwargs=call.chat_template_kwargs,
                tools=call.tools,
                documents=call.documents,
                continue_final_message=call.continue_final_message,
            )
        except ValueError as e:
            param = "prompt" if call.text is not None else "messages"
            if "chat_template_kwargs" in str(e):
                param = "chat_template_kwargs"
            raise ProtocolError(str(e), param=param) from e

    def check_model(self, model: str | None) -> None:
        """Accept the served model's name, or no name; anything else is OpenAI's 404 ``model_not_found``. SGLang's
        router names no model ``"unknown"`` (``ROUTER_UNNAMED_MODEL``) when its workers do not tell it theirs."""
        if model is not None and model not in (self.model_name, ROUTER_UNNAMED_MODEL):
            raise ProtocolError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                status_code=404,
                param="model",
                code="model_not_found",
            )


class ChoiceRun:
    """Runs an HTTP request's scheduler requests concurrently; iterate for ``(index, output)`` as they arrive.

    Iteration raises the ``ProtocolError`` of a request the scheduler aborted, or one with status
    ``DISCONNECTED`` once ``cancel`` has aborted the unfinished requests. ``cancel`` needs no await: each
    request's task sends its own abort, so clean-up never depends on who is cancelled when.
    """

    DISCONNECTED = CLIENT_CLOSED_REQUEST

    def __init__(self, frontend: FrontendState, calls: list[SchedulerCall], stream: bool, arrived: float) -> None:
        """``arrived``: when the HTTP request arrived (``time.monotonic()``), where its latencies start."""
        self.frontend = frontend
        self.rids = [call.rid for call in calls]
        # The client routes outputs by rid: a second request with a running rid would steal the first one's.
        clashes = sorted(frontend.running_rids.intersection(self.rids)) or sorted(
            {rid for rid in self.rids if self.rids.count(rid) > 1}
        )
        if clashes:
            raise ProtocolError(f"a request with rid {clashes[0]!r} is running", param="rid")
        frontend.running_rids.update(self.rids)
        self.stream = stream
        self._timers = [GenerationTimer(frontend.metrics, call.rid, call.sampling_params, arrived) for call in calls]
        self.num_open = len(calls)
        self._queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException]] = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._run(i, call, stream)) for i, call in enumerate(calls)]

    def __aiter__(self) -> ChoiceRun:
        return self

    async def __anext__(self) -> tuple[int, GenerateOutput]:
        if self.num_open == 0:
            raise StopAsyncIteration
        index, item = await self._queue.get()
        if isinstance(item, asyncio.CancelledError):
            raise ProtocolError("the client disconnected", status_code=self.DISCONNECTED)
        if isinstance(item, SchedulerGoneError):
            raise ProtocolError(str(item), status_code=HTTPStatus.SERVICE_UNAVAILABLE, code="scheduler_gone") from item
        if isinstance(item, BaseException):
            raise ProtocolError(f"internal error: {type(item).__name__}: {item}", status_code=500) from item
        self._timers[index].observe(item, self.stream)
        check_finished(item)
        if item.finished:
            self.num_open -= 1
        return index, item

    async def first_outputs(self) -> list[tuple[int, GenerateOutput]]:
        """Outputs until every choice has sent one (so that a failure before any token can still be an HTTP error)."""
        received: list[tuple[int, GenerateOutput]] = []
        seen: set[int] = set()
        while len(seen) < len(self.rids):
            index, output = await self.__anext__()
            received.append((index, output))
            seen.add(index)
        return received

    def cancel(self) -> None:
        """Abort every unfinished request in the scheduler (each task sends its abort as it unwinds)."""
        for task in self._tasks:
            task.cancel()

    async def cancel_on_disconnect(self, request: Request) -> None:
        """Wait for the client to go away (or the response to complete), then cancel what still runs."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        running = [rid for rid, task in zip(self.rids, self._tasks, strict=True) if not task.done()]
        if running:
            logger.info("client disconnected: aborting %d scheduler request(s) %s", len(running), running)
        self.cancel()

    async def _run(self, index: int, call: SchedulerCall, stream: bool) -> None:
        try:
            if stream:
                async for output in self.frontend.client.stream(**call.as_kwargs()):
                    self._queue.put_nowait((index, output))
            else:
                self._queue.put_nowait((index, await self.frontend.client.generate(**call.as_kwargs())))
        except asyncio.CancelledError as e:
            self._queue.put_nowait((index, e))
            raise
        except SchedulerGoneError as e:
            self._queue.put_nowait((index, e))
        except Exception as e:
            logger.exception("scheduler request %s failed in the frontend", call.rid)
            self._queue.put_nowait((index, e))
        finally:
            self.frontend.running_rids.discard(call.rid)


async def collect_outputs(
    request: Request, frontend: FrontendState, calls: list[SchedulerCall]
) -> list[GenerateOutput]:
    """Every call's final output, in order; a client disconnect aborts them all in the scheduler."""
    run = ChoiceRun(frontend, calls, stream=False, arrived=request.state.arrived)
    watcher = asyncio.create_task(run.cancel_on_disconnect(request))
    try:
        finals: dict[int, GenerateOutput] = {}
        async for index, output in run:
            finals[index] = output
        return [finals[i] for i in range(len(calls))]
    finally:
        watcher.cancel()
        run.cancel()
