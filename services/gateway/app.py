"""The gateway's FastAPI app: OpenAI routes in front of the cache guard, API keys, metrics.

A request: AuthMiddleware checks the bearer key (/v1/* only) and names the tenant -> the route
validates the body (schemas.py), converts it (convert.py) and opens the guard's Generate stream
(guard_client.py) -> events come back as one JSON response or as SSE chunks -> MetricsMiddleware
(metrics.py) records route, status and latency.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.protos import cacheguard_pb2
from services.gateway import convert, edge, planning
from services.gateway.config import GatewayConfig
from services.gateway.edge import BodyLimitMiddleware, RequestIdMiddleware
from services.gateway.errors import (
    GatewayError,
    internal_error,
    invalid_request,
    map_stream_error,
    map_validation_errors,
)
from services.gateway.guard_client import GuardClient
from services.gateway.metrics import CLIENT_CLOSED, GatewayMetrics, MetricsMiddleware, route_label
from services.gateway.planner.plan import Level, PlanRequest
from services.gateway.planner.planner import Planner
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest, ModelList

logger = logging.getLogger(__name__)

T = TypeVar("T")
GuardEvents = AsyncGenerator[cacheguard_pb2.GuardGenerateEvent, None]

MAX_SESSION_ID_CHARS = 256


# ---------------------------------------------------------------- auth


class AuthMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1/* when keys are configured; sets state.tenant."""

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app = app
        self.keys = [(k.key.encode(), k.name) for k in config.api_keys]

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant of a valid Authorization header, else None (constant-time key compare)."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        given = token.strip().encode()
        found = None
        for key, name in self.keys:
            if hmac.compare_digest(key, given):
                found = name
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1/"):
            scope.setdefault("state", {})["tenant"] = ""
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1") or None
        tenant = self.tenant_of(header)
        if tenant is None:
            message = (
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
                if header is None
                else "Incorrect API key provided."
            )
            err = GatewayError(401, "invalid_request_error", message, None, "invalid_api_key")
            err.request_id = scope.get("state", {}).get("request_id")
            await _error_response(err)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


# ---------------------------------------------------------------- helpers


def _error_response(err: GatewayError) -> JSONResponse:
    headers = err.headers() | ({"x-request-id": err.request_id} if err.request_id else {})
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _json(model: BaseModel, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), headers=headers)


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"


def _guard(request: Request) -> GuardClient:
    guard: GuardClient | None = request.app.state.guard
    if guard is None:
        raise GatewayError(503, "service_unavailable", "The gateway is starting; try again.", None, "unavailable")
    return guard


def _normalizations_off(request: Request) -> bool:
    """X-KVMem-Normalize: off renders the messages exactly as sent (the prefix-stability control); on (or no
    header) lets the guard normalise; any other value is a 400, not a silent default."""
    value = request.headers.get("x-kvmem-normalize", "").strip().lower()
    if value not in ("", "on", "off"):
        raise invalid_request(f"X-KVMem-Normalize is {value!r}; use 'off' (or 'on', the default)")
    return value == "off"


def _session_id(request: Request) -> str:
    session_id = request.headers.get("x-session-id", "").strip()
    if len(session_id) > MAX_SESSION_ID_CHARS:
        raise invalid_request(f"X-Session-Id is {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS}")
    return session_id


async def _served_model(guard: GuardClient, asked: str) -> str:
    """The id of the model that will answer (any requested name is accepted)."""
    try:
        return (await guard.model_info()).model_id or asked
    except GatewayError:
        return asked  # Generate will report the outage itself


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it (and so the guard call) and return None."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watcher.exception() is not None:
            logger.warning("cannot watch for disconnects: %r", watcher.exception())
            await asyncio.wait({task})
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # delivered at the task's next await: it is not done yet
            logger.info("client disconnected; request cancelled")
    return task.result() if task.done() and not task.cancelled() else None


