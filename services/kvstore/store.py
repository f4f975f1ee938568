"""PageStore: the page table over the arena (no grpc here).

A page is stored once per hash. Writers either hand the bytes in (`put`) or, on the same host,
`reserve` a slot, write into their own mapping of the arena and `commit`. Uncommitted reservations
are invisible to readers; one that is not committed within `reservation_ttl_s` can no longer be
committed, and its slot is reused only after a further `reservation_grace_s` (a late writer may
still be copying into it). Committed pages are evicted least-recently-used first when a new slot
does not fit; pages being copied out (`read`) are pinned, and a `get` (a same-host reader that
will copy from its mapping) leases the page for `read_lease_s`; neither kind is evicted.
Arrivals (commit/put) and evictions are reported to a CatalogSink under the store lock, so in
order; the redis Catalog only queues them.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from services.common.pagehash import HASH_BYTES
from services.kvstore.arena import Arena, round_up

logger = logging.getLogger(__name__)

# Protocol timings shared with same-host clients (client.py checks its copies against them).
RESERVATION_TTL_S = 10.0
RESERVATION_GRACE_S = 10.0
READ_LEASE_S = 2.0
MAX_KV_FORMAT_CHARS = 64


class KVStoreError(Exception):
    """Base of the store's typed errors; messages carry the numbers."""


class InvalidPageError(KVStoreError):
    """Malformed request: hash length, sizes, data length, or meta differing from the stored page."""


class PageNotFoundError(KVStoreError):
    """No committed page with this hash."""


class PageTooLargeError(KVStoreError):
    """The page is bigger than the whole store budget."""


class StoreFullError(KVStoreError):
    """No room, and nothing can be evicted (every page is pinned, leased or reserved)."""


class ReservationError(KVStoreError):
    """Unknown, already committed or expired reservation."""


class StaleArenaError(KVStoreError):
    """The client's mapped arena is not this store's current arena (token mismatch)."""


class StoreIntegrityError(KVStoreError):
    """The page table and the arena disagree; the message carries the numbers."""


class PageMeta(NamedTuple):
    page_hash: bytes
    kv_format: str
    num_tokens: int
    nbytes: int


class PageLocation(NamedTuple):
    found: bool
    replica_id: str
    offset: int  # byte offset in the arena file
    meta: PageMeta


class Reservation(NamedTuple):
    already_present: bool  # nothing to write: `offset` is the stored page
    offset: int
    reservation_id: str  # "" when already_present


class PutResult(NamedTuple):
    location: PageLocation
    already_present: bool


class StoreStats(NamedTuple):
    arena_bytes: int
    used_bytes: int  # slots of pages and reservations (4 KiB-rounded)
    num_pages: int
    num_reservations: int
    evictions: int
    expired_reservations: int


class CatalogSink(Protocol):
    """Where the store reports page arrivals and departures (the redis catalog)."""

    def update(self, added: Sequence[PageLocation], removed: Sequence[bytes]) -> None: ...


@dataclass
class _Page:
    offset: int
    meta: PageMeta
    num_pins: int = 0
    lease_until: float = 0.0


@dataclass
class _Reservation:
    meta: PageMeta
    offset: int
    deadline: float  # inf for the store's own puts


def check_hash(page_hash: bytes) -> None:
    """Raise InvalidPageError unless page_hash is HASH_BYTES long."""
    if len(page_hash) != HASH_BYTES:
        raise InvalidPageError(f"page hash must be {HASH_BYTES} bytes, got {len(page_hash)}")


