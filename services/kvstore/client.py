"""KVStoreClient: what the engine uses to put and get pages.

Same host: the store's arena file is mapped here and page bytes move by one memcpy into or out of
the mapping (Reserve, write, Commit / GetPage for the offset, copy). Another host (or when the file
cannot be verified): the bytes travel in PutPage / GetPage messages. The choice is made on first
use from GetInfo; `shared_memory=True/False` forces it.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc

from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.arena import HEADER_BYTES, MAP_FLAGS, ArenaError, parse_header
from services.kvstore.server import TOKEN_METADATA_KEY, meta_to_pb
from services.kvstore.store import (
    READ_LEASE_S,
    RESERVATION_TTL_S,
    InvalidPageError,
    KVStoreError,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    PageTooLargeError,
    ReservationError,
    StaleArenaError,
    StoreFullError,
    as_bytes_view,
)

logger = logging.getLogger(__name__)

__all__ = [
    "InvalidPageError",
    "KVStoreClient",
    "KVStoreError",
    "KVStoreUnavailable",
    "PageLocation",
    "PageMeta",
    "PageNotFoundError",
    "PageTooLargeError",
    "ReservationError",
    "SharedMemoryUnavailable",
    "StaleArenaError",
    "StoreFullError",
    "StoreInfo",
]


Metadata = tuple[tuple[str, str], ...]


class KVStoreUnavailable(KVStoreError):
    """The store cannot be reached (UNAVAILABLE or deadline exceeded)."""


class SharedMemoryUnavailable(KVStoreError):
    """shared_memory=True was asked for but the store's arena cannot be mapped and verified here."""


class StoreInfo(NamedTuple):
    replica_id: str
    arena_path: str
    arena_bytes: int
    used_bytes: int
    num_pages: int
    evictions: int


_ERROR_FOR_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPageError,
    grpc.StatusCode.NOT_FOUND: PageNotFoundError,
    grpc.StatusCode.OUT_OF_RANGE: PageTooLargeError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: StoreFullError,
    grpc.StatusCode.FAILED_PRECONDITION: ReservationError,
    grpc.StatusCode.ABORTED: StaleArenaError,
    grpc.StatusCode.UNAVAILABLE: KVStoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: KVStoreUnavailable,
}


def error_from_rpc(e: grpc.RpcError, address: str) -> KVStoreError:
    """The typed error for a failed call (its message is the store's, with the numbers)."""
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return _ERROR_FOR_CODE.get(code, KVStoreError)(f"kvstore {address}: {code.name}: {details}")


class _Mapping(NamedTuple):
    mm: mmap.mmap
    token_hex: str
    replica_id: str
    arena_bytes: int


def _location_from_pb(loc: kvstore_pb2.PageLocation) -> PageLocation:
    m = loc.meta
    return PageLocation(
        loc.found, loc.replica_id, loc.offset, PageMeta(m.page_hash, m.kv_format, m.num_tokens, m.nbytes)
    )


