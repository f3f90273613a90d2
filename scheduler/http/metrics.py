"""``GET /metrics``: Prometheus metrics in SGLang's ``sglang:`` names.

The frontend measures what it sees of each request (counts, end-to-end latency, time to first token and per
output token for streamed requests, refusals by reason) in its own registry; the scheduler's gauges come from its
``Pong`` and its grammar metrics (compile times, cache lookups, timeouts) as the Prometheus text it sends there.
Every generation (one choice of one prompt) counts once, labelled with its constraint kind and finish reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from scheduler.io_struct import GenerateOutput, Pong, SamplingParams

logger = logging.getLogger("scheduler.http")

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class FrontendMetrics:
    """The frontend's metrics; ``render(pong)`` is the body of ``GET /metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["constraint", "finish_reason"]
        self.num_requests = Counter(
            "sglang:num_requests", "Generations answered (one per choice and prompt)", labels, registry=self.registry
        )
        self.e2e_latency = Histogram(
            "sglang:e2e_request_latency_seconds",
            "From the HTTP request's arrival to a generation's last output",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds",
            "From the HTTP request's arrival to a streamed generation's first token",
            ["constraint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "sglang:time_per_output_token_seconds",
            "Mean time per output token after the first, of a streamed generation",
            ["constraint"],
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("sglang:generation_tokens", "Output tokens generated", registry=self.registry)
        self.num_refused = Counter(
            "sglang:num_refused_requests",
            "HTTP requests answered with an error, by reason (the error's code, else its status)",
            ["reason"],
            registry=self.registry,
        )
        self.num_running = Gauge("sglang:num_running_reqs", "Requests decoding", registry=self.registry)
        self.num_queued = Gauge("sglang:num_queue_reqs", "Requests waiting for KV memory", registry=self.registry)
        self.num_compiling = Gauge(
            "sglang:num_grammar_queue_reqs", "Requests waiting for their grammar to compile", registry=self.registry
        )
        self.cache_hit_rate = Gauge("sglang:cache_hit_rate", "Prefix cache hit rate", registry=self.registry)
        self.speculative = SpeculativeCounters()
        self.registry.register(self.speculative)

    def refused(self, reason: str) -> None:
        self.num_refused.labels(reason).inc()

    def render(self, pong: Pong | None) -> bytes:
        """The exposition text: this registry's metrics, then the scheduler's (none if it did not answer)."""
        if pong is None:
            return generate_latest(self.registry)
        self.num_running.set(pong.num_running_requests)
        self.num_queued.set(pong.num_waiting_requests)
        self.num_compiling.set(pong.num_compiling_requests)
        self.cache_hit_rate.set(pong.cache_hit_rate)
        self.speculative.pong = pong
        return generate_latest(self.registry) + pong.metrics_text.encode()


class GenerationTimer:
    """Times one generation from ``started`` (``time.monotonic()``); ``observe`` each output as it arrives. Its end
    is logged as one ``key=value`` line that starts with the request id."""

    def __init__(self, metrics: FrontendMetrics, rid: str, params: SamplingParams, started: float) -> None:
        fields = params.constraint_fields()
        self.metrics = metrics
        self.rid = rid
        self.constraint = fields[0] if fields else "none"
        self.started = started
        self.first_token_at: float | None = None
        self.is_done = False

    def observe(self, output: GenerateOutput, is_streamed: bool) -> None:
        now = time.monotonic()
        if is_streamed and self.first_token_at is None and output.token_ids:
            self.first_token_at = now
            self.metrics.time_to_first_token.labels(self.constraint).observe(now - self.started)
        if not output.finished or self.is_done:
            return
        self.is_done = True
        reason = output.finish_reason.type if output.finish_reason is not None else "unknown"
        self.metrics.num_requests.labels(self.constraint, reason).inc()
        self.metrics.e2e_latency.labels(self.constraint, reason).observe(now - self.started)
        self.metrics.prompt_tokens.inc(output.usage.prompt_tokens)
        self.metrics.generation_tokens.inc(output.usage.completion_tokens)
        if self.first_token_at is not None and output.usage.completion_tokens > 1:
            per_token = (now - self.first_token_at) / (output.usage.completion_tokens - 1)
            self.metrics.time_per_output_token.labels(self.constraint).observe(per_token)
        logger.info(
            "rid=%s constraint=%s finish_reason=%s prompt_tokens=%d completion_tokens=%d grammar_cache_hit=%s "
            "e2e_s=%.3f",
            self.rid,
            self.constraint,
            reason,
            output.usage.prompt_tokens,
            output.usage.completion_tokens,
            output.grammar_cache_hit,
            now - self.started,
        )


class SpeculativeCounters(Collector):
    """The scheduler's speculative-decoding counters from its last ``Pong``: draft tokens proposed and accepted."""

    def __init__(self) -> None:
        self.pong: Pong | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        if self.pong is None:
            return
        for name, counts, what in (
            ("sglang:spec_draft_tokens", self.pong.drafts_proposed, "proposed"),
            ("sglang:spec_accepted_tokens", self.pong.drafts_accepted, "accepted"),
        ):
            family = CounterMetricFamily(name, f"Speculative draft tokens {what}, by draft source", labels=["source"])
            for source, count in counts.items():
                family.add_metric([source], count)
            yield family
