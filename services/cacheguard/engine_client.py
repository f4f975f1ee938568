"""EnginePool: the engine replicas the guard forwards to (grpc.aio).

For now a request goes to the first replica (in configured order) whose channel is READY; session
affinity comes later. Engine gRPC status errors come out as EngineCallError with the engine's own
code and details, so the server can pass them through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import grpc

from services.cacheguard.config import CHANNEL_OPTIONS
from services.common.protos import engine_pb2, engine_pb2_grpc

logger = logging.getLogger(__name__)


class EngineUnavailableError(RuntimeError):
    """No engine replica became reachable within the connect timeout (UNAVAILABLE)."""


class EngineCallError(RuntimeError):
    """An engine RPC ended with a gRPC status; passed through with the same code and details."""

    def __init__(self, replica: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"engine {replica}: {code.name}: {details}")
        self.replica = replica
        self.code = code
        self.details = details


class EngineProtocolError(RuntimeError):
    """The engine broke the stream contract (e.g. ended without `done` or `error`) (INTERNAL)."""


class Replica(NamedTuple):
    """One engine replica: its address (the name reported to clients) and its stub."""

    addr: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub


class EnginePool:
    """Channels to every engine replica; create it inside the event loop that uses it."""

    def __init__(self, addrs: Sequence[str], connect_timeout_s: float) -> None:
        assert addrs, "at least one engine address"
        self.connect_timeout_s = connect_timeout_s
        self.replicas: tuple[Replica, ...] = tuple(
            Replica(addr, channel, engine_pb2_grpc.EngineStub(channel))
            for addr, channel in ((a, grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS)) for a in addrs)
        )

    async def pick(self) -> Replica:
        """The first READY replica in configured order, waiting up to connect_timeout_s for one."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            states = [r.channel.get_state(try_to_connect=True) for r in self.replicas]
            for replica, state in zip(self.replicas, states, strict=True):
                if state == grpc.ChannelConnectivity.READY:
                    return replica
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(f"{r.addr} ({s.name})" for r, s in zip(self.replicas, states, strict=True))
                raise EngineUnavailableError(f"no engine replica ready after {self.connect_timeout_s:g} s: {names}")
            await _any_state_change(self.replicas, states, remaining)

    async def generate(
        self, replica: Replica, request: engine_pb2.GenerateRequest
    ) -> AsyncIterator[engine_pb2.GenerateEvent]:
        """The engine's event stream; closing or cancelling the iterator cancels the engine call."""
        call = replica.stub.Generate(request)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            raise EngineCallError(replica.addr, exc.code(), exc.details() or "") from None
        finally:
            if not call.done():
                call.cancel()
                logger.info("request %s: engine call on %s cancelled", request.request_id, replica.addr)

    async def model_info(self) -> tuple[Replica, engine_pb2.GetModelInfoResponse]:
        """GetModelInfo of the replica `pick` chooses."""
        replica = await self.pick()
        try:
            info = await replica.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=self.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise EngineCallError(replica.addr, exc.code(), exc.details() or "") from None
        return replica, info

    async def close(self) -> None:
        """Close every channel (in-flight calls are cancelled)."""
        await asyncio.gather(*(r.channel.close() for r in self.replicas))


async def _any_state_change(
    replicas: Sequence[Replica], states: Sequence[grpc.ChannelConnectivity], timeout_s: float
) -> None:
    waits = [asyncio.ensure_future(r.channel.wait_for_state_change(s)) for r, s in zip(replicas, states, strict=True)]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
