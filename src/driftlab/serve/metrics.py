"""`/metrics`: what an operator watches, in Prometheus' text format (prometheus_client).

One registry per app (so two servers in one process, as in tests, never share counters):
queue depth and requests in flight (read when scraped), batch sizes, generated tokens
(tokens/s is `rate(driftlab_generated_tokens_total[1m])`), request latency, responses
by HTTP status, including errors that end a stream after its 200 header, and drift
(`serve.telemetry`): pi and the persona projection of each measured reply, at its first and
last token, labelled by a short hash of its system prompt, its KLs where asked, and
`when-drifting`'s decisions.
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
_PI_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)  # an attention mass
_PROJECTION_BUCKETS = (-0.5, 0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # 0: like without the prompt, 1: with
_KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)  # nats per token, over orders of magnitude


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
        self.pi = Histogram("driftlab_pi", "Attention mass on the system prompt (mean over layers and heads) at a "
                            "reply's first or last token.", ["prompt", "at"], buckets=_PI_BUCKETS, registry=r)
        self.projection = Histogram("driftlab_projection", "Residual-stream projection on the persona's direction "
                                    "(0 like without the system prompt, 1 like with it) at a reply's first or last "
                                    "token.", ["prompt", "at"], buckets=_PROJECTION_BUCKETS, registry=r)
        self.kl = Histogram("driftlab_kl", "A reply's KL in nats per token (asked for with telemetry's kl): "
                            "'reminded', to the dialog with its system prompt restated; 'prompt', to the dialog "
                            "without it.", ["prompt", "kind"], buckets=_KL_BUCKETS, registry=r)
        self.gate = Counter("driftlab_gate_decisions", "Replies under `when-drifting`, by whether the conversation "
                            "had drifted enough to be steered.", ["prompt", "steered"], registry=r)

    def batch(self, size: int, replies: Sequence[Any]) -> None:
        """A generate call finished (from the batcher's thread; prometheus_client is thread-safe)."""
        self.batch_size.observe(size)
        self.tokens.inc(sum(r.n_tokens for r in replies))

    def drift(self, prompt: str, telemetry: dict[str, Any]) -> None:
        """One reply's telemetry (`serve.telemetry.summary`), under its prompt's label."""
        for name, histogram in (("pi", self.pi), ("projection", self.projection)):
            if (values := telemetry.get(name)) is not None:
                for at in ("first", "last"):
                    histogram.labels(prompt, at).observe(values[at])
        if (kl := telemetry.get("kl")) is not None:
            for kind in ("reminded", "prompt"):
                self.kl.labels(prompt, kind).observe(kl[kind])
        if (gate := telemetry.get("gate")) is not None:
            self.gate.labels(prompt, str(gate["steered"]).lower()).inc()

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
