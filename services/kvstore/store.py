"""PageStore: the page table over the arena (no grpc here).

A page is stored once per hash. Writers either hand the bytes in (`put`) or, on the same host,
`reserve` a slot, write into their own mapping of the arena and `commit`. Uncommitted reservations
are invisible to readers; one that is not committed within `reservation_ttl_s` can no longer be
committed, and its slot is reused only after a further `reservation_grace_s` (a late writer may
still be copying into it). Committed pages are evicted least-recently-used first when a new slot
does not fit. Never evicted: pages being copied out (`read`), pages a same-host reader leased with
`get` (for `read_lease_s`), and pages pinned by an owner (`pin`, `get_many`) until it unpins them or
stops renewing (`pin_ttl_s`).

The cold tier (coldtier.py) compresses pages not touched for `cold_after_s`; reads restore them.
Arrivals (commit/put), moves (compress/restore) and evictions are reported to a CatalogSink under
the store lock, so in order; the redis Catalog only queues them.
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

from services.kvstore.arena import Arena, round_up
from services.kvstore.codec import PageCodec
from services.kvstore.coldtier import ColdTier, StoredPage
from services.kvstore.pages import (
    InvalidPageError,
    KVStoreError,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    PageTooLargeError,
    PutResult,
    Reservation,
    ReservationError,
    StaleArenaError,
    StoreFullError,
    StoreIntegrityError,
    as_bytes_view,
    check_hash,
    check_meta,
    check_owner_id,
    missing_location,
)
from services.kvstore.pins import PinTable

logger = logging.getLogger(__name__)

__all__ = [
    "InvalidPageError",
    "KVStoreError",
    "PageLocation",
    "PageMeta",
    "PageNotFoundError",
    "PageStore",
    "PageTooLargeError",
    "PutResult",
    "Reservation",
    "ReservationError",
    "StaleArenaError",
    "StoreFullError",
    "StoreIntegrityError",
    "StoreStats",
    "as_bytes_view",
    "check_hash",
    "check_meta",
]

# Protocol timings shared with same-host clients (client.py checks its copies against them).
RESERVATION_TTL_S = 10.0
RESERVATION_GRACE_S = 10.0
READ_LEASE_S = 2.0
PIN_TTL_S = 30.0  # an owner that does not renew within this loses its pins
MAX_PIN_TTL_S = 3600.0


class StoreStats(NamedTuple):
    arena_bytes: int
    used_bytes: int  # slots of pages and reservations (4 KiB-rounded; cold pages at compressed size)
    num_pages: int
    num_reservations: int
    evictions: int
    expired_reservations: int
    num_cold_pages: int = 0
    cold_bytes: int = 0  # compressed bytes of the cold pages
    cold_raw_bytes: int = 0  # what they hold uncompressed
    num_compressed: int = 0  # compressions so far
    num_restored: int = 0  # cold pages restored by a read so far
    num_pinned_pages: int = 0
    num_pin_owners: int = 0
    expired_pin_owners: int = 0


class CatalogSink(Protocol):
    """Where the store reports page arrivals and departures (the redis catalog)."""

    def update(self, added: Sequence[PageLocation], removed: Sequence[bytes]) -> None: ...


@dataclass
class _Reservation:
    meta: PageMeta
    offset: int
    deadline: float  # inf for the store's own puts


class PageStore(ColdTier):
    """Page table, reservations, pins, LRU eviction and the cold tier over one Arena. Thread-safe."""

    def __init__(
        self,
        arena: Arena,
        catalog: CatalogSink | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        reservation_ttl_s: float = RESERVATION_TTL_S,
        reservation_grace_s: float = RESERVATION_GRACE_S,
        read_lease_s: float = READ_LEASE_S,
        pin_ttl_s: float = PIN_TTL_S,
        cold_after_s: float | None = None,
        codec: PageCodec | None = None,
    ) -> None:
        self.arena = arena
        self.replica_id = arena.replica_id
        self.cold_after_s = cold_after_s
        self._catalog = catalog
        self._clock = clock
        self._ttl_s = reservation_ttl_s
        self._grace_s = reservation_grace_s
        self._lease_s = read_lease_s
        self._pin_ttl_s = pin_ttl_s
        self._codec = codec or PageCodec()
        self._lock = threading.Lock()
        self._page_table: OrderedDict[bytes, StoredPage] = OrderedDict()  # least recently used first
        self._reservation_table: dict[str, _Reservation] = {}
        self._pins = PinTable()
        self._counts = {"evictions": 0, "expired": 0, "compressed": 0, "restored": 0, "expired_owners": 0}

    # ---- writes -------------------------------------------------------------------------------

    def reserve(self, meta: PageMeta) -> Reservation:
        """Reserve a slot for meta (or report the page present); the caller writes it, then commits."""
        return self.reserve_many([meta])[0]

    def reserve_many(self, metas: Sequence[PageMeta]) -> list[Reservation]:
        """Reserve slots for every page, in order; all or none (on an error none is left reserved)."""
        for meta in metas:
            self._check_fits(meta)
        made: list[Reservation] = []
        with self._lock:
            try:
                for meta in metas:
                    page = self._present_locked(meta)
                    if page is not None:
                        made.append(Reservation(True, page.offset, ""))
                        continue
                    now = self._clock()
                    made.append(self._reserve_locked(meta, now + self._ttl_s, now))
            except BaseException:
                for r in made:
                    if r.reservation_id:
                        self._drop_reservation_locked(r.reservation_id)
                raise
        return made

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
            self._restore_locked(page_hash, page)
            page.lease_until = max(page.lease_until, self._clock() + self._lease_s)
            return self._location(page)

    def get_many(
        self, page_hashes: Sequence[bytes], owner_id: str = "", ttl_s: float = 0.0
    ) -> tuple[str, list[PageLocation]]:
        """Restore and pin every present page for a same-host reader, under owner_id (a fresh lease id
        when empty); returns the owner id to unpin with and one location per hash (found=False if absent)."""
        for h in page_hashes:
            check_hash(h)
        owner_id = owner_id or f"lease-{secrets.token_hex(8)}"
        deadline = self._pin_deadline(owner_id, ttl_s)
        locations: list[PageLocation] = []
        try:
            for h in page_hashes:  # one page per lock hold: restores are slow-ish, others interleave
                with self._lock:
                    page = self._page_table.get(h)
                    if page is None:
                        locations.append(missing_location(self.replica_id, h))
                        continue
                    self._touch_locked(h)
                    self._restore_locked(h, page)
                    self._pins.pin(owner_id, [h], deadline)
                    locations.append(self._location(page))
        except BaseException:  # e.g. no room to restore a cold page: undo this call's pins
            with self._lock:
                self._pins.unpin(owner_id, [loc.meta.page_hash for loc in locations if loc.found])
            raise
        return owner_id, locations

    def read(self, page_hash: bytes) -> tuple[PageLocation, bytes]:
        """The page's location and a copy of its bytes (restored if cold; pinned while copying)."""
        check_hash(page_hash)
        with self._lock:
            page = self._touch_locked(page_hash)
            self._restore_locked(page_hash, page)
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

    # ---- pins ---------------------------------------------------------------------------------

    def pin(self, owner_id: str, page_hashes: Sequence[bytes], ttl_s: float = 0.0) -> list[PageLocation]:
        """Pin the present pages for owner_id (never evicted nor compressed until unpinned or the owner
        is not renewed within ttl_s, default pin_ttl_s). An empty list only renews the owner."""
        for h in page_hashes:
            check_hash(h)
        deadline = self._pin_deadline(owner_id, ttl_s)
        with self._lock:
            locations = [self._location_or_missing(h) for h in page_hashes]
            found = [loc.meta.page_hash for loc in locations if loc.found]
            if found:
                self._pins.pin(owner_id, found, deadline)
            else:
                self._pins.renew(owner_id, deadline)
            return locations

    def unpin(self, owner_id: str, page_hashes: Sequence[bytes] | None = None) -> int:
        """Drop one pin per listed page (all the owner's pins when None); returns pages now unpinned."""
        check_owner_id(owner_id)
        with self._lock:
            return len(self._pins.unpin(owner_id, page_hashes))

    def owner_pins(self, owner_id: str) -> dict[bytes, int]:
        """The pins owner_id holds (page hash -> count)."""
        with self._lock:
            return self._pins.owner_pins(owner_id)

    def expire_pins(self) -> list[str]:
        """Drop the pins of owners past their deadline; returns their ids."""
        with self._lock:
            return self._expire_pins_locked(self._clock())

    # ---- books --------------------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            cold = [p for p in self._page_table.values() if p.cold_nbytes]
            return StoreStats(
                arena_bytes=self.arena.capacity,
                used_bytes=self.arena.stats().used_bytes,
                num_pages=len(self._page_table),
                num_reservations=len(self._reservation_table),
                evictions=self._counts["evictions"],
                expired_reservations=self._counts["expired"],
                num_cold_pages=len(cold),
                cold_bytes=sum(p.cold_nbytes for p in cold),
                cold_raw_bytes=sum(p.meta.nbytes for p in cold),
                num_compressed=self._counts["compressed"],
                num_restored=self._counts["restored"],
                num_pinned_pages=len(self._pins.pinned_hashes()),
                num_pin_owners=self._pins.num_owners(),
                expired_pin_owners=self._counts["expired_owners"],
            )

    def check_integrity(self) -> None:
        """Arena books balance (free + used == total), every used slot belongs to exactly one page or
        reservation, and every pinned page is present with pins counted the same by page and by owner."""
        with self._lock:
            self.arena.check_integrity()
            slots = [(p.offset, p.slot_nbytes) for p in self._page_table.values()]
            slots += [(r.offset, r.meta.nbytes) for r in self._reservation_table.values()]
            arena_stats = self.arena.stats()
            num_slots, slot_bytes = len({o for o, _ in slots}), sum(round_up(n) for _, n in slots)
            if (num_slots, slot_bytes) != (arena_stats.num_used, arena_stats.used_bytes):
                raise StoreIntegrityError(
                    f"pages + reservations != arena used: {len(self._page_table)} + "
                    f"{len(self._reservation_table)} slots ({num_slots} distinct, {slot_bytes} bytes) != "
                    f"{arena_stats.num_used} slots ({arena_stats.used_bytes} bytes)"
                )
            absent = self._pins.pinned_hashes() - self._page_table.keys()
            by_page, by_owner = self._pins.totals()
            if absent or by_page != by_owner:
                raise StoreIntegrityError(
                    f"pins: {len(absent)} pinned pages absent; pins by page != by owner: {by_page} != {by_owner}"
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

    def _pin_deadline(self, owner_id: str, ttl_s: float) -> float:
        check_owner_id(owner_id)
        if not 0 <= ttl_s <= MAX_PIN_TTL_S:
            raise InvalidPageError(f"pin ttl must be in [0, {MAX_PIN_TTL_S}] s (0: {self._pin_ttl_s}), got {ttl_s}")
        return self._clock() + (ttl_s or self._pin_ttl_s)

    def _present_locked(self, meta: PageMeta) -> StoredPage | None:
        page = self._page_table.get(meta.page_hash)
        if page is None:
            return None
        if page.meta != meta:
            raise InvalidPageError(f"page {meta.page_hash.hex()} is stored as {page.meta}, not {meta}")
        self._touch_locked(meta.page_hash)
        return page

    def _reserve_locked(self, meta: PageMeta, deadline: float, now: float) -> Reservation:
        self._expire_locked(now)
        offset = self._alloc_locked(meta.nbytes, now)
        reservation_id = secrets.token_hex(8)
        self._reservation_table[reservation_id] = _Reservation(meta, offset, deadline)
        return Reservation(False, offset, reservation_id)

    def _alloc_locked(self, nbytes: int, now: float) -> int:
        """A slot of nbytes, evicting least recently used evictable pages until one fits."""
        self._expire_pins_locked(now)
        victims: list[bytes] = []
        try:
            while (offset := self.arena.alloc(nbytes)) is None:
                victims.append(self._evict_one_locked(nbytes, now))
        finally:
            if victims:
                self._report_locked([], victims)
        return offset

    def _evictable_locked(self, page_hash: bytes, page: StoredPage, now: float) -> bool:
        return page.num_pins == 0 and page.lease_until <= now and not self._pins.is_pinned(page_hash)

    def _evict_one_locked(self, nbytes: int, now: float) -> bytes:
        for page_hash, page in self._page_table.items():
            if self._evictable_locked(page_hash, page, now):
                del self._page_table[page_hash]
                self.arena.free(page.offset, page.slot_nbytes)
                self._counts["evictions"] += 1
                logger.debug("evicted page %s (%d bytes)", page_hash.hex(), page.slot_nbytes)
                return page_hash
        s = self.arena.stats()
        raise StoreFullError(
            f"no room for {nbytes} bytes and nothing evictable: {len(self._page_table)} pages pinned or "
            f"leased ({len(self._pins.pinned_hashes())} pinned by {self._pins.num_owners()} owners), "
            f"{len(self._reservation_table)} reservations, {s.used_bytes} of {s.capacity} bytes used"
        )

    def _expire_locked(self, now: float) -> None:
        for reservation_id, r in list(self._reservation_table.items()):
            if now > r.deadline + self._grace_s:
                self._drop_reservation_locked(reservation_id)
                self._counts["expired"] += 1
                logger.warning("reservation %s for page %s expired uncommitted", reservation_id, r.meta.page_hash.hex())

    def _expire_pins_locked(self, now: float) -> list[str]:
        expired = self._pins.expire(now)
        self._counts["expired_owners"] += len(expired)
        return expired

    def _drop_reservation_locked(self, reservation_id: str) -> None:
        r = self._reservation_table.pop(reservation_id)
        self.arena.free(r.offset, r.meta.nbytes)

    def _commit_locked(self, reservation_id: str) -> tuple[PageLocation, bool]:
        r = self._reservation_table[reservation_id]
        page = self._page_table.get(r.meta.page_hash)
        if page is not None:  # another writer committed the same page first
            self._drop_reservation_locked(reservation_id)
            self._touch_locked(r.meta.page_hash)
            return self._location(page), True
        del self._reservation_table[reservation_id]
        page = self._page_table[r.meta.page_hash] = StoredPage(r.offset, r.meta, self._clock())
        location = self._location(page)
        self._report_locked([location], [])
        return location, False

    def _report_locked(self, added: list[PageLocation], removed: list[bytes]) -> None:
        if self._catalog is not None:
            self._catalog.update(added, removed)

    def _touch_locked(self, page_hash: bytes) -> StoredPage:
        page = self._page_table.get(page_hash)
        if page is None:
            raise PageNotFoundError(f"page {page_hash.hex()} is not in store {self.replica_id}", (page_hash,))
        self._page_table.move_to_end(page_hash)
        page.last_touch = self._clock()
        return page

    def _location(self, page: StoredPage) -> PageLocation:
        return PageLocation(True, self.replica_id, page.offset, page.meta, page.cold_nbytes > 0)

    def _location_or_missing(self, page_hash: bytes) -> PageLocation:
        page = self._page_table.get(page_hash)
        if page is None:
            return missing_location(self.replica_id, page_hash)
        return self._location(page)
