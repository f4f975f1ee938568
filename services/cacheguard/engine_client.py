"""EnginePool: the engine replicas the guard forwards to (grpc.aio).

The pool knows each replica's channel and asks for health (`ready`: the channel is or becomes
READY) and load (`load`: Engine.GetStats running + waiting sequences); router.Router decides which
replica serves a session. Engine gRPC status errors come out as EngineCallError with the engine's
own code and details, so the server can pass them through unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from typing import NamedTuple

import grpc

from services.cacheguard.config import CHANNEL_OPTIONS
from services.common import auth
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

    def __init__(self, addrs: Sequence[str], connect_timeout_s: float, secret: str | None = None) -> None:
        assert addrs, "at least one engine address"
        self.connect_timeout_s = connect_timeout_s
        self.replicas: tuple[Replica, ...] = tuple(
            Replica(addr, channel, engine_pb2_grpc.EngineStub(channel))
            for addr, channel in ((a, auth.aio_channel(a, CHANNEL_OPTIONS, secret)) for a in addrs)
        )

    def connect(self) -> None:
        """Start connecting every channel now (so the first requests see every live replica READY)."""
        for replica in self.replicas:
            replica.channel.get_state(try_to_connect=True)

    async def pick(self) -> Replica:
        """The first READY replica in configured order, waiting up to connect_timeout_s for one."""
        return (await self.ready_replicas())[0]

    async def ready_replicas(self, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        """The READY replicas (configured order) not in `exclude`, waiting up to connect_timeout_s
        for at least one; raises EngineUnavailableError when none becomes READY."""
        candidates = [r for r in self.replicas if r.addr not in exclude]
        if not candidates:
            raise EngineUnavailableError(f"no engine replica left to try (tried {', '.join(sorted(exclude))})")
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            states = [r.channel.get_state(try_to_connect=True) for r in candidates]
            ready = [r for r, s in zip(candidates, states, strict=True) if s == grpc.ChannelConnectivity.READY]
            if ready:
                return ready
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                names = ", ".join(f"{r.addr} ({s.name})" for r, s in zip(candidates, states, strict=True))
                raise EngineUnavailableError(f"no engine replica ready after {self.connect_timeout_s:g} s: {names}")
            await _any_state_change(candidates, states, remaining)

    def by_addr(self, addr: str) -> Replica | None:
        """The replica with this address, or None when it is not configured."""
        return next((r for r in self.replicas if r.addr == addr), None)

    async def ready(self, replica: Replica, timeout_s: float | None = None) -> bool:
        """True when the replica's channel is READY or becomes READY within timeout_s (default: the
        connect timeout). False at once when connecting failed (TRANSIENT_FAILURE: gRPC keeps
        reconnecting in the background with backoff, and the replica is READY again when it is back)."""
        deadline = time.monotonic() + (self.connect_timeout_s if timeout_s is None else timeout_s)
        while True:
            state = replica.channel.get_state(try_to_connect=True)
            if state == grpc.ChannelConnectivity.READY:
                return True
            if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
                return False
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(replica.channel.wait_for_state_change(state), remaining)
            except asyncio.TimeoutError:
                return False

    async def load(self, replica: Replica, timeout_s: float = 2.0) -> int | None:
        """Running + waiting sequences of the replica (Engine.GetStats); None when it cannot answer.
        An engine without GetStats (UNIMPLEMENTED) counts as idle."""
        try:
            stats = await replica.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return 0
            logger.info("engine %s: GetStats failed: %s %s", replica.addr, exc.code().name, exc.details())
            return None
        return int(stats.running_sequences + stats.waiting_sequences)

    async def generate(
        self, replica: Replica, request: engine_pb2.GenerateRequest, timeout_s: float | None = None
    ) -> AsyncGenerator[engine_pb2.GenerateEvent, None]:
        """The engine's event stream; closing or cancelling the iterator cancels the engine call.
        `timeout_s`: the caller's remaining deadline (the gateway's per-request deadline goes on)."""
        call = replica.stub.Generate(request, timeout=timeout_s)
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
