"""`/metrics`: what an operator watches, in Prometheus' text format (prometheus_client).

One registry per app (so two servers in one process, as in tests, never share counters):
queue depth and requests in flight (read when scraped), batch sizes, generated tokens
(tokens/s is `rate(driftlab_generated_tokens_total[1m])`), request latency, and responses
by HTTP status, including errors that end a stream after its 200 header.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Metrics:
    def __init__(self, waiting: Callable[[], int], in_flight: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        Gauge("driftlab_queue_depth", "Requests waiting for a decode batch.", registry=r).set_function(waiting)
        Gauge("driftlab_requests_in_flight", "Requests accepted and not yet answered.",
              registry=r).set_function(in_flight)
        self.batch_size = Histogram("driftlab_batch_size", "Requests decoded together per generate call.",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.tokens = Counter("driftlab_generated_tokens", "Tokens generated for clients.", registry=r)
        self.latency = Histogram("driftlab_request_latency_seconds",
                                 "Chat completion time, arrival to last byte.", buckets=_LATENCY_BUCKETS, registry=r)
        self.responses = Counter("driftlab_responses", "Responses by HTTP status (stream errors by the status "
                                 "their error event carries).", ["code"], registry=r)

    def batch(self, size: int, replies: Sequence[Any]) -> None:
        """A generate call finished (from the batcher's thread; prometheus_client is thread-safe)."""
        self.batch_size.observe(size)
        self.tokens.inc(sum(r.n_tokens for r in replies))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountResponses:
    """ASGI middleware counting every response's status, 404s and 500s included."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