def check_meta(meta: PageMeta) -> None:
    """Raise InvalidPageError for a malformed PageMeta."""
    check_hash(meta.page_hash)
    if meta.nbytes < 1:
        raise InvalidPageError(f"page nbytes must be >= 1, got {meta.nbytes}")
    if meta.num_tokens < 1:
        raise InvalidPageError(f"page num_tokens must be >= 1, got {meta.num_tokens}")
    if not 1 <= len(meta.kv_format) <= MAX_KV_FORMAT_CHARS:
        raise InvalidPageError(f"kv_format must be 1..{MAX_KV_FORMAT_CHARS} chars, got {len(meta.kv_format)}")


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of data (C-contiguous buffers of any item format)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PageStore:
    """Page table, reservations and LRU eviction over one Arena. Thread-safe."""

    def __init__(
        self,
        arena: Arena,
        catalog: CatalogSink | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        reservation_ttl_s: float = RESERVATION_TTL_S,
        reservation_grace_s: float = RESERVATION_GRACE_S,
        read_lease_s: float = READ_LEASE_S,
    ) -> None:
        self.arena = arena
        self.replica_id = arena.replica_id
        self._catalog = catalog
        self._clock = clock
        self._ttl_s = reservation_ttl_s
        self._grace_s = reservation_grace_s
        self._lease_s = read_lease_s
        self._lock = threading.Lock()
        self._page_table: OrderedDict[bytes, _Page] = OrderedDict()  # least recently used first
        self._reservation_table: dict[str, _Reservation] = {}
        self._num_evictions = 0
        self._num_expired = 0

    # ---- writes -------------------------------------------------------------------------------

    def reserve(self, meta: PageMeta) -> Reservation:
        """Reserve a slot for meta (or report the page present); the caller writes it, then commits."""
        self._check_fits(meta)
        with self._lock:
            page = self._present_locked(meta)
            if page is not None:
                return Reservation(True, page.offset, "")
            now = self._clock()
            return self._reserve_locked(meta, now + self._ttl_s, now)

    def commit(self, reservation_id: str) -> PageLocation:
        """Publish a reserved page: readers and the catalog see it from now on."""
        with self._lock:
            r = self._reservation_table.get(reservation_id)
            if r is None:
                raise ReservationError(f"unknown reservation {reservation_id!r} (never made, committed or expired)")
            late_s = self._clock() - r.deadline
            if late_s > 0:
                raise ReservationError(f"reservation {reservation_id!r} expired {late_s:.3f}s ago (ttl {self._ttl_s}s)")
            location, _ = self._commit_locked(reservation_id)
            return location

    def put(self, meta: PageMeta, data: bytes | bytearray | memoryview) -> PutResult:
        """Store a page from bytes in hand (one copy, into the arena)."""
        src = as_bytes_view(data)
        if src.nbytes != meta.nbytes:
            raise InvalidPageError(f"page data is {src.nbytes} bytes, meta says {meta.nbytes}")
        self._check_fits(meta)
        with self._lock:
            page = self._present_locked(meta)
            if page is not None:
                return PutResult(self._location(page), True)
            r = self._reserve_locked(meta, float("inf"), self._clock())
        try:
            with self.arena.view(r.offset, meta.nbytes) as dst:
                dst[:] = src
        except BaseException:
            with self._lock:
                self._drop_reservation_locked(r.reservation_id)
            raise
        with self._lock:
            location, already_present = self._commit_locked(r.reservation_id)
        return PutResult(location, already_present)

    # ---- reads --------------------------------------------------------------------------------

    def get(self, page_hash: bytes) -> PageLocation:
        """Where the page is, for a same-host reader; leases it (not evicted) for read_lease_s."""
        check_hash(page_hash)
        with self._lock:
            page = self._touch_locked(page_hash)
            page.lease_until = max(page.lease_until, self._clock() + self._lease_s)
            return self._location(page)

    def read(self, page_hash: bytes) -> tuple[PageLocation, bytes]:
        """The page's location and a copy of its bytes (pinned while copying)."""
        check_hash(page_hash)
        with self._lock:
            page = self._touch_locked(page_hash)
            page.num_pins += 1
        try:
            with self.arena.view(page.offset, page.meta.nbytes) as src:
                data = bytes(src)
        finally:
            with self._lock:
                page.num_pins -= 1
        return self._location(page), data

    def lookup(self, page_hashes: Sequence[bytes]) -> list[PageLocation]:
        """One location per hash, in order (found=False for absent ones). Does not touch LRU order."""
        for h in page_hashes:
            check_hash(h)
        with self._lock:
            return [self._location_or_missing(h) for h in page_hashes]

    def page_hashes(self) -> list[bytes]:
        """Hashes of every committed page, least recently used first."""
        with self._lock:
            return list(self._page_table)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                arena_bytes=self.arena.capacity,
                used_bytes=self.arena.stats().used_bytes,
                num_pages=len(self._page_table),
                num_reservations=len(self._reservation_table),
                evictions=self._num_evictions,
                expired_reservations=self._num_expired,
            )

    def check_integrity(self) -> None:
        """Arena books balance, and every used slot belongs to exactly one page or reservation."""
        with self._lock:
            self.arena.check_integrity()
            slots = [(p.offset, p.meta.nbytes) for p in self._page_table.values()]
            slots += [(r.offset, r.meta.nbytes) for r in self._reservation_table.values()]
            arena_stats = self.arena.stats()
            num_slots, slot_bytes = len({o for o, _ in slots}), sum(round_up(n) for _, n in slots)
            if (num_slots, slot_bytes) != (arena_stats.num_used, arena_stats.used_bytes):
                raise StoreIntegrityError(
                    f"pages + reservations != arena used: {len(self._page_table)} + "
                    f"{len(self._reservation_table)} slots ({num_slots} distinct, {slot_bytes} bytes) != "
                    f"{arena_stats.num_used} slots ({arena_stats.used_bytes} bytes)"
                )

    def check_arena_token(self, token: bytes) -> None:
        """Raise StaleArenaError unless token is this store's arena token."""
        if token != self.arena.token:
            raise StaleArenaError(
                f"client mapped arena token {token.hex()}, store {self.replica_id} has {self.arena.token.hex()}"
            )

    # ---- internals (call with the lock held) ---------------------------------------------------

    def _check_fits(self, meta: PageMeta) -> None:
        check_meta(meta)
        if round_up(meta.nbytes) > self.arena.capacity:
            raise PageTooLargeError(
                f"page of {meta.nbytes} bytes exceeds the store budget of {self.arena.capacity} bytes"
            )

    def _present_locked(self, meta: PageMeta) -> _Page | None:
        page = self._page_table.get(meta.page_hash)
        if page is None:
            return None
        if page.meta != meta:
            raise InvalidPageError(f"page {meta.page_hash.hex()} is stored as {page.meta}, not {meta}")
        self._page_table.move_to_end(meta.page_hash)
        return page

    def _reserve_locked(self, meta: PageMeta, deadline: float, now: float) -> Reservation:
        self._expire_locked(now)
        victims: list[bytes] = []
        try:
            while (offset := self.arena.alloc(meta.nbytes)) is None:
                victims.append(self._evict_one_locked(meta.nbytes, now))
        finally:
            if victims and self._catalog is not None:
                self._catalog.update([], victims)
        reservation_id = secrets.token_hex(8)
        self._reservation_table[reservation_id] = _Reservation(meta, offset, deadline)
        return Reservation(False, offset, reservation_id)

    def _evict_one_locked(self, nbytes: int, now: float) -> bytes:
        for page_hash, page in self._page_table.items():
            if page.num_pins == 0 and page.lease_until <= now:
                del self._page_table[page_hash]
                self.arena.free(page.offset, page.meta.nbytes)
                self._num_evictions += 1
                logger.debug("evicted page %s (%d bytes)", page_hash.hex(), page.meta.nbytes)
                return page_hash
        s = self.arena.stats()
        raise StoreFullError(
            f"no room for {nbytes} bytes and nothing evictable: {len(self._page_table)} pages pinned or "
            f"leased, {len(self._reservation_table)} reservations, {s.used_bytes} of {s.capacity} bytes used"
        )

    def _expire_locked(self, now: float) -> None:
        for reservation_id, r in list(self._reservation_table.items()):
            if now > r.deadline + self._grace_s:
                self._drop_reservation_locked(reservation_id)
                self._num_expired += 1
                logger.warning("reservation %s for page %s expired uncommitted", reservation_id, r.meta.page_hash.hex())

    def _drop_reservation_locked(self, reservation_id: str) -> None:
        r = self._reservation_table.pop(reservation_id)
        self.arena.free(r.offset, r.meta.nbytes)

    def _commit_locked(self, reservation_id: str) -> tuple[PageLocation, bool]:
        r = self._reservation_table[reservation_id]
        page = self._page_table.get(r.meta.page_hash)
        if page is not None:  # another writer committed the same page first
            self._drop_reservation_locked(reservation_id)
            self._page_table.move_to_end(r.meta.page_hash)
            return self._location(page), True
        del self._reservation_table[reservation_id]
        page = self._page_table[r.meta.page_hash] = _Page(r.offset, r.meta)
        location = self._location(page)
        if self._catalog is not None:
            self._catalog.update([location], [])
        return location, False

    def _touch_locked(self, page_hash: bytes) -> _Page:
        page = self._page_table.get(page_hash)
        if page is None:
            raise PageNotFoundError(f"page {page_hash.hex()} is not in store {self.replica_id}")
        self._page_table.move_to_end(page_hash)
        return page

    def _location(self, page: _Page) -> PageLocation:
        return PageLocation(True, self.replica_id, page.offset, page.meta)

    def _location_or_missing(self, page_hash: bytes) -> PageLocation:
        page = self._page_table.get(page_hash)
        if page is None:
            return PageLocation(False, self.replica_id, 0, PageMeta(page_hash, "", 0, 0))
        return self._location(page)
