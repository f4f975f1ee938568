"""Catalog: the redis view of which replica holds which page, and which replicas are alive.

Keys (prefix "kvmem:" by default):
  {prefix}page:{hash hex}          hash  {replica, offset, nbytes, kv_format, num_tokens}
  {prefix}replicas                 hash  {replica_id: address}
  {prefix}replicas:heartbeat       hash  {replica_id: unix time of the last heartbeat}
  {prefix}replica:{id}:pages       set   hash hex of every page this replica registered
A page entry is deleted only by the replica it names (another replica may have re-registered it).
Redis may come and go: each heartbeat notices when redis lost this replica's membership (a restarted
redis) or had been unreachable, and then publishes every page the store holds again (`pages_source`),
so the catalog heals without a store restart.
Page updates are queued by the store and written in order by one writer thread (batched, off the
put path), so an entry appears a few milliseconds after its commit. They are best-effort: a failure
is logged and counted, never raised into a put (a missing entry is a cache miss; a stale one is
answered NOT_FOUND by the replica).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.kvstore.store import PageLocation

logger = logging.getLogger(__name__)

_REMOVE_SCRIPT = """
-- KEYS[1]: the replica's page set; KEYS[2..]: page keys. ARGV[1]: replica id; ARGV[2..]: hash hex.
local num_deleted = 0
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'replica') == ARGV[1] then
    redis.call('DEL', KEYS[i])
    num_deleted = num_deleted + 1
  end
  redis.call('SREM', KEYS[1], ARGV[i])
