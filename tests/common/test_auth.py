"""The shared-secret interceptors on real in-process gRPC servers (sync and grpc.aio), and the health probe."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from services.common import auth, health
from services.common.protos import engine_pb2, engine_pb2_grpc

SECRET = "s3cret-for-tests"


class _Engine(engine_pb2_grpc.EngineServicer):
    def GetModelInfo(self, request, context):  # noqa: N802, ANN001, ANN201
        return engine_pb2.GetModelInfoResponse(model_id="m")

    def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
        yield engine_pb2.GenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=[1], text="a"))


@pytest.fixture
def sync_server() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=auth.server_interceptors(SECRET))
    engine_pb2_grpc.add_EngineServicer_to_server(_Engine(), server)
    health.add_health(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _codes(addr: str, secret: str) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    with auth.channel(addr, secret=secret) as ch:
        stub = engine_pb2_grpc.EngineStub(ch)
        try:
            stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
            unary = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            unary = exc.code()
        try:
            list(stub.Generate(engine_pb2.GenerateRequest(), timeout=5))
            stream = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            stream = exc.code()
    return unary, stream


def test_sync_server_refuses_calls_without_the_secret(sync_server: str) -> None:
    assert _codes(sync_server, "") == (grpc.StatusCode.UNAUTHENTICATED,) * 2
    assert _codes(sync_server, "wrong") == (grpc.StatusCode.UNAUTHENTICATED,) * 2
    assert _codes(sync_server, SECRET) == (grpc.StatusCode.OK,) * 2
    assert health.check(sync_server) == "SERVING"  # exempt
    assert health.main([sync_server]) == 0


def test_aio_server_and_aio_channel() -> None:
    class AioEngine(engine_pb2_grpc.EngineServicer):
        async def GetModelInfo(self, request, context):  # noqa: N802, ANN001, ANN201
            return engine_pb2.GetModelInfoResponse(model_id="m")

        async def Generate(self, request, context):  # noqa: N802, ANN001, ANN201
            yield engine_pb2.GenerateEvent(chunk=engine_pb2.TokenChunk(token_ids=[1], text="a"))

    async def scenario() -> list[str]:
        server = grpc.aio.server(interceptors=auth.aio_server_interceptors(SECRET))
        engine_pb2_grpc.add_EngineServicer_to_server(AioEngine(), server)
        servicer = await health.add_aio_health(server)
        await servicer.set(health.REDIS, health.NOT_SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        addr = f"127.0.0.1:{port}"
        out = []
        for secret in ("", "wrong", SECRET):
            async with auth.aio_channel(addr, secret=secret) as ch:
                stub = engine_pb2_grpc.EngineStub(ch)
                try:
                    await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=5)
                    events = [e async for e in stub.Generate(engine_pb2.GenerateRequest(), timeout=5)]
                    out.append(f"ok {len(events)}")
                except grpc.aio.AioRpcError as exc:
                    out.append(exc.code().name)
        out.append(await asyncio.to_thread(health.check, addr, health.REDIS))
        await server.stop(None)
        return out

    assert asyncio.run(scenario()) == ["UNAUTHENTICATED", "UNAUTHENTICATED", "ok 1", "NOT_SERVING"]


def test_no_secret_means_no_check(caplog: pytest.LogCaptureFixture) -> None:
    assert auth.server_interceptors("") == []
    assert "not authenticated" in caplog.text


def test_client_secret_falls_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "_process_secret", None)
    monkeypatch.setenv(auth.SECRET_ENV, "from-env")
    assert auth.client_secret() == "from-env"
    auth.configure("configured")
    assert auth.client_secret() == "configured"
    monkeypatch.setattr(auth, "_process_secret", None)
