"""Fixtures of the gateway app tests: the fake CacheGuard (fake_guard.py) and gateway clients on it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig, parse_api_keys
from tests.gateway.fake_guard import KEYS, FakeGuard, FakeGuardServer, client_for, serve_in_thread


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # grpc.aio needs asyncio


@pytest.fixture(scope="module")
async def one_event_loop() -> AsyncIterator[None]:
    """Held by every fixture that makes a grpc.aio guard client: AnyIO keeps one test runner, so one event
    loop, for the module's async tests. With a loop per test, grpc.aio's poller thread could hand a late
    completion of the last test's guard calls to that test's closed loop, failing the next test's set-up
    with "Event loop is closed" (seen under CPU load)."""
    yield


@pytest.fixture(scope="module")
def fake_guard_server() -> Iterator[FakeGuardServer]:
    server = FakeGuardServer()
    yield server
    server.stop()


@pytest.fixture
def fake(fake_guard_server: FakeGuardServer) -> FakeGuard:
    fake_guard_server.servicer.requests.clear()
    fake_guard_server.servicer.cancelled.clear()
    return fake_guard_server.servicer


@pytest.fixture
async def client(
    fake: FakeGuard, fake_guard_server: FakeGuardServer, one_event_loop: None
) -> AsyncIterator[httpx.AsyncClient]:
    async for c in client_for(GatewayConfig(cacheguard_addr=fake_guard_server.addr)):
        yield c


@pytest.fixture
async def auth_client(
    fake: FakeGuard, fake_guard_server: FakeGuardServer, one_event_loop: None
) -> AsyncIterator[httpx.AsyncClient]:
    config = GatewayConfig(cacheguard_addr=fake_guard_server.addr, api_keys=parse_api_keys(KEYS))
    async for c in client_for(config):
        yield c


@pytest.fixture
def server_url(fake: FakeGuard, fake_guard_server: FakeGuardServer) -> Iterator[str]:
    config = GatewayConfig(cacheguard_addr=fake_guard_server.addr, api_keys=parse_api_keys(KEYS))
    with serve_in_thread(create_app(config)) as url:  # the guard client is made by the lifespan
        yield url
