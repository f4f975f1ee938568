"""The gateway's FastAPI app: OpenAI routes in front of the cache guard, API keys, metrics.

A request: AuthMiddleware checks the bearer key (/v1/* only) and names the tenant -> the route
validates the body (schemas.py), converts it (convert.py; the way back: builders.py) and opens the guard's Generate
stream (guard_client.py) -> events come back as one JSON response or as SSE chunks -> MetricsMiddleware
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
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import builders, convert, edge, planning, responses
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
from services.gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorBody,
    ModelCard,
    ModelList,
)

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
    """The Generate calls of one request (one per choice: n per prompt, batched prompts) seen from a route: event
    order checks, metrics, response building. The first call runs ahead: once its first token is out its prompt's
    pages are in the prefix cache, and the other calls start then and share them (n > 1)."""

    def __init__(
        self,
        request: Request,
        builder: builders.ChatBuilder | builders.CompletionBuilder,
        greqs: list[cacheguard_pb2.GuardGenerateRequest],
        guard: GuardClient,
        metrics: GatewayMetrics,
    ) -> None:
        self.request = request
        self.builder = builder
        self.greqs = greqs
        self.guard = guard
        self.streams: list[GuardEvents] = [guard.generate(greqs[0])]
        self.metrics = metrics
        self.route = route_label(request.url.path)
        self.started: float = request.state.started if hasattr(request.state, "started") else time.perf_counter()
        self.first_token_seen = False

    async def _start_rest(self) -> list[cacheguard_pb2.GuardGenerateEvent]:
        """Start the other choices' calls (after the first one's first event) and take their first events."""
        self.streams += [self.guard.generate(g) for g in self.greqs[1:]]
        return list(await asyncio.gather(*(self.next_event(k) for k in range(1, len(self.streams)))))

    async def aclose(self) -> None:
        for s in self.streams:
            await s.aclose()

    async def next_event(self, k: int = 0) -> cacheguard_pb2.GuardGenerateEvent:
        """The next event; a stream error event or a stream ending without `done` raises GatewayError."""
        event = await anext(self.streams[k], None)
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

    async def _collect_one(self, k: int, event: cacheguard_pb2.GuardGenerateEvent) -> cacheguard_pb2.GuardDone:
        while event.WhichOneof("event") != "done":
            self.builder.choice_delta(k, event.chunk)
            event = await self.next_event(k)
        return event.done

    async def collect(self) -> JSONResponse:
        """Non-streamed answer: every choice's text, usage and kvmem in one response."""
        try:
            first = await self.next_event(0)
            firsts = [first, *(await self._start_rest())]
            dones = await asyncio.gather(*(self._collect_one(k, e) for k, e in enumerate(firsts)))
        finally:
            await self.aclose()
        headers = {"X-Request-Id": self.builder.id, "X-Session-Id": dones[0].prefix.session_id}
        return _json(self.builder.whole_choices(list(dones)), headers)

    async def stream(self, include_usage: bool) -> StreamingResponse:
        """Streamed answer. Waits for every choice's first event so that errors found before generation
        (context length, overload) still get their HTTP status; later errors become SSE error events."""
        try:
            first = await self.next_event(0)
            firsts = [first, *(await self._start_rest())]
        except BaseException:
            await self.aclose()
            raise
        headers = {"X-Request-Id": self.builder.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = self._sse_body(firsts, include_usage)
        return _SSEResponse(body, media_type="text/event-stream", headers=headers)

    async def _pump(self, k: int, event: cacheguard_pb2.GuardGenerateEvent, out: asyncio.Queue[Any]) -> None:
        """Choice k's events into `out` as (k, event), ending with (k, done) or (k, the error raised)."""
        try:
            while True:
                await out.put((k, event))
                if event.WhichOneof("event") == "done":
                    return
                event = await self.next_event(k)
        except Exception as exc:  # noqa: BLE001 - handed to the body, which reports it
            await out.put((k, exc))

    async def _sse_body(
        self, firsts: list[cacheguard_pb2.GuardGenerateEvent], include_usage: bool
    ) -> AsyncIterator[str]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(k, e, queue)) for k, e in enumerate(firsts)]
        dones: dict[int, cacheguard_pb2.GuardDone] = {}
        try:
            for k in range(len(firsts)):
                opening = self.builder.choice_opening(k)
                if opening is not None:
                    yield _sse(opening)
            while len(dones) < len(firsts):
                k, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item.WhichOneof("event") == "chunk":
                    for chunk in self.builder.choice_delta(k, item.chunk):
                        yield _sse(chunk)
                    continue
                dones[k] = item.done
                for chunk in self.builder.choice_closing(k, item.done):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(self.builder.usage_multi([dones[k] for k in range(len(firsts))]))
        except GatewayError as err:
            logger.warning("request %s: stream ends with error %s %s", self.builder.id, err.status, err.message)
            self.metrics.stream_errors.labels(self.route, err.type).inc()
            err.request_id = self.builder.id
            yield _sse(err.body())
        except Exception:
            logger.exception("request %s: error while streaming", self.builder.id)
            self.metrics.stream_errors.labels(self.route, "server_error").inc()
            failure = internal_error()
            failure.request_id = self.builder.id
            yield _sse(failure.body())
        finally:
            for p in pumps:
                p.cancel()
            with anyio.CancelScope(shield=True):
                await self.aclose()
        yield "data: [DONE]\n\n"


