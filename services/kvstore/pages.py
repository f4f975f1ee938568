"""What the kvstore's modules and clients share about pages: value types, typed errors, validation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple

from services.common.pagehash import HASH_BYTES

MAX_KV_FORMAT_CHARS = 64
MAX_OWNER_ID_CHARS = 128


class KVStoreError(Exception):
    """Base of the store's typed errors; messages carry the numbers."""


class InvalidPageError(KVStoreError):
    """Malformed request: hash length, sizes, data length, owner id, or meta differing from the stored page."""


class PageNotFoundError(KVStoreError):
    """No committed page with this hash (`page_hashes` lists the missing ones when known)."""

    def __init__(self, message: str, page_hashes: tuple[bytes, ...] = ()) -> None:
        super().__init__(message)
        self.page_hashes = page_hashes


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
    offset: int  # byte offset in the arena file (of the compressed bytes when cold)
    meta: PageMeta
    cold: bool = False  # held compressed; a get restores it first


class Reservation(NamedTuple):
    already_present: bool  # nothing to write: `offset` is the stored page
    offset: int
    reservation_id: str  # "" when already_present


class PutResult(NamedTuple):
    location: PageLocation
    already_present: bool


def missing_location(replica_id: str, page_hash: bytes) -> PageLocation:
    """The location reported for a page the store does not hold."""
    return PageLocation(False, replica_id, 0, PageMeta(page_hash, "", 0, 0))


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


def check_owner_id(owner_id: str) -> None:
    """Raise InvalidPageError unless owner_id is 1..MAX_OWNER_ID_CHARS characters."""
    if not 1 <= len(owner_id) <= MAX_OWNER_ID_CHARS:
        raise InvalidPageError(f"owner id must be 1..{MAX_OWNER_ID_CHARS} chars, got {len(owner_id)}")


def as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of data (C-contiguous buffers of any item format)."""
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PageBatch(list[memoryview | bytes | None]):
    """get_pages' answer: one entry per requested hash, in order: a read-only view into the mapped
    arena (same host: pinned until `release`), page bytes (from another host), or None for a page
    that is missing (only with missing_ok). Use it as a context manager, or call release()."""

    def __init__(
        self,
        items: Iterable[memoryview | bytes | None],
        locations: Iterable[PageLocation] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(items)
        self.locations = list(locations)  # where each page was (found=False for the None entries)
        self._release = release

    @property
    def num_bytes(self) -> int:
        return sum(len(x) for x in self if x is not None)

    def release(self) -> None:
        """Unpin what this batch pinned (idempotent); its views must not be read afterwards."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> PageBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
