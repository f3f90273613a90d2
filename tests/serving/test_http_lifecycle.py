"""The HTTP frontend's life: a client that disconnects aborts its request; the frontend stops with the launcher."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

from tests.helpers import MODEL, QUESTION, HttpServer, http_server, serving


async def _wait_for_health(http: httpx.AsyncClient, condition: Callable[[dict[str, Any]], bool]) -> None:
    """Poll ``/health`` until ``condition`` holds (a busy scheduler may answer late: 503, or an older answer)."""
    deadline = time.monotonic() + 120
    while True:
        response = await http.get("/health")
        if response.status_code == 200 and condition(response.json()):
            return
        assert time.monotonic() < deadline, response.text
        await asyncio.sleep(0.1)


def _is_idle(health: dict[str, Any]) -> bool:
    return health["running_requests"] == 0 and health["scheduler"]["num_running_requests"] == 0


async def _disconnect_mid_request(url: str, stream: bool) -> None:
    rid = f"disconnect-{stream}"
    # Counting goes on to the token limit (no EOS), long enough to be caught running.
    params = {"max_new_tokens": 300, "temperature": 0}
    body = {"text": "1, 2, 3, 4, 5, 6,", "rid": rid, "stream": stream, "sampling_params": params}
    again = {"text": "Hi", "rid": rid, "sampling_params": {"max_new_tokens": 1}}
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:

        async def consume() -> None:
            async with http.stream("POST", "/generate", json=body) as response:
                async for _ in response.aiter_bytes():
                    pass

        request = asyncio.create_task(consume())
        await _wait_for_health(http, lambda h: h["scheduler"]["num_running_requests"] == 1)
        clash = await http.post("/generate", json=again)
        assert clash.status_code == 400 and "is running" in clash.json()["error"]["message"], clash.text
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        await _wait_for_health(http, _is_idle)
        # The frontend has sent the abort before this request on the same socket: the scheduler freed the rid.
        response = await http.post("/generate", json=again)
        assert response.status_code == 200, response.text


@pytest.mark.model
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_client_disconnect_aborts_the_request_in_the_scheduler(server: HttpServer, stream: bool) -> None:
    asyncio.run(_disconnect_mid_request(server.url, stream))
    assert f"aborting 1 scheduler request(s) ['disconnect-{stream}']" in server.log()


def _is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _ctrl_c(live: HttpServer) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the whole foreground process group."""
    for pid in (live.process.pid, live.frontend_pid()):
        os.kill(pid, signal.SIGINT)


SHUTDOWN_CASES: dict[str, Callable[[HttpServer], None]] = {
    "ctrl-c": _ctrl_c,
    "SIGTERM": lambda live: live.process.send_signal(signal.SIGTERM),
    "SIGKILL": lambda live: live.process.send_signal(signal.SIGKILL),
}
"""How the launcher is stopped: Ctrl-C reaches the frontend as well, the others the launcher alone."""
DOOMED_FLAGS = ("--grammar-backend", "none", "--max-running-requests", "2")
pytestmark = pytest.mark.launches(*DOOMED_FLAGS, http=True, count=len(SHUTDOWN_CASES))


@pytest.fixture(scope="module")
def doomed_servers() -> Iterator[dict[str, HttpServer]]:
    """A small server per way of stopping it, started side by side."""
    servers = {how: http_server(*DOOMED_FLAGS) for how in SHUTDOWN_CASES}
    with serving(*servers.values()):
        yield servers


@pytest.mark.model
@pytest.mark.parametrize("how", SHUTDOWN_CASES)
def test_the_frontend_stops_with_the_launcher(doomed_servers: dict[str, HttpServer], how: str) -> None:
    """Mid-stream, the client gets an error; the frontend exits (by itself when the launcher is killed)."""
    live = doomed_servers[how]
    frontend = live.frontend_pid()
    stream = live.openai_client().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=300, stream=True)
    next(iter(stream))
    SHUTDOWN_CASES[how](live)
    with pytest.raises(openai.APIError) as raised:  # an error event, not a body cut off mid-chunk
        for _ in stream:
            pass
    if how == "SIGKILL":
        assert "the scheduler (launcher pid" in str(raised.value) and "is gone" in str(raised.value)
    assert live.process.wait(timeout=60) == (-signal.SIGKILL if how == "SIGKILL" else 0), live.log()[-4000:]
    deadline = time.monotonic() + 30
    while _is_alive(frontend):
        assert time.monotonic() < deadline, f"the frontend (pid {frontend}) outlived the launcher"
        time.sleep(0.1)
    with socket.create_server(("127.0.0.1", live.port)):
        pass
