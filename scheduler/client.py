"""Python clients for the scheduler's zmq socket: blocking and asyncio."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from scheduler.io_struct import (
    AbortReq,
    ChatMessage,
    FlushCacheDone,
    FlushCacheReq,
    GenerateOutput,
    GenerateReq,
    PingReq,
    Pong,
    SamplingParams,
    decode_server_message,
    encode,
)


def make_request(
    text: str | None = None,
    messages: list[dict[str, str]] | None = None,
    input_ids: list[int] | None = None,
    sampling_params: SamplingParams | dict[str, Any] | None = None,
    stream: bool = False,
    rid: str | None = None,
    top_logprobs_num: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    separate_reasoning: bool = False,
    prediction: str | list[int] | None = None,
) -> GenerateReq:
    """A ``GenerateReq`` with a fresh rid unless one is given; ``sampling_params`` may be a plain dict.
    ``top_logprobs_num``: None for no logprobs, else how many alternatives per output token;
    ``chat_template_kwargs``, ``separate_reasoning`` and ``prediction`` (a predicted output): see ``GenerateReq``.

    A JSON schema or structural tag given as an object travels as its JSON text: msgpack cannot carry integers
    beyond 64 bits, which a schema may hold (the scheduler reads the text as it reads the object).
    """
    params = (
        sampling_params
        if isinstance(sampling_params, SamplingParams)
        else msgspec.convert(sampling_params or {}, SamplingParams)
    )
    as_text = {
        name: json.dumps(getattr(params, name))
        for name in ("json_schema", "structural_tag")
        if isinstance(getattr(params, name), dict)
    }
    if as_text:
        params = msgspec.structs.replace(params, **as_text)
    return GenerateReq(
        rid=rid or uuid.uuid4().hex,
        text=text,
        messages=[ChatMessage(**m) for m in messages] if messages is not None else None,
        input_ids=input_ids,
        sampling_params=params,
        stream=stream,
        top_logprobs_num=top_logprobs_num,
        chat_template_kwargs=chat_template_kwargs,
        separate_reasoning=separate_reasoning,
        prediction=prediction,
    )


class SchedulerClient:
    """A blocking client; ``generate_batch`` keeps many requests in flight at once."""

    def __init__(self, endpoint: str, timeout_s: float = 600.0) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.timeout_s = timeout_s

    def wait_until_ready(self, timeout_s: float = 300.0) -> Pong:
        """Ping until the scheduler answers (it answers once its model and grammar backend are loaded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ping = PingReq(ping_id=uuid.uuid4().hex)
            self.socket.send(encode(ping))
            while self.socket.poll(1000):
                message = decode_server_message(self.socket.recv())
                if isinstance(message, Pong) and message.ping_id == ping.ping_id:
                    return message
        raise TimeoutError(f"the scheduler did not answer within {timeout_s:g} s")

    def generate(self, **request: Any) -> GenerateOutput:
        """Send one request (arguments of ``make_request``) and wait for its final output."""
        return self.generate_batch([make_request(**request)])[0]

    def generate_batch(self, requests: list[GenerateReq]) -> list[GenerateOutput]:
        """Send all requests, then collect their final outputs (in the order given)."""
        for req in requests:
            self.socket.send(encode(req))
        finals: dict[str, GenerateOutput] = {}
        pending = {req.rid for req in requests}
        while pending:
            output = self._receive_output()
            if output.finished and output.rid in pending:
                finals[output.rid] = output
                pending.discard(output.rid)
        return [finals[req.rid] for req in requests]

    def generate_stream(self, **request: Any) -> Iterator[GenerateOutput]:
        """Send one streaming request and yield its chunks until the final one."""
        req = make_request(stream=True, **request)
        self.socket.send(encode(req))
        while True:
            output = self._receive_output()
            if output.rid == req.rid:
                yield output
                if output.finished:
                    return

    def abort(self, rid: str) -> None:
        self.socket.send(encode(AbortReq(rid=rid)))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _receive_output(self) -> GenerateOutput:
        if not self.socket.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(f"no answer from the scheduler within {self.timeout_s:g} s")
        message = decode_server_message(self.socket.recv())
        if not isinstance(message, GenerateOutput):
            return self._receive_output()
        return message


class SchedulerGoneError(ConnectionError):
    """The scheduler stopped answering for good (its process is gone): raised by every pending and later request."""


class AsyncSchedulerClient:
    """An asyncio client: any number of concurrent ``generate`` / ``stream`` calls over one socket."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self._queues: dict[str, asyncio.Queue[GenerateOutput | SchedulerGoneError]] = {}
        self._gone: SchedulerGoneError | None = None
        self._pings: dict[str, asyncio.Future[Pong]] = {}
        self._flushes: dict[str, asyncio.Future[FlushCacheDone]] = {}
        self._receiver: asyncio.Task[None] | None = None

    async def wait_until_ready(self, timeout_s: float = 300.0) -> Pong:
        self._ensure_receiver()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ping = PingReq(ping_id=uuid.uuid4().hex)
            answer = self._pings[ping.ping_id] = asyncio.get_running_loop().create_future()
            await self.socket.send(encode(ping))
            try:
                return await asyncio.wait_for(answer, timeout=1.0)
            except TimeoutError:
                continue
            finally:
                self._pings.pop(ping.ping_id, None)
        raise TimeoutError(f"the scheduler did not answer within {timeout_s:g} s")

    async def flush_cache(self, timeout_s: float = 30.0) -> FlushCacheDone:
        """Ask the scheduler to drop its prefix cache; raises ``TimeoutError`` if it does not answer in time."""
        self._ensure_receiver()
        request = FlushCacheReq(request_id=uuid.uuid4().hex)
        answer = self._flushes[request.request_id] = asyncio.get_running_loop().create_future()
        try:
            await self.socket.send(encode(request))
            return await asyncio.wait_for(answer, timeout=timeout_s)
        finally:
            self._flushes.pop(request.request_id, None)

    async def generate(self, **request: Any) -> GenerateOutput:
        """Send one request (arguments of ``make_request``) and await its final output."""
        async for output in self._exchange(make_request(**request)):
            if output.finished:
                return output
        raise RuntimeError("the scheduler closed the request without a final output")

    def stream(self, **request: Any) -> AsyncIterator[GenerateOutput]:
        """Send one streaming request and yield its chunks until the final one.

        Leaving the iteration early (or being cancelled) aborts the request in the scheduler.
        """
        return self._exchange(make_request(stream=True, **request))

    async def _exchange(self, req: GenerateReq) -> AsyncIterator[GenerateOutput]:
        if self._gone is not None:
            raise self._gone
        self._ensure_receiver()
        queue: asyncio.Queue[GenerateOutput | SchedulerGoneError] = asyncio.Queue()
        self._queues[req.rid] = queue
        finished = False
        try:
            await self.socket.send(encode(req))
            while not finished:
                output = await queue.get()
                if isinstance(output, SchedulerGoneError):
                    finished = True  # nobody is left to abort it
                    raise output
                finished = output.finished
                yield output
        finally:
            self._queues.pop(req.rid, None)
            if not finished:
                await self.abort(req.rid)

    def fail_pending(self, error: SchedulerGoneError) -> None:
        """The scheduler is gone: every pending request raises ``error`` now, and every later one at once."""
        self._gone = error
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def abort(self, rid: str) -> None:
        await self.socket.send(encode(AbortReq(rid=rid)))

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self.socket.close(linger=0)
        self.context.term()

    def _ensure_receiver(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive_forever())

    async def _receive_forever(self) -> None:
        while True:
            message = decode_server_message(await self.socket.recv())
            if isinstance(message, Pong):
                answer = self._pings.get(message.ping_id)
                if answer is not None and not answer.done():
                    answer.set_result(message)
            elif isinstance(message, FlushCacheDone):
                flushed = self._flushes.get(message.request_id)
                if flushed is not None and not flushed.done():
                    flushed.set_result(message)
            elif message.rid in self._queues:
                self._queues[message.rid].put_nowait(message)
