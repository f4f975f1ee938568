"""KVStoreCluster: the engine's client of every kvstore replica, with the surface of KVStoreClient.

Membership comes from the redis catalog (replicas with a fresh heartbeat), refreshed at most every
`refresh_s`. A page is placed on its consistent-hashing owner (placement.HashRing); reads go to
the owner first and then, for pages it lacks, to the replica the catalog names (a page written
before membership changed). A replica that answers UNAVAILABLE is dropped from the ring at once
(until it heartbeats again); its pages are then simply missing: gets raise PageNotFoundError (or
give None with missing_ok) and the engine recomputes them. Puts to a dead owner go to the next one.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import redis

from services.kvstore.catalog import CatalogReader, Member
from services.kvstore.client import KVStoreClient, KVStoreUnavailable, PageData, missing_error
from services.kvstore.mapping import ArenaMapping, StoreInfo
from services.kvstore.pages import (
    PageBatch,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    missing_location,
)
from services.kvstore.placement import DEFAULT_VNODES, EmptyRingError, HashRing

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
RouteCall = Callable[[KVStoreClient, list[bytes]], Sequence[_T | None]]


class KVStoreCluster:
    """Client of every live kvstore replica registered in one redis catalog. Thread-safe."""

    def __init__(
        self,
        redis_url: str,
        prefix: str = "kvmem:",
        *,
        shared_memory: bool | None = None,
        timeout_s: float = 10.0,
        refresh_s: float = 1.0,
        stale_after_s: float = 6.0,
        vnodes: int = DEFAULT_VNODES,
    ) -> None:
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self._shared_memory = shared_memory
        self._catalog = CatalogReader(redis_url, prefix, stale_after_s)
        self._vnodes = vnodes
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._clients: dict[str, KVStoreClient] = {}
        self._dropped: dict[str, float] = {}  # replica id -> unix time it was dropped (or its last beat, if later)
        self._ring = HashRing((), vnodes)
        self._refreshed_at = -math.inf

    # ---- membership -----------------------------------------------------------------------------

    def refresh(self, force: bool = False) -> HashRing:
        """Re-read live replicas from redis (at most every refresh_s unless forced); returns the ring."""
        with self._lock:
            now = time.monotonic()
            if not force and now - self._refreshed_at < self.refresh_s:
                return self._ring
            self._refreshed_at = now
            try:
                members = self._catalog.members()
            except redis.RedisError as e:
                logger.warning("kvstore cluster: cannot read membership (%s); keeping %d replicas", e, len(self._ring))
                return self._ring
            live = {rid: m for rid, m in members.items() if m.last_beat > self._dropped.get(rid, -math.inf)}
            for rid in set(self._dropped) & set(live):
                del self._dropped[rid]
                logger.info("kvstore cluster: replica %s is back", rid)
            for rid, client in list(self._clients.items()):
                if rid not in live or live[rid].address != client.address:
                    self._clients.pop(rid).close()
            if set(live) != self._ring.replica_ids:
                logger.info("kvstore cluster: replicas %s", ", ".join(sorted(live)) or "(none)")
                self._ring = HashRing(live, self._vnodes)
            self._members = live
            return self._ring

    def replicas(self) -> dict[str, str]:
        """Live replicas: replica id -> address."""
        self.refresh()
        with self._lock:
            return {rid: m.address for rid, m in self._members.items()}

    def replica_for(self, page_hash: bytes) -> str:
        """The replica a page is placed on now (raises KVStoreUnavailable when none is alive)."""
        try:
            return self.refresh().owner(page_hash)
        except EmptyRingError as e:
            raise KVStoreUnavailable(str(e)) from None

    def info(self) -> dict[str, StoreInfo]:
        """Every live replica's counters."""
        return {rid: info for rid, info in self._each(lambda c: c.info()).items()}

    def arena_mappings(self) -> dict[str, ArenaMapping]:
        """The arenas mapped in this process (same-host replicas), to register as pinned memory."""
        out = {}
        for rid, mapping in self._each(lambda c: c.arena_mapping()).items():
            if mapping is not None:
                out[rid] = mapping
        return out

    # ---- pages ----------------------------------------------------------------------------------

    def put_page(self, meta: PageMeta, data: PageData) -> PageLocation:
        """Store one page on its owner replica."""
        return self.put_pages([(meta, data)])[0]

    def put_pages(self, pages: Sequence[tuple[PageMeta, PageData]]) -> list[PageLocation]:
        """Store pages on their owners (one batch per replica); a dead owner's share goes to the next."""
        results: list[PageLocation | None] = [None] * len(pages)
        pending = list(range(len(pages)))
        for _ in range(len(self.refresh()) + 1):
            if not pending:
                break
            failed: list[int] = []
            for rid, idxs in self._group(pending, [p[0].page_hash for p in pages]).items():
                try:
                    locations = self._client(rid).put_pages([pages[i] for i in idxs])
                except KVStoreUnavailable as e:
                    self._drop(rid, e)
                    failed += idxs
                    continue
                for i, loc in zip(idxs, locations, strict=True):
                    results[i] = loc
            pending = failed
        if pending:
            raise KVStoreUnavailable(f"{len(pending)} pages could not be stored: no live replica took them")
        return [r for r in results if r is not None]

    def get_page(self, page_hash: bytes) -> bytes:
        """A copy of the page's bytes, wherever it lives; PageNotFoundError when no live replica has it."""

        def call(client: KVStoreClient, hashes: list[bytes]) -> list[bytes | None]:
            try:
                return [client.get_page(hashes[0])]
            except PageNotFoundError:
                return [None]

        data = self._route([page_hash], call)[0]
        if data is None:
            raise missing_error([page_hash], "any live kvstore replica")
        return data

    def get_pages(
        self, page_hashes: Sequence[bytes], owner_id: str = "", missing_ok: bool = False, pin_ttl_s: float = 0.0
    ) -> PageBatch:
        """KVStoreClient.get_pages over the cluster: views into mapped arenas (pinned until release) or
        bytes, in request order; pages on no live replica raise PageNotFoundError, or are None."""
        batches: list[PageBatch] = []
        located: dict[bytes, PageLocation] = {}

        def call(client: KVStoreClient, hashes: list[bytes]) -> list[memoryview | bytes | None]:
            batch = client.get_pages(hashes, owner_id, missing_ok=True, pin_ttl_s=pin_ttl_s)
            batches.append(batch)
            located.update((loc.meta.page_hash, loc) for loc in batch.locations if loc.found)
            return list(batch)

        def release() -> None:
            for batch in batches:
                batch.release()

        try:
            items = cast(list[memoryview | bytes | None], self._route(list(page_hashes), call))
        except BaseException:
            release()
            raise
        locations = [located.get(h) or missing_location("", h) for h in page_hashes]
        result = PageBatch(items, locations, release)
        missing = [h for h, item in zip(page_hashes, items, strict=True) if item is None]
        if missing and not missing_ok:
            result.release()
            raise missing_error(missing, "any live kvstore replica")
        return result

    def lookup(self, page_hashes: Sequence[bytes]) -> list[PageLocation]:
        """One location per hash, in order (found=False where no live replica holds it)."""

        def call(client: KVStoreClient, hashes: list[bytes]) -> list[PageLocation | None]:
            return [loc if loc.found else None for loc in client.lookup(hashes)]

        found = self._route(list(page_hashes), call)
        return [loc or missing_location("", h) for h, loc in zip(page_hashes, found, strict=True)]

    def longest_prefix(self, page_hashes: Sequence[bytes]) -> int:
        """How many leading pages of a hash chain the catalog places on live replicas (one redis round
        trip, no store call; a page evicted since is found missing by get_pages)."""
        self.refresh()
        try:
            entries = self._catalog.entries(page_hashes)
        except redis.RedisError as e:
            logger.warning("kvstore cluster: catalog unreadable (%s): no cached prefix", e)
            return 0
        with self._lock:
            live = set(self._members)
        for n, entry in enumerate(entries):
            if entry is None or entry.replica_id not in live:
                return n
        return len(entries)

    # ---- pins -----------------------------------------------------------------------------------

    def pin(self, owner_id: str, page_hashes: Sequence[bytes], ttl_s: float = 0.0) -> list[PageLocation]:
        """Pin each page where it lives (see KVStoreClient.pin); found=False where no live replica has it."""

        def call(client: KVStoreClient, hashes: list[bytes]) -> list[PageLocation | None]:
            return [loc if loc.found else None for loc in client.pin(owner_id, hashes, ttl_s)]

        found = self._route(list(page_hashes), call)
        return [loc or missing_location("", h) for h, loc in zip(page_hashes, found, strict=True)]

    def unpin(self, owner_id: str, page_hashes: Sequence[bytes] | None = None) -> int:
        """Drop owner_id's pins (one per listed page, or all) on every live replica; returns pages unpinned."""
        hashes = list(page_hashes) if page_hashes is not None else None
        return sum(self._each(lambda c: c.unpin(owner_id, hashes)).values())

    def renew(self, owner_id: str, ttl_s: float = 0.0) -> None:
        """Renew owner_id's pins on every live replica (each replica client also does it by itself)."""
        self._each(lambda c: c.renew(owner_id, ttl_s))

    def close(self) -> None:
        """Close every replica client and the redis connection."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        self._catalog.close()

    def __enter__(self) -> KVStoreCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- routing --------------------------------------------------------------------------------

    def _route(self, page_hashes: list[bytes], call: RouteCall[_T]) -> list[_T | None]:
        """Ask each page's owner, then the replica the catalog names for pages the owner lacked."""
        results: list[_T | None] = [None] * len(page_hashes)
        asked: list[str | None] = [None] * len(page_hashes)
        pending = list(range(len(page_hashes)))
        if not pending:
            return results
        try:
            groups = self._group(pending, page_hashes)
        except KVStoreUnavailable:
            groups = {}
        for rid, idxs in groups.items():
            for i in idxs:
                asked[i] = rid
            self._ask(rid, idxs, page_hashes, call, results)
        pending = [i for i in pending if results[i] is None]
        if pending:
            for rid, idxs in self._catalog_groups(pending, page_hashes, asked).items():
                self._ask(rid, idxs, page_hashes, call, results)
        return results

    def _ask(
        self, rid: str, idxs: list[int], page_hashes: list[bytes], call: RouteCall[_T], results: list[_T | None]
    ) -> None:
        try:
            answers = call(self._client(rid), [page_hashes[i] for i in idxs])
        except KVStoreUnavailable as e:
            self._drop(rid, e)
            return
        for i, answer in zip(idxs, answers, strict=True):
            if answer is not None:
                results[i] = answer

    def _group(self, idxs: list[int], page_hashes: Sequence[bytes]) -> dict[str, list[int]]:
        try:
            ring = self.refresh()
            groups: dict[str, list[int]] = defaultdict(list)
            for i in idxs:
                groups[ring.owner(page_hashes[i])].append(i)
            return groups
        except EmptyRingError as e:
            raise KVStoreUnavailable(str(e)) from None

    def _catalog_groups(
        self, idxs: list[int], page_hashes: list[bytes], asked: list[str | None]
    ) -> dict[str, list[int]]:
        try:
            entries = self._catalog.entries([page_hashes[i] for i in idxs])
        except redis.RedisError as e:
            logger.warning("kvstore cluster: catalog unreadable (%s): %d pages treated as missing", e, len(idxs))
            return {}
        with self._lock:
            live = set(self._members)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, entry in zip(idxs, entries, strict=True):
            if entry is not None and entry.replica_id in live and entry.replica_id != asked[i]:
                groups[entry.replica_id].append(i)
        return groups

    def _each(self, fn: Callable[[KVStoreClient], _T]) -> dict[str, _T]:
        out = {}
        for rid in sorted(self.refresh().replica_ids):
            try:
                out[rid] = fn(self._client(rid))
            except KVStoreUnavailable as e:
                self._drop(rid, e)
        return out

    def _client(self, rid: str) -> KVStoreClient:
        with self._lock:
            client = self._clients.get(rid)
            if client is None:
                member = self._members.get(rid)
                if member is None:
                    raise KVStoreUnavailable(f"kvstore replica {rid} is not alive")
                client = self._clients[rid] = KVStoreClient(member.address, self._shared_memory, self.timeout_s)
            return client

    def _drop(self, rid: str, error: Exception) -> None:
        """Take a replica out of the ring until it heartbeats again."""
        with self._lock:
            member = self._members.pop(rid, None)
            if member is None:
                return
            # back only once it beats after now: a beat it sent just before it died (after our last
            # membership read) must not bring it back
            self._dropped[rid] = max(member.last_beat, time.time())
            self._ring = self._ring.without(rid)
            client = self._clients.pop(rid, None)
        logger.warning("kvstore cluster: dropped replica %s at %s: %s", rid, member.address, error)
        if client is not None:
            client.close()
