"""The gateway's Prometheus metrics: one registry per app, and the middleware that counts every request."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.common.protos import cacheguard_pb2

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
CLIENT_CLOSED = 499  # nginx's "client closed request", for metrics and logs only
# Label values the cache guard reports (cacheguard.proto); anything else is counted as "other".
_PREFIX_FIELDS = frozenset(
    "content role name tool_call_id reasoning_content tool_calls tools volatile messages rendering "
    "generation_prompt tokens".split()
)
_NORMALIZATIONS = frozenset({"tool_order", "volatile_lines", "reasoning"})
_ROUTING = frozenset({"affinity", "least_loaded", "moved"})


class GatewayMetrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvmem_gateway_requests", "HTTP requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("kvmem_gateway_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("kvmem_gateway_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("kvmem_gateway_cached_tokens", "Prompt tokens with reused KV", registry=r)
        self.stream_errors = Counter(
            "kvmem_gateway_stream_errors", "Errors sent inside an SSE stream", ["route", "type"], registry=r
        )
        self.ttft = Histogram(
            "kvmem_gateway_time_to_first_token_seconds",
            "Request start to first generated token",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "kvmem_gateway_request_latency_seconds",
            "Request start to last byte",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("kvmem_gateway_requests_in_flight", "Requests in progress", ["route"], registry=r)
        # From the cache guard's prefix report and routing decision (GuardDone).
        self.prefix_requests = Counter(
            "kvmem_guard_prefix_requests", "Requests by prefix outcome (new_session, extended, diverged)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.prefix_divergences = Counter(
            "kvmem_guard_prefix_divergences", "Diverged prompts by the field that changed", ["field"], registry=r
        )
        self.prefix_lost_tokens = Counter(
            "kvmem_guard_prefix_lost_tokens", "Tokens of a session's previous prompt not kept as prefix", registry=r
        )
        self.normalizations = Counter(
            "kvmem_guard_normalizations", "Requests changed by a cache-guard normalisation", ["name"], registry=r
        )
        self.routing = Counter("kvmem_guard_routing", "Engine replica choices", ["decision"], registry=r)

    def record_done(self, done: cacheguard_pb2.GuardDone) -> None:
        u = done.engine_done.usage
        self.prompt_tokens.inc(u.prompt_tokens)
        self.completion_tokens.inc(u.completion_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        p = done.prefix
        self.prefix_requests.labels(
            "new_session" if p.previous_tokens == 0 else "diverged" if p.diverged else "extended"
        ).inc()
        if p.diverged:
            self.prefix_divergences.labels(_known(p.divergence_field, _PREFIX_FIELDS)).inc()
            self.prefix_lost_tokens.inc(max(0, p.previous_tokens - p.common_prefix_tokens))
        for name in p.normalizations:
            self.normalizations.labels(_known(name, _NORMALIZATIONS)).inc()
        if done.routing:
            self.routing.labels(_known(done.routing, _ROUTING)).inc()


def _known(value: str, known: frozenset[str]) -> str:
    return value if value in known else "other"


def route_label(path: str) -> str:
    """Metrics label of a path: one of the known routes, or 'other' (bounded cardinality)."""
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class MetricsMiddleware:
    """Counts requests by route and status, times them to the last byte, tracks those in flight."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])
        started = time.perf_counter()
        scope.setdefault("state", {})["started"] = started
        status = 500  # what an exception escaping the app becomes

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        gauge = self.metrics.in_flight.labels(route)
        gauge.inc()
        try:
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            gauge.dec()
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
