"""Two servers on one machine started by HTTP port alone (``--port A``, ``--port B``, as SGLang's router recipe
writes them): the second finds the scheduler's default zmq port taken and takes a free one, and both serve. Servers
of their own, not the shared one: the point is two launches with no ``--zmq-port``. Each is forked from the session's
preloaded launcher (``scheduler.preloaded_launch``), which runs ``scheduler.launch``'s ``main`` on these flags as the
command would, its imports done: the two starts come one after the other, and each would otherwise import torch
first."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

import httpx

from scheduler.server_args import ZMQ_PORT, parse_server_args
from scheduler.testing.process import free_port, launch_environment, wait_until_healthy
from tests.helpers import PRELOADED_LAUNCHER, TEST_SERVER_FLAGS


@contextmanager
def http_server(port: int, log: Path) -> Iterator[str]:
    arguments = ["--port", str(port), *TEST_SERVER_FLAGS]
    process = PRELOADED_LAUNCHER.launch(arguments, launch_environment(), log, idle_priority=False)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, lambda: log.read_text(errors="replace"), 300)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def test_a_second_server_by_http_port_alone_takes_a_free_zmq_port(tmp_path: Path) -> None:
    """Started one after the other: the first takes the default zmq port (if nothing else here holds it), the
    second finds it taken; both answer a constrained request."""
    schema = {"name": "answer", "schema": {"enum": ["yes", "no"]}}
    body = {"messages": [{"role": "user", "content": "Yes or no?"}], "max_tokens": 4}
    body["response_format"] = {"type": "json_schema", "json_schema": schema}
    with ExitStack() as servers:
        urls = [servers.enter_context(http_server(free_port(), tmp_path / f"server{i}.log")) for i in range(2)]
        for url in urls:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"] in ('"yes"', '"no"')


def test_without_an_http_port_the_zmq_port_stays_where_clients_look() -> None:
    """A zmq-only server keeps the default even if it is taken (its clients connect there: it fails, visibly);
    an explicit ``--zmq-port`` is always kept."""
    with socket.socket() as holder:
        with suppress(OSError):  # held here, or already by something else
            holder.bind(("127.0.0.1", ZMQ_PORT))
        assert parse_server_args([]).serving.zmq_port == ZMQ_PORT
        assert parse_server_args(["--port", "30000", "--zmq-port", str(ZMQ_PORT)]).serving.zmq_port == ZMQ_PORT
        assert parse_server_args(["--port", "30000"]).serving.zmq_port != ZMQ_PORT
