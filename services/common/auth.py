"""Internal traffic authentication: a shared secret on every gRPC call between the services.

The launcher generates one secret per launch (compose reads it from an env file) and hands it to every
service as KVMEM_INTERNAL_SECRET. Servers check it with a server interceptor (sync or grpc.aio); clients
send it as call metadata through a channel interceptor, so no call site carries it by hand. An empty
secret turns the check off (tests and embedded use; logged once at start-up by each service).
The gRPC health service (grpc.health.v1.Health) is exempt: probes need no secret and it reveals nothing.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

logger = logging.getLogger(__name__)

SECRET_ENV = "KVMEM_INTERNAL_SECRET"
METADATA_KEY = "x-kvmem-secret"
HEALTH_PREFIX = "/grpc.health.v1.Health/"
UNAUTHENTICATED_DETAILS = "missing or wrong internal secret"

_process_secret: str | None = None


def new_secret() -> str:
    """A fresh random secret (what the launcher generates per launch)."""
    return secrets.token_urlsafe(32)


def secret_from_env() -> str:
    """KVMEM_INTERNAL_SECRET, for a service config's from_args."""
    return os.environ.get(SECRET_ENV, "").strip()


def configure(secret: str) -> None:
    """Set the secret this process sends on its outgoing calls (a service's entry point, from its config)."""
    global _process_secret
    _process_secret = secret


def client_secret() -> str:
    """The secret outgoing calls carry: the configured one, else KVMEM_INTERNAL_SECRET (in-process clients)."""
    return _process_secret if _process_secret is not None else secret_from_env()


def _authorized(metadata: Sequence[tuple[str, str | bytes]] | None, secret: str) -> bool:
    given = next((v for k, v in metadata or () if k == METADATA_KEY), None)
    if given is None:
        return False
    given_bytes = given if isinstance(given, bytes) else given.encode()
    return hmac.compare_digest(given_bytes, secret.encode())


# ---------------------------------------------------------------- servers


def _deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED (sync servers)."""

    def deny(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny)
    return grpc.unary_unary_rpc_method_handler(deny)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the shared secret, except health checks."""

    def __init__(self, secret: str) -> None:
        assert secret, "AuthInterceptor needs a secret"
        self._secret = secret

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if _authorized(handler_call_details.invocation_metadata, self._secret):
            return handler
        logger.warning("refused %s: %s", handler_call_details.method, UNAUTHENTICATED_DETAILS)
        return _deny_handler(handler)


def _aio_deny_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
        yield  # not reached: an async generator, as a streaming handler must be

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream)
    return grpc.unary_unary_rpc_method_handler(deny)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):
    """AuthInterceptor for grpc.aio servers."""

    def __init__(self, secret: str) -> None:
        assert secret, "AioAuthInterceptor needs a secret"
        self._secret = secret

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if _authorized(handler_call_details.invocation_metadata, self._secret):
            return handler
        logger.warning("refused %s: %s", handler_call_details.method, UNAUTHENTICATED_DETAILS)
        return _aio_deny_handler(handler)


def server_interceptors(secret: str) -> list[grpc.ServerInterceptor]:
    """The interceptors of a sync gRPC server ([] when the secret is empty: auth off)."""
    if not secret:
        logger.warning("no %s: internal gRPC calls are not authenticated", SECRET_ENV)
        return []
    return [AuthInterceptor(secret)]


def aio_server_interceptors(secret: str) -> list[grpc.aio.ServerInterceptor]:
    """The interceptors of a grpc.aio server ([] when the secret is empty: auth off)."""
    if not secret:
        logger.warning("no %s: internal gRPC calls are not authenticated", SECRET_ENV)
        return []
    return [AioAuthInterceptor(secret)]


# ---------------------------------------------------------------- clients


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = details.method
        self.timeout = details.timeout
        self.metadata = metadata
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)


def _with_secret(metadata: Sequence[tuple[str, str | bytes]] | None, secret: str) -> list[tuple[str, str | bytes]]:
    return [*(metadata or ()), (METADATA_KEY, secret)]


class _ClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the secret to the metadata of every call of a sync channel."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, _with_secret(details.metadata, self._secret))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def channel(addr: str, options: Sequence[tuple[str, Any]] = (), secret: str | None = None) -> grpc.Channel:
    """A sync channel to an internal service whose calls carry the secret (client_secret() by default)."""
    raw = grpc.insecure_channel(addr, options=list(options))
    key = client_secret() if secret is None else secret
    return grpc.intercept_channel(raw, _ClientInterceptor(key)) if key else raw


def _aio_details(details: grpc.aio.ClientCallDetails, secret: str) -> grpc.aio.ClientCallDetails:
    return grpc.aio.ClientCallDetails(
        details.method,
        details.timeout,
        grpc.aio.Metadata(*_with_secret(tuple(details.metadata or ()), secret)),
        details.credentials,
        details.wait_for_ready,
    )


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_aio_details(client_call_details, self._secret), request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_aio_details(client_call_details, self._secret), request)


def aio_channel(addr: str, options: Sequence[tuple[str, Any]] = (), secret: str | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to an internal service whose unary and server-streaming calls carry the secret."""
    key = client_secret() if secret is None else secret
    interceptors = [_AioUnaryUnary(key), _AioUnaryStream(key)] if key else None
    return grpc.aio.insecure_channel(addr, options=list(options), interceptors=interceptors)
