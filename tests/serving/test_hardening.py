"""What an operator sees: Prometheus metrics that count requests, compiles and refusals, a scheduler without a grammar
backend that refuses constraints, and a launcher that stops with the reason when its HTTP frontend dies."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import PHONE_REGEX, QUESTION, HttpServer, http_server, serving

SCHEMA = {"type": "object", "properties": {"metric": {"type": "integer"}}, "required": ["metric"]}


def scrape(server: HttpServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``GET /metrics``: ``(name, sorted labels) -> value``."""
    response = httpx.get(f"{server.url}/metrics", timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.mark.model
def test_metrics_count_generations_compiles_cache_hits_and_refusals(server: HttpServer) -> None:
    before = scrape(server)
    body = {"messages": QUESTION, "max_tokens": 8, "guided_json": SCHEMA}
    for _ in range(2):  # a compile, then a cache hit
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    stream = {"messages": QUESTION, "max_tokens": 3, "stream": True}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=stream, timeout=120).status_code == 200
    refused = {"messages": QUESTION, "max_tokens": "8"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=refused, timeout=120).status_code == 400
    after = scrape(server)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    generations = sum(
        grew("sglang:num_requests_total", constraint="json_schema", finish_reason=reason)
        for reason in ("stop", "length")
    )
    assert generations == 2
    assert (
        grew("sglang:e2e_request_latency_seconds_count", constraint="json_schema", finish_reason="stop")
        + grew("sglang:e2e_request_latency_seconds_count", constraint="json_schema", finish_reason="length")
        == 2
    )
    assert grew("sglang:time_to_first_token_seconds_count", constraint="none") == 1
    assert grew("sglang:grammar_cache_lookups_total", constraint="json", result="miss") == 1
    assert grew("sglang:grammar_cache_lookups_total", constraint="json", result="hit") == 1
    assert grew("sglang:grammar_compile_time_seconds_count", constraint="json") == 1
    assert grew("sglang:num_refused_requests_total", reason="invalid_type") == 1
    assert (
        value(after, "sglang:num_grammar_queue_reqs") == 0 and value(after, "sglang:grammar_compile_queue_length") == 0
    )


FRONTEND_DIES_FLAGS = ("--grammar-backend", "none", "--max-running-requests", "2")


@pytest.mark.model
@pytest.mark.launches(*FRONTEND_DIES_FLAGS, http=True)
def test_the_launcher_exits_with_the_reason_when_the_frontend_dies() -> None:
    """On the ``none`` backend, which first refuses a constrained request and serves a free one over zmq."""
    live = http_server(*FRONTEND_DIES_FLAGS)
    with serving(live):
        with live.client() as client:
            refused = client.generate(
                messages=[{"role": "user", "content": "What is your phone number?"}],
                sampling_params={"regex": PHONE_REGEX, "temperature": 0, "max_new_tokens": 96},
            )
            served = client.generate(text="Hello", sampling_params={"max_new_tokens": 4})
        assert refused.finish_reason is not None and refused.finish_reason.message is not None
        assert "--grammar-backend none" in refused.finish_reason.message
        assert served.finish_reason is not None and served.finish_reason.type == "length"
        os.kill(live.frontend_pid(), signal.SIGKILL)
        assert live.process.wait(timeout=60) == 1
        assert "the HTTP frontend exited with code -9: stopping" in live.log()