async def _generate(
    request: Request,
    greqs: list[cacheguard_pb2.GuardGenerateRequest],
    builder: builders.ChatBuilder | builders.CompletionBuilder,
    *,
    stream: bool,
    include_usage: bool,
    plan: PlanRequest,
) -> Response:
    guard = _guard(request)
    greq = greqs[0]
    for g in greqs:
        g.normalizations_off = _normalizations_off(request)
    # The segment planner picks the level: L1 goes on below as one call; L2/L2z/L3 are planned answers.
    planned = await _until_disconnect(request, planning.decide(guard, request.app.state.config, greq, plan))
    if planned is None:
        return Response(status_code=CLIENT_CLOSED)
    planner, decision = planned
    if decision.level is not Level.L1:
        special = len(greqs) > 1 or builder.want_logprobs or greq.sampling.HasField("grammar")  # tools: the planner
        if special:
            raise invalid_request(
                "This prompt is over the device pool and is answered by the segment planner, which gives one "
                "free-text choice: n > 1, batched prompts, logprobs, tools and response_format need a prompt "
                "that fits the pool.", None, "over_pool_unsupported",
            )  # fmt: skip
        return await _planned(request, planner, decision, builder, greq, stream=stream, include_usage=include_usage)
    for g in greqs:
        g.prefill_policy = convert.prefill_policy(decision.prefill_policy)
    builder.plan = decision.report
    gen = _Generation(request, builder, greqs, guard, request.app.state.metrics)
    logger.info("request %s: tenant=%r session=%r stream=%s", greq.request_id, greq.tenant, greq.session_id, stream)
    response = await _until_disconnect(request, gen.stream(include_usage) if stream else gen.collect())
    return response if response is not None else Response(status_code=CLIENT_CLOSED)


