"""The gateway's edge: request ids, the body limit (413), /ready, /health, and limits that are 400/413, never 429."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

from services.gateway.config import GatewayConfig
from services.gateway.errors import map_grpc_error
from tests.gateway.fake_guard import FakeGuard, FakeGuardServer, chat_body, client_for

pytestmark = pytest.mark.anyio
LIMIT = 4096


@pytest.fixture
async def small_client(
    fake: FakeGuard, fake_guard_server: FakeGuardServer, one_event_loop: None
) -> AsyncIterator[httpx.AsyncClient]:
    async for c in client_for(GatewayConfig(cacheguard_addr=fake_guard_server.addr, max_body_bytes=LIMIT)):
        yield c


async def test_body_over_the_limit_is_a_413_by_content_length(small_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    data = json.dumps(chat_body("x" * (LIMIT + 10))).encode()
    r = await small_client.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
    assert r.status_code == 413
    err = r.json()["error"]
    size = len(data)
    assert err == {
        "message": f"The request body is {size} bytes; the limit is {LIMIT} bytes (KVMEM_GATEWAY_MAX_BODY_BYTES).",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
        "request_id": r.headers["x-request-id"],
    }
    assert "retry-after" not in r.headers
    assert fake.requests == []


async def test_chunked_body_over_the_limit_is_a_413(small_client: httpx.AsyncClient, fake: FakeGuard) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 1000 + 1):
            yield b"x" * 1000
        yield b'"}]}'

    r = await small_client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["message"] == (
        f"The request body is more than {LIMIT} bytes; the limit is {LIMIT} bytes (KVMEM_GATEWAY_MAX_BODY_BYTES)."
    )
    assert fake.requests == []


async def test_body_under_the_limit_passes(small_client: httpx.AsyncClient) -> None:
    r = await small_client.post("/v1/chat/completions", json=chat_body("hi"))
    assert r.status_code == 200
    assert r.headers["x-request-id"] == r.json()["id"]


async def test_every_response_has_a_request_id(client: httpx.AsyncClient) -> None:
    for path in ("/health", "/ready", "/v1/models", "/nowhere"):
        r = await client.get(path)
        assert r.headers["x-request-id"].startswith("req_"), path
    r = await client.get("/nowhere")
    assert r.status_code == 404 and r.json()["error"]["request_id"] == r.headers["x-request-id"]


async def test_ready_and_health_up(client: httpx.AsyncClient) -> None:
    r = await client.get("/ready")
    assert (r.status_code, r.json()) == (200, {"ready": True})
    assert (await client.get("/health")).json() == {"status": "ok"}  # the fake guard has no health service


async def test_ready_503_when_the_guard_is_down(free_tcp_port: int) -> None:
    async for c in client_for(GatewayConfig(cacheguard_addr=f"127.0.0.1:{free_tcp_port}", health_timeout_s=1)):
        r = await c.get("/ready")
        assert r.status_code == 503 and r.json()["ready"] is False
        assert "127.0.0.1" not in r.text


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["x" * 1024] * 17, "at most 16 stop strings, got 17"),
        (["y" * 1025], "a stop string may be at most 1024 bytes, got one of 1025"),
    ],
)
async def test_stop_list_over_its_limits_is_a_400(
    client: httpx.AsyncClient, fake: FakeGuard, stop: list[str], message: str
) -> None:
    r = await client.post("/v1/chat/completions", json=chat_body("hi", stop=stop))
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stop" and message in r.json()["error"]["message"]
    assert fake.requests == []


def test_message_over_the_grpc_limit_is_a_413_not_a_429() -> None:
    err = map_grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (300 vs. 200)")
    assert (err.status, err.code, err.retryable) == (413, "request_too_large", False)
    assert "300" not in err.message
    overloaded = map_grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
    assert (overloaded.status, overloaded.headers()) == (429, {"Retry-After": "1"})


def test_long_details_are_cut_and_5xx_details_hidden() -> None:
    err = map_grpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad " * 1000)
    assert err.status == 400 and len(err.message) == 1024
    down = map_grpc_error(grpc.StatusCode.UNAVAILABLE, "connect to 10.0.0.7:50052 failed: Socket closed")
    assert down.status == 503 and "10.0.0.7" not in down.message and down.headers() == {"Retry-After": "1"}
