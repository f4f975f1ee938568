"""The gateway's edge: request ids, the request-body limit, and the health / readiness routes.

- RequestIdMiddleware gives every request an id (`req_<hex>`; a route may replace it with its response id,
  `chatcmpl-...`) in `scope["state"]["request_id"]`; every response carries it as `x-request-id` and every
  error body as `error.request_id`, and the logs name it, so a client's report finds the server's log lines.
- BodyLimitMiddleware answers 413 (an OpenAI error body naming the limit) to a body over `max_body_bytes`,
  from Content-Length before reading, or while reading a chunked body; the app never sees the rest.
- `health`: 200 `{"status": "ok"}` when the cache guard answers; 200 `{"status": "degraded", "degraded":
  ["redis"]}` while redis is gone (requests are served, affinity and the catalog wait); 503 otherwise.
  `ready`: 200 only when a request can be served now (the guard answers GetModelInfo, so an engine does).
"""

from __future__ import annotations

import json
import logging
import re
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def request_id_of(request: Request) -> str:
    """The request's id (set by RequestIdMiddleware; a fresh one outside it)."""
    state = request.scope.setdefault("state", {})
    return str(state.setdefault("request_id", new_request_id()))


def set_request_id(request: Request, request_id: str) -> None:
    """Name the request by its response id from now on (its header, error bodies and logs)."""
    request.scope.setdefault("state", {})["request_id"] = request_id


class RequestIdMiddleware:
    """Adds `x-request-id` to every HTTP response (the route's own when it set one)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state.setdefault("request_id", new_request_id())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == REQUEST_ID_HEADER for k, _ in headers):
                    headers.append((REQUEST_ID_HEADER, str(state["request_id"]).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


def body_too_large(size: int | None, limit: int, request_id: str) -> GatewayError:
    """The 413 of a body over the limit (size None: a chunked body that passed it while being read)."""
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    err = GatewayError(
        413,
        "invalid_request_error",
        f"The request body is {got}; the limit is {limit} bytes (KVMEM_GATEWAY_MAX_BODY_BYTES).",
        None,
        "request_too_large",
    )
    err.request_id = request_id
    return err


class BodyLimitMiddleware:
    """Refuses request bodies over `max_body_bytes` with a 413 OpenAI error, before the route reads them."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = str(scope.setdefault("state", {}).setdefault("request_id", new_request_id()))
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            await _send_error(send, body_too_large(int(length), self.limit, request_id))
            return
        received = 0
        refused = False

        async def limited_receive() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    refused = True
                    raise _BodyTooLarge()
            return message

        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused and not started:
                return  # the app's answer to a body cut short (FastAPI makes it a 400): the 413 replaces it
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if not refused or started:
                raise
        if refused and not started:
            logger.info("request %s: body over %d bytes refused", request_id, self.limit)
            await _send_error(send, body_too_large(None, self.limit, request_id))


class _BodyTooLarge(Exception):
    pass


async def _send_error(send: Send, err: GatewayError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers().items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def health(request: Request) -> JSONResponse:
    """GET /health: ok, degraded (redis gone; still serving) or 503 unavailable (the guard does not answer)."""
    config: GatewayConfig = request.app.state.config
    guard = request.app.state.guard
    if guard is None:
        return JSONResponse({"status": "unavailable", "reason": "the gateway is starting"}, status_code=503)
    try:
        await guard.model_info(max_age_s=0, timeout_s=config.health_timeout_s)
    except GatewayError as err:
        return JSONResponse({"status": "unavailable", "reason": err.message}, status_code=503)
    if await guard.redis_up(timeout_s=config.health_timeout_s) is False:
        return JSONResponse({"status": "degraded", "degraded": ["redis"]})
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> JSONResponse:
    """GET /ready: 200 when a request can be served now (the guard and an engine answer), else 503."""
    config: GatewayConfig = request.app.state.config
    guard = request.app.state.guard
    if guard is None:
        return JSONResponse({"ready": False, "reason": "the gateway is starting"}, status_code=503)
    try:
        await guard.model_info(max_age_s=0, timeout_s=config.health_timeout_s)
    except GatewayError as err:
        return JSONResponse({"ready": False, "reason": err.message}, status_code=503)
    return JSONResponse({"ready": True})
