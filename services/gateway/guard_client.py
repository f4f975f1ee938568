"""GuardClient: the gateway's async client of the CacheGuard service (grpc.aio)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import auth, health
from services.common.limits import GRPC_CHANNEL_OPTIONS
from services.common.protos import cacheguard_pb2, cacheguard_pb2_grpc, engine_pb2
from services.gateway.errors import map_grpc_error

logger = logging.getLogger(__name__)


class GuardClient:
    """Calls CacheGuard; every gRPC failure comes out as a GatewayError (errors.map_grpc_error).

    Create it inside the event loop that will use it (grpc.aio channels belong to one loop).
    """

    def __init__(
        self,
        addr: str,
        *,
        request_timeout_s: float = 600.0,
        model_info_ttl_s: float = 5.0,
        secret: str | None = None,
    ) -> None:
        self.addr = addr
        self._request_timeout_s = request_timeout_s
        self._model_info_ttl_s = model_info_ttl_s
        self._channel = auth.aio_channel(addr, GRPC_CHANNEL_OPTIONS, secret)
        self._stub = cacheguard_pb2_grpc.CacheGuardStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._model_info: engine_pb2.GetModelInfoResponse | None = None
        self._model_info_at = 0.0
        self._model_info_lock = asyncio.Lock()

    async def generate(
        self, req: cacheguard_pb2.GuardGenerateRequest
    ) -> AsyncGenerator[cacheguard_pb2.GuardGenerateEvent, None]:
        """Stream the guard's events for one request. Closing or cancelling the iterator cancels
        the gRPC call, so the engine stops generating for a client that went away."""
        call = self._stub.Generate(req, timeout=self._request_timeout_s)
        ended = False  # a done or error event came: what is left of the call is its closing status
        try:
            async for event in call:
                ended = event.WhichOneof("event") != "chunk"
                yield event
        except grpc.aio.AioRpcError as exc:
            logger.warning("request %s: guard call failed: %s %s", req.request_id, exc.code().name, exc.details())
            raise map_grpc_error(exc.code(), exc.details()) from None
        finally:
            if not call.done():
                call.cancel()
                if not ended:
                    logger.info("request %s: guard call cancelled", req.request_id)

    async def count_tokens(self, req: cacheguard_pb2.CountTokensRequest) -> int:
        """Number of tokens the guard would send to the engine for this input."""
        try:
            resp = await self._stub.CountTokens(req, timeout=self._request_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise map_grpc_error(exc.code(), exc.details()) from None
        return int(resp.num_tokens)

    async def model_info(
        self, *, max_age_s: float | None = None, timeout_s: float = 5.0
    ) -> engine_pb2.GetModelInfoResponse:
        """The served model's info, reused for model_info_ttl_s (or max_age_s) seconds."""
        max_age = self._model_info_ttl_s if max_age_s is None else max_age_s
        async with self._model_info_lock:
            if self._model_info is not None and time.monotonic() - self._model_info_at <= max_age:
                return self._model_info
            try:
                info = await self._stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise map_grpc_error(exc.code(), exc.details()) from None
            self._model_info, self._model_info_at = info, time.monotonic()
            return info

    async def redis_up(self, timeout_s: float = 2.0) -> bool | None:
        """Whether the guard reaches redis (its `kvmem.redis` health); None when it does not say."""
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=health.REDIS), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None  # no health service, no redis configured (NOT_FOUND), or the guard is down
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    def cached_model_id(self) -> str | None:
        """The last known model id, without a call (None before the first GetModelInfo)."""
        return self._model_info.model_id if self._model_info is not None else None

    async def close(self) -> None:
        """Close the channel; in-flight calls are cancelled."""
        await self._channel.close()
