"""The live HTTP server every HTTP test module shares (one start for the package)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.helpers import HttpServer, http_server, serving


@pytest.fixture(scope="package")
def server() -> Iterator[HttpServer]:
    live = http_server()
    with serving(live):
        yield live


@pytest.fixture(scope="package")
def client(server: HttpServer) -> openai.OpenAI:
    return server.openai_client()