end
return num_deleted
"""
_BATCH = 512


class CatalogEntry(NamedTuple):
    replica_id: str
    offset: int
    nbytes: int
    kv_format: str
    num_tokens: int


class Member(NamedTuple):
    address: str
    last_beat: float  # unix time of the replica's last heartbeat


class CatalogReader:
    """Read-only view of the catalog: live replicas and page entries (what clients use)."""

    def __init__(self, redis_url: str, prefix: str = "kvmem:", stale_after_s: float = 6.0) -> None:
        self.prefix = prefix
        self.stale_after_s = stale_after_s
        # One retry on a fresh connection: after a redis restart every pooled connection is dead once.
        self._redis = redis.Redis.from_url(
            redis_url,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[redis.ConnectionError],
        )

    def page_key(self, page_hash: bytes) -> str:
        return f"{self.prefix}page:{page_hash.hex()}"

    @property
    def replicas_key(self) -> str:
        return f"{self.prefix}replicas"

    @property
    def heartbeat_key(self) -> str:
        return f"{self.prefix}replicas:heartbeat"

    def members(self) -> dict[str, Member]:
        """Live replicas (heartbeat within stale_after_s): replica_id -> address and last beat."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(self.replicas_key)
        pipe.hgetall(self.heartbeat_key)
        addresses, beats = pipe.execute()
        now = time.time()
        return {
            _text(rid): Member(_text(addr), float(beats[rid]))
            for rid, addr in addresses.items()
            if rid in beats and now - float(beats[rid]) <= self.stale_after_s
        }

    def replicas(self) -> dict[str, str]:
        """Live replicas (heartbeat within stale_after_s): replica_id -> address."""
        return {rid: m.address for rid, m in self.members().items()}

    def entry(self, page_hash: bytes) -> CatalogEntry | None:
        """The catalog entry of a page, or None."""
        return self.entries([page_hash])[0]

    def entries(self, page_hashes: Sequence[bytes]) -> list[CatalogEntry | None]:
        """The catalog entry of each page, in order (None where there is none); one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for h in page_hashes:
            pipe.hgetall(self.page_key(h))
        out: list[CatalogEntry | None] = []
        for fields in pipe.execute() if page_hashes else []:
            f = {_text(k): _text(v) for k, v in fields.items()}
            out.append(
                CatalogEntry(f["replica"], int(f["offset"]), int(f["nbytes"]), f["kv_format"], int(f["num_tokens"]))
                if f
                else None
            )
        return out

    def where(self, page_hash: bytes) -> str | None:
        """Address of the live replica holding the page, or None (absent, or its replica is stale)."""
        entry = self.entry(page_hash)
        if entry is None:
            return None
        member = self.members().get(entry.replica_id)
        return member.address if member is not None else None

    def close(self) -> None:
        self._redis.close()


class Catalog(CatalogReader):
    """One replica's handle on the redis catalog (a CatalogSink for PageStore)."""

    def __init__(
        self,
        redis_url: str,
        replica_id: str,
        address: str,
        prefix: str = "kvmem:",
        heartbeat_s: float = 2.0,
        stale_after_s: float | None = None,
    ) -> None:
        super().__init__(redis_url, prefix, stale_after_s if stale_after_s is not None else 3 * heartbeat_s)
        self.replica_id = replica_id
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.num_errors = 0
        self._remove = self._redis.register_script(_REMOVE_SCRIPT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._registered = False
        self.num_republished = 0
        self.pages_source: Callable[[], Sequence[PageLocation]] | None = None  # every page held (PageStore)
        self._queue: queue.Queue[tuple[list[PageLocation], list[bytes]] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._writer_loop, name="kvstore-catalog", daemon=True)
        self._writer.start()

    def pages_key(self, replica_id: str) -> str:
        return f"{self.prefix}replica:{replica_id}:pages"

    # ---- membership -----------------------------------------------------------------------------

    def register(self) -> None:
        """Drop entries left by an earlier run of this replica, announce it, start the heartbeat.

        Raises redis.RedisError when redis cannot be reached (the store must not start blind)."""
        num_stale = self._remove_all_pages()
        if num_stale:
            logger.warning("catalog: removed %d entries left by an earlier run of %s", num_stale, self.replica_id)
        self._beat()
        self._registered = True
        self._thread = threading.Thread(target=self._heartbeat_loop, name="kvstore-heartbeat", daemon=True)
        self._thread.start()
        logger.info("catalog: registered replica %s at %s", self.replica_id, self.address)

    def unregister(self) -> None:
        """Write pending updates, stop the heartbeat, remove this replica and all its page entries."""
        if not self.flush():
            logger.warning("catalog: %d updates still queued at unregister", self._queue.unfinished_tasks)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            num_removed = self._remove_all_pages()
            pipe = self._redis.pipeline(transaction=False)
            pipe.hdel(self.replicas_key, self.replica_id)
            pipe.hdel(self.heartbeat_key, self.replica_id)
            pipe.execute()
            logger.info("catalog: unregistered %s (%d page entries removed)", self.replica_id, num_removed)
        except redis.RedisError as e:
            logger.error("catalog: unregister of %s failed: %s", self.replica_id, e)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                was_failing = self._failing
                lost = self._beat()
                self._note_ok()
                if lost or was_failing:
                    self.republish("redis lost this replica (restarted?)" if lost else "redis is reachable again")
            except redis.RedisError as e:
                self._note_error("heartbeat", e)
            except Exception as e:  # noqa: BLE001 - a heartbeat that ends lets the engines drop a live replica
                logger.exception("catalog: the heartbeat failed unexpectedly; it goes on")
                self._note_error("heartbeat", e)

    def _beat(self) -> bool:
        """Announce this replica; True when redis had lost its membership (after register: redis restarted)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hexists(self.replicas_key, self.replica_id)
        pipe.hset(self.replicas_key, self.replica_id, self.address)
        pipe.hset(self.heartbeat_key, self.replica_id, repr(time.time()))
        existed = pipe.execute()[0]
        return self._registered and not existed

    def republish(self, why: str) -> None:
        """Queue an entry for every page the store holds (after redis lost or missed them)."""
        if self.pages_source is None:
            return
        locations = list(self.pages_source())
        self.num_republished += 1
        logger.warning("catalog: %s; publishing %d page entries again", why, len(locations))
        for i in range(0, len(locations), _BATCH):
            self.update(locations[i : i + _BATCH], [])

    # ---- pages ----------------------------------------------------------------------------------

    def update(self, added: Sequence[PageLocation], removed: Sequence[bytes]) -> None:
        """Queue page removals then additions for the writer thread (keeps redis off the put path)."""
        self._queue.put((list(added), list(removed)))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued update has been written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def _writer_loop(self) -> None:
        """Drain the queue in order, one pipeline per batch of updates. A batch that fails in any way is counted
        and dropped (a missing entry is a cache miss), never the thread: were it to end, every later update would
        stay queued, the catalog would go stale while the store held its pages, and `flush` would time out."""
        while True:
            batch = [self._queue.get()]
            while len(batch) < _BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            updates = [u for u in batch if u is not None]
            try:
                if updates:
                    self._write(updates)
            except Exception as e:  # noqa: BLE001 - _write handles redis's errors; anything else is logged here
                logger.exception("catalog: an update batch failed unexpectedly; the writer goes on")
                self._note_error("update", e)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if len(updates) < len(batch):
                return

    def _write(self, updates: list[tuple[list[PageLocation], list[bytes]]]) -> None:
        num_added = sum(len(a) for a, _ in updates)
        num_removed = sum(len(r) for _, r in updates)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for added, removed in updates:
                if removed:
                    self._queue_remove(pipe, [h.hex() for h in removed])
                for loc in added:
                    pipe.hset(
                        self.page_key(loc.meta.page_hash),
                        mapping={
                            "replica": loc.replica_id,
                            "offset": loc.offset,
                            "nbytes": loc.meta.nbytes,
                            "kv_format": loc.meta.kv_format,
                            "num_tokens": loc.meta.num_tokens,
                        },
                    )
                    pipe.sadd(self.pages_key(self.replica_id), loc.meta.page_hash.hex())
            pipe.execute()
            self._note_ok()
        except redis.RedisError as e:
            self._note_error(f"update (+{num_added} -{num_removed})", e)

    def close(self) -> None:
        """Stop the threads (queued updates are written first) and close the connection."""
        self._stop.set()
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join(timeout=10)
        self._redis.close()

    # ---- internals ------------------------------------------------------------------------------

    def _queue_remove(self, pipe: redis.client.Pipeline, hexes: list[str]) -> None:
        for i in range(0, len(hexes), _BATCH):
            batch = hexes[i : i + _BATCH]
            keys = [self.pages_key(self.replica_id)] + [f"{self.prefix}page:{h}" for h in batch]
            self._remove(keys=keys, args=[self.replica_id, *batch], client=pipe)

    def _remove_all_pages(self) -> int:
        members = [_text(m) for m in self._redis.smembers(self.pages_key(self.replica_id))]
        if not members:
            return 0
        pipe = self._redis.pipeline(transaction=False)
        self._queue_remove(pipe, members)
        pipe.delete(self.pages_key(self.replica_id))
        return int(sum(pipe.execute()[:-1]))

    def _note_ok(self) -> None:
        if self._failing:
            self._failing = False
            logger.info("catalog: redis reachable again")

    def _note_error(self, what: str, e: Exception) -> None:
        self.num_errors += 1
        if not self._failing:
            self._failing = True
            logger.warning("catalog: %s failed (%s: %s); continuing without the catalog", what, type(e).__name__, e)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
