"""``wait_until_healthy``, which the benchmarks start servers with: it returns once ``/health`` answers 200, and a
server that exits first fails at once with the tail of its log instead of waiting out the timeout."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from scheduler.testing.process import free_port, wait_until_healthy

HEALTH_SERVER = """
import http.server, sys, time
time.sleep(0.5)  # not answering at first
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_returns_once_health_answers() -> None:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", HEALTH_SERVER, str(port)])
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", server, lambda: "", timeout_s=30)
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()


def test_a_server_that_exits_fails_at_once_with_its_log() -> None:
    exiting = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    exiting.wait()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3 at start-up:\n.*no model here"):
        wait_until_healthy(f"http://127.0.0.1:{free_port()}", exiting, lambda: "loading...\nno model here", 60)
    assert time.monotonic() - started < 10
