"""Session affinity: which engine replica holds a session's prefix (redis, shared by every guard).

Key (prefix "kvmem:" by default, as the kvstore catalog):
  {prefix}guard:session:{digest}   string  the engine replica address; expires after ttl_s idle
digest = sha256 of the tenant and the session id (length-prefixed), 32 hex characters.

Several guard processes agree through redis: a new session is claimed with SET NX (the first claim
wins, the others follow it) and a move is a compare-and-set from the replica the mover saw (a
concurrent move by another guard wins and is followed). Redis is the source of truth when it
answers; every guard also keeps what it read and wrote in a local mirror (LocalAffinity, same TTL):
while redis is gone, routing goes on from the mirror (logged and counted; a session this guard has not
seen goes to the least-loaded replica: a re-prefill, never a wrong answer), and when redis is back
empty (restarted) the mirror's entries are written back as sessions come (SET NX: the affinity is rebuilt).
Without a redis URL (tests, a single guard) LocalAffinity keeps the same table in this process.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff

logger = logging.getLogger(__name__)

_MOVE_SCRIPT = """
-- KEYS[1]: the session key. ARGV[1]: the replica the mover saw (or ""), ARGV[2]: the new one, ARGV[3]: ttl ms.
local current = redis.call('GET', KEYS[1])
if current == false or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return current
"""
_LOCAL_MAX_SESSIONS = 100_000


def session_digest(tenant: str, session_id: str) -> str:
    """32 hex characters identifying (tenant, session_id)."""
    h = hashlib.sha256()
    for part in (tenant, session_id):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:32]


class Affinity:
    """The session -> replica table: the interface RedisAffinity and LocalAffinity implement."""

    num_errors = 0

    async def get(self, tenant: str, session_id: str) -> str | None:
        """The session's replica (its idle timer restarts), or None when unknown."""
        raise NotImplementedError

    async def claim(self, tenant: str, session_id: str, replica: str) -> str:
        """Record `replica` for a session that has none; returns the session's replica after the call."""
        raise NotImplementedError

    async def move(self, tenant: str, session_id: str, seen: str, replica: str) -> str:
        """Replace `seen` by `replica` unless another guard moved it first; returns the replica after the call."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release connections."""


class RedisAffinity(Affinity):
    """The table in redis (grpc.aio and redis.asyncio share the guard's event loop)."""

    def __init__(self, redis_url: str, prefix: str = "kvmem:", ttl_s: float = 3600.0) -> None:
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.num_errors = 0
        # One retry on a fresh connection: after a redis restart every pooled connection is dead once.
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            retry=AsyncRetry(NoBackoff(), 1),
            retry_on_error=[redis.ConnectionError],
        )
        self._move = self._redis.register_script(_MOVE_SCRIPT)
        self.mirror = LocalAffinity(ttl_s)
        self.num_rebuilt = 0

    def key(self, tenant: str, session_id: str) -> str:
        return f"{self.prefix}guard:session:{session_digest(tenant, session_id)}"

    async def get(self, tenant: str, session_id: str) -> str | None:
        key = self.key(tenant, session_id)
        try:
            value = await self._redis.getex(key, px=self.ttl_ms)
            if value is None:
                known = await self.mirror.get(tenant, session_id)
                if known is not None and await self._redis.set(key, known, nx=True, px=self.ttl_ms):
                    self.num_rebuilt += 1  # redis lost it (restarted): written back from the mirror
                    return known
                value = await self._redis.getex(key, px=self.ttl_ms) if known is not None else None
        except redis.RedisError as exc:
            self._failed("get", exc)
            return await self.mirror.get(tenant, session_id)
        if value is None:
            return None
        self.mirror._put(session_digest(tenant, session_id), _text(value))
        return _text(value)

    async def claim(self, tenant: str, session_id: str, replica: str) -> str:
        key = self.key(tenant, session_id)
        try:
            if await self._redis.set(key, replica, nx=True, px=self.ttl_ms):
                value: bytes | str | None = replica
            else:
                value = await self._redis.getex(key, px=self.ttl_ms)
        except redis.RedisError as exc:
            self._failed("claim", exc)
            return await self.mirror.claim(tenant, session_id, replica)
        chosen = _text(value) if value is not None else replica
        self.mirror._put(session_digest(tenant, session_id), chosen)
        return chosen

    async def move(self, tenant: str, session_id: str, seen: str, replica: str) -> str:
        try:
            value = await self._move(keys=[self.key(tenant, session_id)], args=[seen, replica, self.ttl_ms])
        except redis.RedisError as exc:
            self._failed("move", exc)
            return await self.mirror.move(tenant, session_id, seen, replica)
        chosen = _text(value)
        self.mirror._put(session_digest(tenant, session_id), chosen)
        return chosen

    async def close(self) -> None:
        await self._redis.aclose()

    def _failed(self, what: str, exc: Exception) -> None:
        self.num_errors += 1
        logger.warning("session affinity %s failed (routing without it): %s", what, exc)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class LocalAffinity(Affinity):
    """The same table in this process only (no redis configured): LRU-bounded, with the same TTL."""

    def __init__(self, ttl_s: float = 3600.0, max_sessions: int = _LOCAL_MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()  # digest -> (replica, expiry)

    async def get(self, tenant: str, session_id: str) -> str | None:
        key = session_digest(tenant, session_id)
        found = self._table.pop(key, None)
        if found is None or found[1] < time.monotonic():
            return None
        self._put(key, found[0])
        return found[0]

    async def claim(self, tenant: str, session_id: str, replica: str) -> str:
        current = await self.get(tenant, session_id)
        if current is not None:
            return current
        self._put(session_digest(tenant, session_id), replica)
        return replica

    async def move(self, tenant: str, session_id: str, seen: str, replica: str) -> str:
        current = await self.get(tenant, session_id)
        if current is not None and current != seen:
            return current
        self._put(session_digest(tenant, session_id), replica)
        return replica

    def _put(self, key: str, replica: str) -> None:
        self._table.pop(key, None)
        self._table[key] = (replica, time.monotonic() + self.ttl_s)
        while len(self._table) > self.max_sessions:
            self._table.popitem(last=False)