async def _planned(
    request: Request,
    planner: Planner,
    decision: planning.Decision,
    builder: builders.ResponseBuilder,
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


def _check_model(request: Request, asked: str, info: engine_pb2.GetModelInfoResponse | None) -> str:
    """The served model's id; a request for another model is a 404 model_not_found (as OpenAI and vLLM answer),
    unless the name is one of the configured aliases (GatewayConfig.model_aliases)."""
    if info is None:
        return asked  # Generate will report the outage itself
    aliases = request.app.state.config.model_aliases
    if asked != info.model_id and asked not in aliases and "*" not in aliases:
        raise GatewayError(
            404, "invalid_request_error", f"The model '{asked}' does not exist", "model", "model_not_found"
        )
    return info.model_id or asked


async def _model_info(guard: GuardClient) -> engine_pb2.GetModelInfoResponse | None:
    try:
        return await guard.model_info()
    except GatewayError:
        return None


async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
    """POST /v1/chat/completions."""
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    edge.set_request_id(request, response_id)
    info = await _model_info(_guard(request))
    model = _check_model(request, body.model, info)
    fmt = info.tool_call_format if info is not None else ""
    greq = convert.chat_request(
        body, request_id=response_id, session_id=_session_id(request), tenant=request.state.tenant, tool_format=fmt
    )
    builder = builders.ChatBuilder(response_id, int(time.time()), model)
    n = body.n or 1
    builder.setup(n, n, bool(body.logprobs), convert.tool_mode(body, fmt), convert.request_tools(body), fmt)
    plan = convert.plan_request(body, request.app.state.config.planner)
    greqs = convert.choice_requests([greq], n)
    return await _generate(request, greqs, builder, stream=body.stream, include_usage=body.include_usage, plan=plan)


async def completions(request: Request, body: CompletionRequest) -> Response:
    """POST /v1/completions: one prompt or a batch, n choices each (choice index = prompt * n + j)."""
    response_id = f"cmpl-{uuid.uuid4().hex}"
    edge.set_request_id(request, response_id)
    model = _check_model(request, body.model, await _model_info(_guard(request)))
    session, tenant = _session_id(request), request.state.tenant
    prompts = [
        convert.completion_request(body, request_id=f"{response_id}-p{i}" if len(body.prompts) > 1 else response_id,
                                   session_id=session, tenant=tenant, prompt_index=i)
        for i in range(len(body.prompts))
    ]  # fmt: skip
    n = body.n or 1
    builder = builders.CompletionBuilder(response_id, int(time.time()), model)
    builder.setup(len(prompts) * n, n, body.logprobs is not None)
    plan = convert.plan_request(body, request.app.state.config.planner)
    greqs = convert.choice_requests(prompts, n)
    return await _generate(request, greqs, builder, stream=body.stream, include_usage=body.include_usage, plan=plan)


async def list_models(request: Request) -> JSONResponse:
    """GET /v1/models: the one served model, with its context and pool sizes under `kvmem`."""
    info = await _guard(request).model_info()
    return _json(ModelList(data=[responses.model_card(info)]))


async def get_model(request: Request, model_id: str) -> JSONResponse:
    """GET /v1/models/{model_id}."""
    info = await _guard(request).model_info()
    if model_id != info.model_id:
        raise GatewayError(
            404, "invalid_request_error", f"The model '{model_id}' does not exist", "model", "model_not_found"
        )
    return _json(responses.model_card(info))


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

_STATUS_TEXT = {
    400: "invalid request (invalid_request_error; code context_length_exceeded, tools_not_supported, ...)",
    401: "missing or wrong API key (invalid_api_key)",
    404: "unknown model (model_not_found)",
    413: "request body over the gateway's limit (request_too_large)",
    422: "the model answered with a malformed tool call (malformed_tool_call)",
    429: "overloaded",
    499: "the client closed the connection (no body)",
    500: "server error",
    503: "the model backend is unavailable or starting",
}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document without the 422 "Validation Error" it adds to every route with parameters: a request
    that fails validation is a 400 here (the OpenAI error body); 422 is only the malformed tool call."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema["paths"].values():
            for op in path.values():
                if op.get("responses", {}).get("422", {}).get("description") == "Validation Error":
                    del op["responses"]["422"]
        app.openapi_schema = schema
    return app.openapi_schema


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route: each status it really returns, with the OpenAI error body."""
    return {c: {"model": ErrorBody, "description": _STATUS_TEXT[c]} for c in codes}


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

    app = FastAPI(
        title="KVMem gateway",
        summary="OpenAI-compatible chat and completions in front of the KVMem cache guard",
        lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
    )  # fmt: skip
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
    gen_errors = _responses(400, 401, 404, 413, 422, 429, 499, 500, 503)
    sse = {"text/event-stream": {"schema": {"type": "string", "description": "SSE chunks when stream is true"}}}
    app.add_api_route(
        "/v1/chat/completions", chat_completions, methods=["POST"], response_model=ChatCompletion,
        responses={200: {"content": sse}, **gen_errors},
    )  # fmt: skip
    app.add_api_route(
        "/v1/completions", completions, methods=["POST"], response_model=Completion,
        responses={200: {"content": sse}, **_responses(400, 401, 404, 413, 429, 499, 500, 503)},
    )  # fmt: skip
    app.add_api_route(
        "/v1/models", list_models, methods=["GET"], response_model=ModelList, responses=_responses(401, 503)
    )
    app.add_api_route(
        "/v1/models/{model_id:path}", get_model, methods=["GET"], response_model=ModelCard,
        responses=_responses(401, 404, 503),
    )  # fmt: skip
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.add_api_route("/health", edge.health, methods=["GET"])
    app.add_api_route("/ready", edge.ready, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