# ---------------------------------------------------------------- generation


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client went away
    while the body was between chunks (closing it cancels the guard call)."""

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                with anyio.CancelScope(shield=True):
                    await body.aclose()


class _Generation:
    """One Generate call seen from a route: event order checks, metrics, response building."""

    def __init__(
        self, request: Request, builder: convert.ResponseBuilder, events: GuardEvents, metrics: GatewayMetrics
    ) -> None:
        self.request = request
        self.builder = builder
        self.events = events
        self.metrics = metrics
        self.route = route_label(request.url.path)
        self.started: float = request.state.started if hasattr(request.state, "started") else time.perf_counter()
        self.first_token_seen = False

    async def next_event(self) -> cacheguard_pb2.GuardGenerateEvent:
        """The next event; a stream error event or a stream ending without `done` raises GatewayError."""
        event = await anext(self.events, None)
        if event is None:
            logger.error("request %s: guard stream ended without done", self.builder.id)
            raise internal_error()
        kind = event.WhichOneof("event")
        if kind == "error":
            raise map_stream_error(event.error)
        if kind == "chunk" and not self.first_token_seen:
            self.first_token_seen = True
            self.metrics.ttft.labels(self.route).observe(time.perf_counter() - self.started)
        if kind == "done":
            self.metrics.record_done(event.done)
        return event

    async def collect(self) -> JSONResponse:
        """Non-streamed answer: the whole text, usage and kvmem in one response."""
        texts: list[str] = []
        async with aclosing(self.events):
            while (event := await self.next_event()).WhichOneof("event") != "done":
                texts.append(event.chunk.text)
        headers = {"X-Request-Id": self.builder.id, "X-Session-Id": event.done.prefix.session_id}
        return _json(self.builder.whole("".join(texts), event.done), headers)

    async def stream(self, include_usage: bool) -> StreamingResponse:
        """Streamed answer. Waits for the first event so that errors found before generation
        (context length, overload) still get their HTTP status; later errors become SSE error events."""
        try:
            first = await self.next_event()
        except BaseException:
            await self.events.aclose()
            raise
        headers = {"X-Request-Id": self.builder.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = self._sse_body(first, include_usage)
        return _SSEResponse(body, media_type="text/event-stream", headers=headers)

    async def _sse_body(self, event: cacheguard_pb2.GuardGenerateEvent, include_usage: bool) -> AsyncIterator[str]:
        async with aclosing(self.events):
            try:
                opening = self.builder.opening()
                if opening is not None:
                    yield _sse(opening)
                while event.WhichOneof("event") == "chunk":
                    if event.chunk.text:
                        yield _sse(self.builder.delta(event.chunk.text))
                    event = await self.next_event()
                yield _sse(self.builder.closing(event.done))
                if include_usage:
                    yield _sse(self.builder.usage_chunk(event.done))
            except GatewayError as err:
                logger.warning("request %s: stream ends with error %s %s", self.builder.id, err.status, err.message)
                self.metrics.stream_errors.labels(self.route, err.type).inc()
                err.request_id = self.builder.id
                yield _sse(err.body())
            except Exception:
                logger.exception("request %s: error while streaming", self.builder.id)
                self.metrics.stream_errors.labels(self.route, "server_error").inc()
                err = internal_error()
                err.request_id = self.builder.id
                yield _sse(err.body())
            yield "data: [DONE]\n\n"


async def _generate(
    request: Request,
    greq: cacheguard_pb2.GuardGenerateRequest,
    builder: convert.ResponseBuilder,
    *,
    stream: bool,
    include_usage: bool,
    plan: PlanRequest,
) -> Response:
    guard = _guard(request)
    greq.normalizations_off = _normalizations_off(request)
    # The segment planner picks the level: L1 goes on below as one call; L2/L2z/L3 are planned answers.
    planned = await _until_disconnect(request, planning.decide(guard, request.app.state.config, greq, plan))
    if planned is None:
        return Response(status_code=CLIENT_CLOSED)
    planner, decision = planned
    if decision.level is not Level.L1:
        return await _planned(request, planner, decision, builder, greq, stream=stream, include_usage=include_usage)
    greq.prefill_policy = convert.prefill_policy(decision.prefill_policy)
    builder.plan = decision.report
    gen = _Generation(request, builder, guard.generate(greq), request.app.state.metrics)
    logger.info("request %s: tenant=%r session=%r stream=%s", greq.request_id, greq.tenant, greq.session_id, stream)
    response = await _until_disconnect(request, gen.stream(include_usage) if stream else gen.collect())
    return response if response is not None else Response(status_code=CLIENT_CLOSED)


async def _planned(
    request: Request,
    planner: Planner,
    decision: planning.Decision,
    builder: convert.ResponseBuilder,
    greq: cacheguard_pb2.GuardGenerateRequest,
    *,
    stream: bool,
    include_usage: bool,
) -> Response:
    """An answer of the segment planner (L2, L2z, L3): one JSON body, or SSE with progress chunks."""
    metrics: GatewayMetrics = request.app.state.metrics
    route = route_label(request.url.path)
    headers = {"X-Request-Id": builder.id}
    if stream:
        body = planning.sse_body(
            planner, decision, builder, greq.session_id, include_usage,
            on_done=metrics.record_done, on_error=lambda kind: metrics.stream_errors.labels(route, kind).inc(),
        )  # fmt: skip
        headers |= {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return _SSEResponse(body, media_type="text/event-stream", headers=headers)
    result = await _until_disconnect(request, planning.whole(planner, decision, builder, greq.session_id))
    if result is None:
        return Response(status_code=CLIENT_CLOSED)
    response, done = result
    metrics.record_done(done)
    return _json(response, {**headers, "X-Session-Id": greq.session_id})


# ---------------------------------------------------------------- routes


async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    """POST /v1/chat/completions."""
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    edge.set_request_id(request, response_id)
    greq = convert.chat_request(
        body, request_id=response_id, session_id=_session_id(request), tenant=request.state.tenant
    )
    model = await _served_model(_guard(request), body.model)
    builder = convert.ChatBuilder(response_id, int(time.time()), model)
    plan = convert.plan_request(body, request.app.state.config.planner)
    return await _generate(request, greq, builder, stream=body.stream, include_usage=body.include_usage, plan=plan)


async def completions(request: Request, body: CompletionRequest) -> Response:
    """POST /v1/completions."""
    response_id = f"cmpl-{uuid.uuid4().hex}"
    edge.set_request_id(request, response_id)
    greq = convert.completion_request(
        body, request_id=response_id, session_id=_session_id(request), tenant=request.state.tenant
    )
    model = await _served_model(_guard(request), body.model)
    builder = convert.CompletionBuilder(response_id, int(time.time()), model)
    plan = convert.plan_request(body, request.app.state.config.planner)
    return await _generate(request, greq, builder, stream=body.stream, include_usage=body.include_usage, plan=plan)


async def list_models(request: Request) -> JSONResponse:
    """GET /v1/models: the one served model, with its context and pool sizes under `kvmem`."""
    info = await _guard(request).model_info()
    return _json(ModelList(data=[convert.model_card(info)]))


async def get_model(request: Request, model_id: str) -> JSONResponse:
    """GET /v1/models/{model_id}."""
    info = await _guard(request).model_info()
    if model_id != info.model_id:
        raise GatewayError(
            404, "invalid_request_error", f"The model '{model_id}' does not exist", "model", "model_not_found"
        )
    return _json(convert.model_card(info))


async def metrics(request: Request) -> Response:
    """GET /metrics: Prometheus text format."""
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------- errors


async def _on_gateway_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    exc.request_id = exc.request_id or edge.request_id_of(request)
    return _error_response(exc)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    err = map_validation_errors(exc.errors())
    err.request_id = edge.request_id_of(request)
    content_type = request.headers.get("content-type", "")
    if err.param is None and content_type and "json" not in content_type:
        err.message += f" Send it with 'Content-Type: application/json' (got {content_type!r})."
    return _error_response(err)


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message, code = f"Unknown request URL: {request.method} {request.url.path}.", "unknown_url"
    else:
        message, code = str(exc.detail), None
    err = GatewayError(exc.status_code, "invalid_request_error", message, None, code)
    err.request_id = edge.request_id_of(request)
    return _error_response(err)


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = edge.request_id_of(request)
    logger.exception("request %s: unhandled error on %s %s", request_id, request.method, request.url.path, exc_info=exc)
    err = internal_error()
    err.request_id = request_id
    return _error_response(err)


# ---------------------------------------------------------------- app


def create_app(config: GatewayConfig, guard_client: GuardClient | None = None) -> FastAPI:
    """The gateway app. Without `guard_client`, one is made for config.cacheguard_addr at start-up
    (lifespan) and closed at shutdown; a given client stays owned by the caller."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = None
        if app.state.guard is None:
            owned = app.state.guard = GuardClient(
                config.cacheguard_addr,
                request_timeout_s=config.request_timeout_s,
                model_info_ttl_s=config.model_info_ttl_s,
                secret=config.internal_secret,
            )
        try:
            yield
        finally:
            if owned is not None:
                app.state.guard = None
                await owned.close()

    app = FastAPI(title="KVMem gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.guard = guard_client
    app.state.metrics = GatewayMetrics()
    app.add_middleware(AuthMiddleware, config=config)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)  # sees 401s and 413s too
    app.add_middleware(RequestIdMiddleware)  # outermost: every response carries x-request-id
    handlers: list[tuple[Any, Callable[[Request, Exception], Awaitable[JSONResponse]]]] = [
        (GatewayError, _on_gateway_error),
        (RequestValidationError, _on_validation_error),
        (StarletteHTTPException, _on_http_error),
        (Exception, _on_unexpected),
    ]
    for exc_type, handler in handlers:
        app.add_exception_handler(exc_type, handler)
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", get_model, methods=["GET"])
    app.add_api_route("/health", edge.health, methods=["GET"])
    app.add_api_route("/ready", edge.ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
