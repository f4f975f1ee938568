"""ColdTier: the PageStore's compressed tier (a mixin over the store's page table and arena).

`compress_cold` (called by the store's maintenance thread) compresses pages not touched
for `cold_after_s` inside the arena: the compressed bytes go to a free slot of their size and the
page's full slot is freed (reusable as is by the next page), or, when nothing is free, they take
the head of the page's own slot and its tail goes back. So a cold page counts its compressed size
against the budget, and no page is evicted to compress another. Any read of a cold page restores
it to a full slot first (and it is warm again).
Compression runs outside the store lock (the page is held by a copy pin); the swap and every
restore run under it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.kvstore.arena import Arena, round_up
from services.kvstore.codec import PageCodec
from services.kvstore.pages import PageLocation, PageMeta

logger = logging.getLogger(__name__)


@dataclass
class StoredPage:
    """A committed page in the store's page table."""

    offset: int
    meta: PageMeta
    last_touch: float
    num_pins: int = 0  # copies out of the slot in progress (read, compression)
    lease_until: float = 0.0
    cold_nbytes: int = 0  # > 0: the slot holds this many compressed bytes
    incompressible: bool = False

    @property
    def slot_nbytes(self) -> int:
        return self.cold_nbytes or self.meta.nbytes


class ColdTier:
    """Compression of cold pages and their restore; PageStore provides the state and helpers below."""

    arena: Arena
    cold_after_s: float | None
    _lock: threading.Lock
    _page_table: OrderedDict[bytes, StoredPage]
    _codec: PageCodec
    _counts: dict[str, int]
    _clock: Callable[[], float]

    def _evictable_locked(self, page_hash: bytes, page: StoredPage, now: float) -> bool:
        raise NotImplementedError

    def _alloc_locked(self, nbytes: int, now: float) -> int:
        raise NotImplementedError

    def _report_locked(self, added: list[PageLocation], removed: list[bytes]) -> None:
        raise NotImplementedError

    def _location(self, page: StoredPage) -> PageLocation:
        raise NotImplementedError

    def compress_cold(self, max_pages: int = 64) -> int:
        """Compress up to max_pages pages not touched for cold_after_s (oldest first); returns how many."""
        if self.cold_after_s is None:
            return 0
        num_done = 0
        for page_hash in self._cold_candidates(max_pages):
            num_done += self._compress_one(page_hash)
        return num_done

    def _cold_candidates(self, max_pages: int) -> list[bytes]:
        assert self.cold_after_s is not None
        with self._lock:
            now = self._clock()
            cutoff = now - self.cold_after_s
            out: list[bytes] = []
            for h, page in self._page_table.items():  # least recently used first
                if page.last_touch > cutoff or len(out) >= max_pages:
                    break
                if not page.cold_nbytes and not page.incompressible and self._evictable_locked(h, page, now):
                    out.append(h)
            return out

    def _compress_one(self, page_hash: bytes) -> int:
        with self._lock:
            page = self._page_table.get(page_hash)
            if page is None or page.cold_nbytes or not self._evictable_locked(page_hash, page, self._clock()):
                return 0
            page.num_pins += 1  # not evicted while we read it
            touched = page.last_touch
        try:
            with self.arena.view(page.offset, page.meta.nbytes) as src:
                blob = self._codec.compress(src, page.meta.kv_format)
        except BaseException:
            with self._lock:
                page.num_pins -= 1
            raise
        with self._lock:
            page.num_pins -= 1
            if page.last_touch != touched or not self._evictable_locked(page_hash, page, self._clock()):
                return 0  # read (or pinned) meanwhile: it is not cold any more
            if round_up(len(blob)) >= round_up(page.meta.nbytes):
                page.incompressible = True
                return 0
            self._move_to_cold_locked(page, blob)
            self._counts["compressed"] += 1
            self._report_locked([self._location(page)], [])
        logger.debug("page %s cold: %d -> %d bytes", page_hash.hex(), page.meta.nbytes, len(blob))
        return 1

    def _move_to_cold_locked(self, page: StoredPage, blob: bytes) -> None:
        """Put the blob in a free slot and free the page's full one (which a new page can reuse as is);
        when nothing is free, write it over the page's head and give the slot's tail back instead."""
        offset = self.arena.alloc(len(blob))  # never evicts: compression must not cost pages
        target = page.offset if offset is None else offset
        with self.arena.view(target, len(blob)) as dst:
            dst[:] = blob
        if offset is None:
            self.arena.shrink(page.offset, page.meta.nbytes, len(blob))
        else:
            self.arena.free(page.offset, page.meta.nbytes)
            page.offset = offset
        page.cold_nbytes = len(blob)

    def _restore_locked(self, page_hash: bytes, page: StoredPage) -> None:
        """Give a cold page a full slot again (evicting others if needed) and decompress it there."""
        if not page.cold_nbytes:
            return
        now = self._clock()
        page.num_pins += 1  # the eviction that makes room must not pick this page
        try:
            offset = self._alloc_locked(page.meta.nbytes, now)
        finally:
            page.num_pins -= 1
        try:
            with (
                self.arena.view(page.offset, page.cold_nbytes) as blob,
                self.arena.view(offset, page.meta.nbytes) as dst,
            ):
                self._codec.decompress_into(blob, dst)
        except BaseException:
            self.arena.free(offset, page.meta.nbytes)
            raise
        self.arena.free(page.offset, page.cold_nbytes)
        page.offset, page.cold_nbytes = offset, 0
        self._counts["restored"] += 1
        self._report_locked([self._location(page)], [])
