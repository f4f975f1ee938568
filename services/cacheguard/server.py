"""The CacheGuard gRPC servicer (grpc.aio): decode, call the core, forward to an engine, encode.

Generate: prepare (normalise + render + tokenize + prefix report) in a worker thread, route the
session to an engine replica (router.Router), relay its chunk/error events in order, and turn its
`done` into a GuardDone carrying the prefix report, the replica's address and the routing decision.
A replica that is unavailable before its first event is excluded and the request routed again (its
session moves). A client that cancels cancels the engine call.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import grpc

from services.cacheguard.affinity import Affinity, LocalAffinity, RedisAffinity
from services.cacheguard.config import CHANNEL_OPTIONS, CacheGuardConfig
from services.cacheguard.core import GuardCore, InvalidRequestError, Prepared, PromptRequest
from services.cacheguard.engine_client import (
    EngineCallError,
    EnginePool,
    EngineProtocolError,
    EngineUnavailableError,
)
from services.cacheguard.renderer import RenderError, chat_message, tool_call, tool_definition
from services.cacheguard.router import Route, Router
from services.cacheguard.sessions import PrefixReport
from services.common import auth, health
from services.common.limits import cut_details
from services.common.protos import cacheguard_pb2, cacheguard_pb2_grpc, engine_pb2
from services.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def grpc_status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    """The one mapping of the guard's typed errors to a gRPC status code and details."""
    if isinstance(exc, (RenderError, InvalidRequestError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineCallError):
        return exc.code, exc.details
    if isinstance(exc, EngineUnavailableError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, EngineProtocolError):
        return grpc.StatusCode.INTERNAL, str(exc)
    logger.error("unexpected error", exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error in the cache guard"


def decode_chat(chat: cacheguard_pb2.ChatInput) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Proto chat input -> (messages, tools) as the plain dicts templates read."""
    messages = [
        chat_message(
            m.role,
            m.content,
            name=m.name,
            tool_call_id=m.tool_call_id,
            reasoning_content=m.reasoning_content,
            tool_calls=[tool_call(c.id, c.name, c.arguments_json) for c in m.tool_calls],
        )
        for m in chat.messages
    ]
    tools = [tool_definition(t.name, t.description, t.parameters_json) for t in chat.tools]
    return messages, tools


def decode_request(
    request: cacheguard_pb2.GuardGenerateRequest | cacheguard_pb2.CountTokensRequest,
) -> PromptRequest:
    """A Generate or CountTokens request -> the core's PromptRequest."""
    kind = request.WhichOneof("input")
    session = {
        "session_id": request.session_id,
        "tenant": request.tenant,
        "normalizations_off": request.normalizations_off,
    }
    if kind == "chat":
        messages, tools = decode_chat(request.chat)
        return PromptRequest(messages=messages, tools=tools, **session)
    if kind == "prompt_text":
        return PromptRequest(prompt_text=request.prompt_text, **session)
    if kind == "prompt_tokens":
        return PromptRequest(prompt_token_ids=list(request.prompt_tokens.token_ids), **session)
    raise InvalidRequestError("request has no input (chat, prompt_text or prompt_tokens)")


def encode_report(report: PrefixReport) -> cacheguard_pb2.PrefixReport:
    return cacheguard_pb2.PrefixReport(**report._asdict())


def _log_request(request_id: str, prepared: Prepared, route: Route) -> None:
    r = prepared.report
    logger.info(
        "request %s session %s: %d prompt tokens, common prefix %d of %d%s%s -> %s (%s%s)",
        request_id, prepared.session_id, len(prepared.token_ids), r.common_prefix_tokens, r.previous_tokens,
        f", diverged ({r.divergence_field}): {r.divergence_reason}" if r.diverged else "",
        f", normalised: {','.join(r.normalizations)}" if r.normalizations else "",
        route.replica.addr, route.decision, f" from {route.moved_from}" if route.moved_from else "",
    )  # fmt: skip


class _RetryElsewhere(Exception):
    """The replica was unavailable before it produced anything: the request may go to another one.
    Carries what the client gets when no other replica is left: the engine's error event or call error."""

    def __init__(self, cause: engine_pb2.GenerateError | EngineCallError) -> None:
        super().__init__(cause.message if isinstance(cause, engine_pb2.GenerateError) else str(cause))
        self.cause = cause


class CacheGuardServicer(cacheguard_pb2_grpc.CacheGuardServicer):
    """Thin edge over GuardCore, Router and EnginePool."""

    def __init__(self, core: GuardCore, pool: EnginePool, router: Router) -> None:
        self._core = core
        self._pool = pool
        self._router = router

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: cacheguard_pb2.GuardGenerateRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        request_id = request.request_id or f"cg-{uuid.uuid4().hex}"
        try:
            prepared = await asyncio.to_thread(self._core.prepare, decode_request(request))
            engine_request = engine_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=prepared.token_ids,
                sampling=request.sampling,
                namespace=request.tenant,
                prefill_policy=request.prefill_policy,
                query_start=prepared.query_start,
                question_start=prepared.question[0] if prepared.question is not None else None,
                question_end=prepared.question[1] if prepared.question is not None else None,
                question_alone=prepared.question_alone,
            )
            tried: frozenset[str] = frozenset()
            retry: _RetryElsewhere | None = None
            while True:
                try:
                    route = await self._router.route(request.tenant, prepared.session_id, tried)
                except EngineUnavailableError:
                    if retry is None:
                        raise
                    if isinstance(retry.cause, EngineCallError):
                        raise retry.cause from None
                    yield cacheguard_pb2.GuardGenerateEvent(error=retry.cause)  # the last replica's own answer
                    return
                _log_request(request_id, prepared, route)
                try:
                    async for event in self._relay(route, engine_request, prepared.report, context.time_remaining()):
                        yield event
                    return
                except _RetryElsewhere as exc:
                    logger.warning("request %s: engine %s unavailable (%s); trying another replica",
                                   request_id, route.replica.addr, exc)  # fmt: skip
                    retry = exc
                    tried |= {route.replica.addr}
        except Exception as exc:
            code, details = grpc_status(exc)
            logger.info("request %s: %s %s", request_id, code.name, details)
            await context.abort(code, cut_details(details))

    async def _relay(
        self,
        route: Route,
        engine_request: engine_pb2.GenerateRequest,
        report: PrefixReport,
        timeout_s: float | None = None,
    ) -> AsyncIterator[cacheguard_pb2.GuardGenerateEvent]:
        """The engine's events as guard events; raises _RetryElsewhere when the replica was
        unavailable before its first event (nothing has reached the client yet)."""
        replica = route.replica
        finished = False
        started = False
        try:
            async with aclosing(self._pool.generate(replica, engine_request, timeout_s)) as events:
                async for event in events:
                    kind = event.WhichOneof("event")
                    if not started and kind == "error" and event.error.code == engine_pb2.ERROR_CODE_UNAVAILABLE:
                        raise _RetryElsewhere(event.error)
                    started = True
                    if finished:
                        logger.warning("request %s: engine %s sent %s after the end", engine_request.request_id,
                                       replica.addr, kind)  # fmt: skip
                    elif kind == "chunk":
                        yield cacheguard_pb2.GuardGenerateEvent(chunk=event.chunk)
                    elif kind == "error":
                        finished = True
                        yield cacheguard_pb2.GuardGenerateEvent(error=event.error)
                    elif kind == "done":
                        finished = True
                        done = cacheguard_pb2.GuardDone(
                            engine_done=event.done,
                            prefix=encode_report(report),
                            engine_replica=replica.addr,
                            routing=route.decision,
                            moved_from=route.moved_from,
                        )
                        yield cacheguard_pb2.GuardGenerateEvent(done=done)
        except EngineCallError as exc:
            if not started and exc.code == grpc.StatusCode.UNAVAILABLE:
                raise _RetryElsewhere(exc) from None
            raise
        if not finished:
            raise EngineProtocolError(
                f"engine {replica.addr} ended request {engine_request.request_id} without done or error"
            )

    async def CountTokens(  # noqa: N802 - gRPC method name
        self, request: cacheguard_pb2.CountTokensRequest, context: grpc.aio.ServicerContext
    ) -> cacheguard_pb2.CountTokensResponse:
        try:
            num_tokens = await asyncio.to_thread(self._core.count_tokens, decode_request(request))
            return cacheguard_pb2.CountTokensResponse(num_tokens=num_tokens)
        except Exception as exc:
            code, details = grpc_status(exc)
            await context.abort(code, cut_details(details))
            raise  # not reached: abort raises

    async def GetModelInfo(  # noqa: N802 - gRPC method name
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        try:
            _, info = await self._pool.model_info()
            out = engine_pb2.GetModelInfoResponse()
            out.CopyFrom(info)
            out.tool_call_format = self._core.renderer.tool_call_format  # the guard renders the template
            return out
        except Exception as exc:
            await context.abort(*grpc_status(exc))
            raise  # not reached: abort raises


class GuardServer:
    """The cache guard's gRPC server, engine pool and router; start and stop inside one event loop."""

    def __init__(self, config: CacheGuardConfig, tokenizer: Tokenizer) -> None:
        self.config = config
        template = Path(config.chat_template).read_text() if config.chat_template else None
        self.core = GuardCore(
            tokenizer, config.max_sessions, config.normalizations, chat_template=template, query_span=config.query_span
        )
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._pool: EnginePool | None = None
        self._affinity: Affinity | None = None
        self._redis_probe: health.RedisProbe | None = None

    @property
    def addr(self) -> str:
        """The address actually listened on (a port 0 in the config is resolved)."""
        host = self.config.listen_addr.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def start(self) -> None:
        """Bind and start serving; raises OSError when the address cannot be bound."""
        cfg = self.config
        self._pool = EnginePool(cfg.engine_addrs, cfg.engine_connect_timeout_s, cfg.internal_secret)
        self._pool.connect()
        if cfg.redis_url:
            self._affinity = RedisAffinity(cfg.redis_url, cfg.catalog_prefix, cfg.session_ttl_s)
        else:
            self._affinity = LocalAffinity(cfg.session_ttl_s)
        servicer = CacheGuardServicer(self.core, self._pool, Router(self._pool, self._affinity))
        self._server = grpc.aio.server(
            options=CHANNEL_OPTIONS, interceptors=auth.aio_server_interceptors(cfg.internal_secret)
        )
        cacheguard_pb2_grpc.add_CacheGuardServicer_to_server(servicer, self._server)
        health_servicer = await health.add_aio_health(self._server)
        if cfg.redis_url:  # kvmem.redis: SERVING while redis answers (the gateway's /health says degraded)
            setter = health.aio_redis_status_setter(health_servicer, asyncio.get_running_loop())
            self._redis_probe = health.RedisProbe(cfg.redis_url, setter)
        try:
            self.port = self._server.add_insecure_port(cfg.listen_addr)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            await self._close_clients()
            raise OSError(f"cannot listen on {cfg.listen_addr}")
        await self._server.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let running calls finish for grace_s, then cancel them; close engine channels."""
        if self._server is not None:
            await self._server.stop(grace_s)
        await self._close_clients()

    async def _close_clients(self) -> None:
        if self._redis_probe is not None:
            await asyncio.to_thread(self._redis_probe.close)
            self._redis_probe = None
        if self._pool is not None:
            await self._pool.close()
        if self._affinity is not None:
            await self._affinity.close()