def map_arena(info: StoreInfo, token_hex: str) -> mmap.mmap:
    """Map the arena file named by info and check it is that store's (raises SharedMemoryUnavailable)."""
    if not token_hex:
        raise SharedMemoryUnavailable("the store sent no arena token")
    try:
        fd = os.open(info.arena_path, os.O_RDWR)
    except OSError as e:
        raise SharedMemoryUnavailable(f"cannot open {info.arena_path}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES + info.arena_bytes:
            raise SharedMemoryUnavailable(
                f"{info.arena_path} is {size} bytes, store says {HEADER_BYTES} + {info.arena_bytes}"
            )
        mm = mmap.mmap(fd, HEADER_BYTES + info.arena_bytes, flags=MAP_FLAGS)
    finally:
        os.close(fd)
    try:
        header = parse_header(mm[:HEADER_BYTES])
    except ArenaError as e:
        mm.close()
        raise SharedMemoryUnavailable(f"{info.arena_path}: {e}") from None
    if (header.token.hex(), header.replica_id, header.capacity) != (
        token_hex,
        info.replica_id,
        info.arena_bytes,
    ):
        mm.close()
        raise SharedMemoryUnavailable(
            f"{info.arena_path} belongs to another store: token {header.token.hex()} replica "
            f"{header.replica_id} capacity {header.capacity}, expected {token_hex} {info.replica_id} "
            f"{info.arena_bytes}"
        )
    return mm


class KVStoreClient:
    """Client of one kvstore replica. Thread-safe."""

    def __init__(self, address: str, shared_memory: bool | None = None, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._force_shared = shared_memory
        self._channel = grpc.insecure_channel(
            address,
            options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)],
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._lock = threading.Lock()
        self._resolved = False
        self._info: StoreInfo | None = None
        self._mapping: _Mapping | None = None

    # ---- public -------------------------------------------------------------------------------

    @property
    def shared_memory(self) -> bool:
        """Whether pages move through the mapped arena (resolved on first use)."""
        return self._ensure_resolved() is not None

    def info(self) -> StoreInfo:
        """The store's replica id, arena file, budget and counters."""
        return self._get_info()[0]

    def put_page(self, meta: PageMeta, data: bytes | bytearray | memoryview) -> PageLocation:
        """Store one page (no-op if present); through the mapped arena when shared."""
        src = as_bytes_view(data)
        if src.nbytes != meta.nbytes:
            raise InvalidPageError(f"page data is {src.nbytes} bytes, meta says {meta.nbytes}")
        mapping = self._ensure_resolved()
        assert self._info is not None
        if meta.nbytes > self._info.arena_bytes:
            raise PageTooLargeError(
                f"page of {meta.nbytes} bytes exceeds the store budget of {self._info.arena_bytes} bytes"
            )
        if mapping is not None:
            try:
                try:
                    return self._put_shared(mapping, meta, src)
                except StaleArenaError:
                    mapping = self._remap(mapping)
                    if mapping is not None:
                        return self._put_shared(mapping, meta, src)
            except ReservationError as e:  # expired while we were slow: send the bytes instead
                logger.warning("kvstore %s: shared put failed (%s); putting inline", self.address, e)
        return self._put_inline(meta, src)

    def get_page(self, page_hash: bytes) -> bytes:
        """The page's bytes; raises PageNotFoundError when the store does not hold it."""
        mapping = self._ensure_resolved()
        if mapping is not None:
            try:
                data = self._get_shared(mapping, page_hash)
            except StaleArenaError:
                mapping = self._remap(mapping)
                data = self._get_shared(mapping, page_hash) if mapping is not None else None
            if data is not None:
                return data
        response = self._call(self._stub.GetPage, kvstore_pb2.GetPageRequest(page_hash=page_hash, with_data=True))
        return bytes(response.data)

    def lookup(self, page_hashes: Sequence[bytes]) -> list[PageLocation]:
        """One location per hash, in order (found=False where the store lacks the page)."""
        response = self._call(self._stub.Lookup, kvstore_pb2.LookupRequest(page_hashes=list(page_hashes)))
        return [_location_from_pb(loc) for loc in response.locations]

    def close(self) -> None:
        """Close the channel and drop the arena mapping."""
        with self._lock:
            if self._mapping is not None:
                self._mapping.mm.close()
                self._mapping = None
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- paths ----------------------------------------------------------------------------------

    def _put_shared(self, mapping: _Mapping, meta: PageMeta, src: memoryview) -> PageLocation:
        md = ((TOKEN_METADATA_KEY, mapping.token_hex),)
        start = time.monotonic()
        r = self._call(self._stub.Reserve, kvstore_pb2.ReserveRequest(meta=meta_to_pb(meta)), md)
        if r.already_present:
            return PageLocation(True, mapping.replica_id, r.offset, meta)
        if time.monotonic() - start >= RESERVATION_TTL_S:  # too late to write safely: let it expire
            raise ReservationError(f"reservation {r.reservation_id} for {meta.page_hash.hex()} came back too late")
        mapping.mm[r.offset : r.offset + meta.nbytes] = src
        response = self._call(self._stub.Commit, kvstore_pb2.CommitRequest(reservation_id=r.reservation_id), md)
        return _location_from_pb(response.location)

    def _put_inline(self, meta: PageMeta, src: memoryview) -> PageLocation:
        data = src.obj if isinstance(src.obj, bytes) and len(src.obj) == src.nbytes else src.tobytes()
        request = kvstore_pb2.PutPageRequest(meta=meta_to_pb(meta), data=data)
        return _location_from_pb(self._call(self._stub.PutPage, request).location)

    def _get_shared(self, mapping: _Mapping, page_hash: bytes) -> bytes | None:
        """Copy the page out of the mapping; None when the read lease ran out (caller re-reads inline)."""
        md = ((TOKEN_METADATA_KEY, mapping.token_hex),)
        start = time.monotonic()
        response = self._call(self._stub.GetPage, kvstore_pb2.GetPageRequest(page_hash=page_hash), md)
        offset, nbytes = response.location.offset, response.location.meta.nbytes
        if offset + nbytes > len(mapping.mm):
            raise KVStoreError(f"page {page_hash.hex()} at [{offset}, {offset + nbytes}) is outside the mapped arena")
        data = mapping.mm[offset : offset + nbytes]
        elapsed_s = time.monotonic() - start
        if elapsed_s >= READ_LEASE_S:
            logger.warning(
                "shared read of %s took %.3fs (lease %.1fs): re-reading inline",
                page_hash.hex(),
                elapsed_s,
                READ_LEASE_S,
            )
            return None
        return data

    # ---- plumbing -------------------------------------------------------------------------------

    def _call(self, method: Callable[..., Any], request: Any, metadata: Metadata | None = None) -> Any:
        try:
            return method(request, timeout=self.timeout_s, metadata=metadata)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from None

    def _get_info(self) -> tuple[StoreInfo, str]:
        try:
            response, call = self._stub.GetInfo.with_call(kvstore_pb2.GetInfoRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from None
        token_hex = next((str(v) for k, v in call.initial_metadata() or () if k == TOKEN_METADATA_KEY), "")
        info = StoreInfo(
            response.replica_id,
            response.arena_path,
            response.arena_bytes,
            response.used_bytes,
            response.num_pages,
            response.evictions,
        )
        return info, token_hex

    def _ensure_resolved(self) -> _Mapping | None:
        if self._resolved:
            return self._mapping
        with self._lock:
            if not self._resolved:
                self._resolve_locked()
            return self._mapping

    def _resolve_locked(self) -> None:
        info, token_hex = self._get_info()
        self._info, self._mapping = info, None
        if self._force_shared is not False:
            try:
                mm = map_arena(info, token_hex)
                self._mapping = _Mapping(mm, token_hex, info.replica_id, info.arena_bytes)
                logger.info("kvstore %s: shared-memory path via %s", self.address, info.arena_path)
            except SharedMemoryUnavailable as e:
                if self._force_shared:
                    raise
                logger.info("kvstore %s: inline path (%s)", self.address, e)
        self._resolved = True

    def _remap(self, stale: _Mapping) -> _Mapping | None:
        """The store's arena changed (restart): map the new one (or fall back to inline)."""
        with self._lock:
            if self._mapping is stale:
                logger.warning("kvstore %s: arena token changed; remapping", self.address)
                self._resolve_locked()
            return self._mapping
