"""The session -> replica table: in a real redis (shared by several guards) and in-process."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
import redis

from services.cacheguard.affinity import Affinity, LocalAffinity, RedisAffinity, session_digest
from tests.conftest import free_port

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def prefix() -> str:
    return f"kvmem-test-{uuid.uuid4().hex[:8]}:"


async def exercise(table: Affinity) -> None:
    """The contract both tables keep."""
    assert await table.get("t", "s") is None
    assert await table.claim("t", "s", "engine-a") == "engine-a"
    assert await table.claim("t", "s", "engine-b") == "engine-a"  # the first claim wins
    assert await table.get("t", "s") == "engine-a"
    assert await table.get("u", "s") is None  # scoped by tenant
    assert await table.move("t", "s", "engine-a", "engine-b") == "engine-b"
    assert await table.move("t", "s", "engine-a", "engine-c") == "engine-b"  # someone moved it first
    assert await table.get("t", "s") == "engine-b"
    assert await table.move("t", "new", "engine-x", "engine-c") == "engine-c"  # unknown: recorded


def test_local_table_contract_ttl_and_bound() -> None:
    run(exercise(LocalAffinity()))

    async def expiry_and_bound() -> None:
        short = LocalAffinity(ttl_s=0.05, max_sessions=2)
        await short.claim("t", "a", "e0")
        await asyncio.sleep(0.1)
        assert await short.get("t", "a") is None
        for name in ("a", "b", "c"):
            await short.claim("t", name, "e0")
        assert await short.get("t", "a") is None and await short.get("t", "c") == "e0"

    run(expiry_and_bound())


def test_redis_table_contract_key_and_ttl(redis_url: str) -> None:
    p = prefix()

    async def go() -> None:
        table = RedisAffinity(redis_url, p, ttl_s=30)
        try:
            await exercise(table)
        finally:
            await table.close()

    run(go())
    raw = redis.Redis.from_url(redis_url)
    key = f"{p}guard:session:{session_digest('t', 's')}"
    assert raw.get(key) == b"engine-b"
    assert 25_000 < raw.pttl(key) <= 30_000


def test_redis_ttl_expires_an_idle_session_and_get_refreshes_it(redis_url: str) -> None:
    p = prefix()

    async def go() -> None:
        table = RedisAffinity(redis_url, p, ttl_s=0.4)
        try:
            await table.claim("t", "idle", "e0")
            await table.claim("t", "busy", "e0")
            for _ in range(4):
                await asyncio.sleep(0.2)
                assert await table.get("t", "busy") == "e0"  # each request restarts the idle timer
            assert await table.get("t", "idle") is None
        finally:
            await table.close()

    run(go())


def test_two_guards_agree_through_redis(redis_url: str) -> None:
    p = prefix()

    async def go() -> None:
        one, two = RedisAffinity(redis_url, p), RedisAffinity(redis_url, p)
        try:
            # Both see a new session and claim different replicas: the first claim is what both use.
            claims = await asyncio.gather(one.claim("t", "s", "engine-a"), two.claim("t", "s", "engine-b"))
            assert claims[0] == claims[1]
            # Both see its replica die and move it: one move wins, the other follows it.
            winner = claims[0]
            moves = await asyncio.gather(one.move("t", "s", winner, "engine-c"), two.move("t", "s", winner, "engine-d"))
            assert moves[0] == moves[1] != winner
            assert await one.get("t", "s") == await two.get("t", "s") == moves[0]
        finally:
            await one.close()
            await two.close()

    run(go())


def test_redis_down_routes_without_affinity() -> None:
    async def go() -> None:
        table = RedisAffinity(f"redis://127.0.0.1:{free_port()}/0", prefix())
        try:
            started = time.monotonic()
            assert await table.get("t", "s") is None
            assert await table.claim("t", "s", "engine-a") == "engine-a"
            assert await table.move("t", "s", "engine-a", "engine-b") == "engine-b"
            assert time.monotonic() - started < 5
            assert table.num_errors == 3
        finally:
            await table.close()

    run(go())


@pytest.mark.parametrize(("tenant", "session"), [("a", "bc"), ("ab", "c")])
def test_digest_keeps_tenant_and_session_apart(tenant: str, session: str) -> None:
    assert session_digest(tenant, session) != session_digest("abc", "")
    assert len(session_digest(tenant, session)) == 32


def test_redis_affinity_is_rebuilt_from_the_mirror_after_redis_lost_it(redis_url: str) -> None:
    async def scenario() -> None:
        table = RedisAffinity(redis_url, prefix(), ttl_s=60)
        raw = redis.Redis.from_url(redis_url)
        assert await table.claim("t", "s", "engine-a") == "engine-a"
        raw.delete(table.key("t", "s"))  # redis restarted: the entry is gone
        assert await table.get("t", "s") == "engine-a"  # from the mirror, written back
        assert raw.get(table.key("t", "s")) == b"engine-a" and table.num_rebuilt == 1
        await table.close()

    run(scenario())


def test_redis_affinity_routes_from_the_mirror_while_redis_is_down() -> None:
    async def scenario() -> None:
        table = RedisAffinity(f"redis://127.0.0.1:{free_port()}/0", prefix(), ttl_s=60)  # nothing listens
        assert await table.claim("t", "s", "engine-a") == "engine-a"
        assert await table.get("t", "s") == "engine-a"
        assert await table.move("t", "s", "engine-a", "engine-b") == "engine-b"
        assert await table.get("t", "s") == "engine-b"
        assert table.num_errors == 4
        await table.close()

    run(scenario())
