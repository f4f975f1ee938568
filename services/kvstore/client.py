"""KVStoreClient: what the engine uses to put, get and pin pages of one kvstore replica.

Same host: the store's arena file is mapped here and page bytes move by one memcpy into the mapping
(Reserve(Pages), write, Commit(Pages)) and not at all out of it: `get_pages` returns read-only views
into the mapping, pinned until the batch is released, which a CUDA engine copies straight to the
device from the registered mapping (`arena_mapping`; `arena_mappings` maps it at once, as
KVStoreCluster's does for every replica, so an engine can register it at start-up). Another host
(or when the file cannot be verified): the bytes travel in PutPage(s) messages and a GetPagesStream.
The choice is made on first use (or that call) from GetInfo; `shared_memory=True/False` forces it.

Pins by owner (`pin`, `unpin`) are renewed by a keep-alive thread while this client is open, so
they lapse on the store `ttl_s` after the owning process dies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from services.common import auth
from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.mapping import ArenaMapping, Mapping, SharedMemoryUnavailable, StoreInfo, map_arena
from services.kvstore.pages import (
    InvalidPageError,
    KVStoreError,
    PageBatch,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    PageTooLargeError,
    ReservationError,
    StaleArenaError,
    StoreFullError,
    as_bytes_view,
)
from services.kvstore.server import TOKEN_METADATA_KEY, location_from_pb, meta_to_pb
from services.kvstore.store import PIN_TTL_S, READ_LEASE_S, RESERVATION_TTL_S

logger = logging.getLogger(__name__)

__all__ = [
    "ArenaMapping",
    "InvalidPageError",
    "KVStoreClient",
    "KVStoreError",
    "KVStoreRefused",
    "KVStoreUnavailable",
    "PageBatch",
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
PageData = bytes | bytearray | memoryview
DEFAULT_RENEW_S = 2.0  # how often pins taken with the store's default ttl are renewed
MAX_PUT_REQUEST_BYTES = 8 << 20  # PutPages requests are split near this (huge messages are slow in grpc)


class KVStoreUnavailable(KVStoreError):
    """The store cannot be reached (UNAVAILABLE or deadline exceeded)."""


class KVStoreRefused(KVStoreUnavailable):
    """The store answers but refuses this client (UNAUTHENTICATED, PERMISSION_DENIED: another deployment's
    internal secret). Unusable from here, as an unreachable one is: a cluster drops the replica (a store of another
    stack registered in the same redis must not take this engine's pages, nor stop its requests)."""


_ERROR_FOR_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidPageError,
    grpc.StatusCode.NOT_FOUND: PageNotFoundError,
    grpc.StatusCode.OUT_OF_RANGE: PageTooLargeError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: StoreFullError,
    grpc.StatusCode.FAILED_PRECONDITION: ReservationError,
    grpc.StatusCode.ABORTED: StaleArenaError,
    grpc.StatusCode.UNAVAILABLE: KVStoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: KVStoreUnavailable,
    grpc.StatusCode.UNAUTHENTICATED: KVStoreRefused,
    grpc.StatusCode.PERMISSION_DENIED: KVStoreRefused,
}


def error_from_rpc(e: grpc.RpcError, address: str) -> KVStoreError:
    """The typed error for a failed call (its message is the store's, with the numbers)."""
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return _ERROR_FOR_CODE.get(code, KVStoreError)(f"kvstore {address}: {code.name}: {details}")


def missing_error(page_hashes: Sequence[bytes], where: str) -> PageNotFoundError:
    shown = ", ".join(h.hex() for h in page_hashes[:4]) + (" ..." if len(page_hashes) > 4 else "")
    return PageNotFoundError(f"{len(page_hashes)} pages not in {where}: {shown}", tuple(page_hashes))


class KVStoreClient:
    """Client of one kvstore replica. Thread-safe."""

    def __init__(
        self, address: str, shared_memory: bool | None = None, timeout_s: float = 10.0, secret: str | None = None
    ) -> None:
        """`secret`: the internal secret its calls carry (None: this process's, auth.client_secret())."""
        self.address = address
        self.timeout_s = timeout_s
        self._force_shared = shared_memory
        self._channel = auth.channel(
            address, [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)], secret=secret
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._lock = threading.Lock()
        self._resolved = False
        self._info: StoreInfo | None = None
        self._mapping: Mapping | None = None
        self._keep_alive = _KeepAlive(self)

    # ---- public -------------------------------------------------------------------------------

    @property
    def shared_memory(self) -> bool:
        """Whether pages move through the mapped arena (resolved on first use)."""
        return self._ensure_resolved() is not None

    def info(self) -> StoreInfo:
        """The store's replica id, arena file, budget and counters."""
        return self._get_info()[0]

    def arena_mapping(self) -> ArenaMapping | None:
        """The mapped arena's address and size (to register as pinned memory), or None when remote."""
        mapping = self._ensure_resolved()
        return mapping.arena_mapping() if mapping is not None else None

    def arena_mappings(self) -> dict[str, ArenaMapping]:
        """KVStoreCluster.arena_mappings for one replica: {replica id: its arena}, mapped now if it was
        not yet (GetInfo, mmap), or {} when the store is on another host. Drop (or release the `view`
        of) what it returns: a live view keeps the arena mapped past close."""
        mapping = self.arena_mapping()
        return {mapping.replica_id: mapping} if mapping is not None else {}

    def put_page(self, meta: PageMeta, data: PageData) -> PageLocation:
        """Store one page (no-op if present); through the mapped arena when shared."""
        return self.put_pages([(meta, data)])[0]

    def put_pages(self, pages: Sequence[tuple[PageMeta, PageData]]) -> list[PageLocation]:
        """Store pages (present ones are no-ops), one location each: on the same host one ReservePages,
        a memcpy per page and one CommitPages; otherwise PutPages requests of about 8 MiB."""
        checked = [(meta, self._check_put(meta, data)) for meta, data in pages]
        if not checked:
            return []
        mapping = self._ensure_resolved()
        if mapping is not None:
            try:
                try:
                    return self._put_shared(mapping, checked)
                except StaleArenaError:
                    mapping = self._remap(mapping)
                    if mapping is not None:
                        return self._put_shared(mapping, checked)
            except ReservationError as e:  # expired while we were slow: send the bytes instead
                logger.warning("kvstore %s: shared put failed (%s); putting inline", self.address, e)
        return self._put_inline(checked)

    def get_page(self, page_hash: bytes) -> bytes:
        """A copy of the page's bytes; raises PageNotFoundError when the store does not hold it."""
        mapping = self._ensure_resolved()
        if mapping is not None:
            try:
                data = self._get_one_shared(mapping, page_hash)
            except StaleArenaError:
                mapping = self._remap(mapping)
                data = self._get_one_shared(mapping, page_hash) if mapping is not None else None
            if data is not None:
                return data
        response = self._call(self._stub.GetPage, kvstore_pb2.GetPageRequest(page_hash=page_hash, with_data=True))
        return bytes(response.data)

    def get_pages(
        self, page_hashes: Sequence[bytes], owner_id: str = "", missing_ok: bool = False, pin_ttl_s: float = 0.0
    ) -> PageBatch:
        """The pages, in order: zero-copy views into the mapped arena on the same host (pinned under
        owner_id, or a lease of the store's pin ttl when empty: release the batch before it ends), bytes
        otherwise. Missing pages raise PageNotFoundError (listing them), or are None with missing_ok."""
        if owner_id:
            self._keep_alive.add(owner_id, pin_ttl_s)
        mapping = self._ensure_resolved()
        if mapping is not None:
            try:
                batch = self._get_shared(mapping, page_hashes, owner_id, pin_ttl_s)
            except StaleArenaError:
                mapping = self._remap(mapping)
                batch = self._get_shared(mapping, page_hashes, owner_id, pin_ttl_s) if mapping else None
        else:
            batch = None
        if batch is None:
            batch = self._get_streamed(page_hashes)
        missing = [h for h, page in zip(page_hashes, batch, strict=True) if page is None]
        if missing and not missing_ok:
            batch.release()
            raise missing_error(missing, f"kvstore {self.address}")
        return batch

    def lookup(self, page_hashes: Sequence[bytes]) -> list[PageLocation]:
        """One location per hash, in order (found=False where the store lacks the page)."""
        response = self._call(self._stub.Lookup, kvstore_pb2.LookupRequest(page_hashes=list(page_hashes)))
        return [location_from_pb(loc) for loc in response.locations]

    def pin(self, owner_id: str, page_hashes: Sequence[bytes], ttl_s: float = 0.0) -> list[PageLocation]:
        """Pin the present pages for owner_id (one pin each); renewed by this client until unpinned or
        closed, so they lapse ttl_s (0: the store's default) after this process stops."""
        request = kvstore_pb2.PinRequest(owner_id=owner_id, page_hashes=list(page_hashes), ttl_s=ttl_s)
        locations = [location_from_pb(loc) for loc in self._call(self._stub.Pin, request).locations]
        if any(loc.found for loc in locations):
            self._keep_alive.add(owner_id, ttl_s)
        return locations

    def unpin(self, owner_id: str, page_hashes: Sequence[bytes] | None = None) -> int:
        """Drop one pin per listed page (every pin of owner_id when None); returns pages left unpinned."""
        if page_hashes is None:
            self._keep_alive.discard(owner_id)
        request = kvstore_pb2.UnpinRequest(owner_id=owner_id, page_hashes=list(page_hashes or ()))
        return int(self._call(self._stub.Unpin, request).num_unpinned)

    def renew(self, owner_id: str, ttl_s: float = 0.0) -> None:
        """Push owner_id's deadline ttl_s into the future (the keep-alive thread does this by itself)."""
        self._call(self._stub.Pin, kvstore_pb2.PinRequest(owner_id=owner_id, ttl_s=ttl_s))

    def close(self) -> None:
        """Stop renewing pins, close the channel and drop the arena mapping."""
        self._keep_alive.stop()
        with self._lock:
            if self._mapping is not None:
                self._mapping.close()
                self._mapping = None
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- paths ----------------------------------------------------------------------------------

    def _check_put(self, meta: PageMeta, data: PageData) -> memoryview:
        src = as_bytes_view(data)
        if src.nbytes != meta.nbytes:
            raise InvalidPageError(f"page data is {src.nbytes} bytes, meta says {meta.nbytes}")
        self._ensure_resolved()
        assert self._info is not None
        if meta.nbytes > self._info.arena_bytes:
            raise PageTooLargeError(
                f"page of {meta.nbytes} bytes exceeds the store budget of {self._info.arena_bytes} bytes"
            )
        return src

    def _put_shared(self, mapping: Mapping, pages: list[tuple[PageMeta, memoryview]]) -> list[PageLocation]:
        md = ((TOKEN_METADATA_KEY, mapping.token_hex),)
        start = time.monotonic()
        request = kvstore_pb2.ReservePagesRequest(metas=[meta_to_pb(meta) for meta, _ in pages])
        reservations = self._call(self._stub.ReservePages, request, md).reservations
        if time.monotonic() - start >= RESERVATION_TTL_S:  # too late to write safely: let them expire
            raise ReservationError(f"{len(pages)} reservations came back too late")
        for (meta, src), r in zip(pages, reservations, strict=True):
            if not r.already_present:
                mapping.mm[r.offset : r.offset + meta.nbytes] = src
        ids = [r.reservation_id for r in reservations if not r.already_present]
        committed = iter(
            self._call(self._stub.CommitPages, kvstore_pb2.CommitPagesRequest(reservation_ids=ids), md).locations
            if ids
            else ()
        )
        return [
            PageLocation(True, mapping.replica_id, r.offset, meta)
            if r.already_present
            else location_from_pb(next(committed))
            for (meta, _), r in zip(pages, reservations, strict=True)
        ]

    def _put_inline(self, pages: list[tuple[PageMeta, memoryview]]) -> list[PageLocation]:
        locations: list[PageLocation] = []
        request, request_bytes = kvstore_pb2.PutPagesRequest(), 0
        for meta, src in pages:
            if request.pages and request_bytes + meta.nbytes > MAX_PUT_REQUEST_BYTES:
                locations += self._send_puts(request)
                request, request_bytes = kvstore_pb2.PutPagesRequest(), 0
            data = src.obj if isinstance(src.obj, bytes) and len(src.obj) == src.nbytes else src.tobytes()
            request.pages.append(kvstore_pb2.PutPageRequest(meta=meta_to_pb(meta), data=data))
            request_bytes += meta.nbytes
        return locations + self._send_puts(request)

    def _send_puts(self, request: kvstore_pb2.PutPagesRequest) -> list[PageLocation]:
        return [location_from_pb(r.location) for r in self._call(self._stub.PutPages, request).results]

    def _get_shared(
        self, mapping: Mapping, page_hashes: Sequence[bytes], owner_id: str, pin_ttl_s: float
    ) -> PageBatch | None:
        """Views into the mapping, pinned; None when the pins may have lapsed (caller streams instead)."""
        md = ((TOKEN_METADATA_KEY, mapping.token_hex),)
        start = time.monotonic()
        request = kvstore_pb2.GetPagesRequest(page_hashes=list(page_hashes), owner_id=owner_id, pin_ttl_s=pin_ttl_s)
        response = self._call(self._stub.GetPages, request, md)
        locations = [location_from_pb(loc) for loc in response.locations]
        pinned = [loc.meta.page_hash for loc in locations if loc.found]
        pin_owner = response.owner_id

        def release() -> None:
            if pinned:
                try:
                    self.unpin(pin_owner, pinned)
                except KVStoreError as e:  # the pins lapse by themselves
                    logger.warning("kvstore %s: unpin of %d pages failed: %s", self.address, len(pinned), e)

        batch = PageBatch(
            [mapping.page_view(loc.offset, loc.meta.nbytes) if loc.found else None for loc in locations],
            locations,
            release,
        )
        if time.monotonic() - start >= (pin_ttl_s or PIN_TTL_S):
            logger.warning("shared get of %d pages took too long to trust the pins: streaming", len(pinned))
            batch.release()
            return None
        return batch

    def _get_one_shared(self, mapping: Mapping, page_hash: bytes) -> bytes | None:
        """Copy one page out of the mapping under a read lease; None when the lease ran out (re-read inline)."""
        md = ((TOKEN_METADATA_KEY, mapping.token_hex),)
        start = time.monotonic()
        response = self._call(self._stub.GetPage, kvstore_pb2.GetPageRequest(page_hash=page_hash), md)
        loc = response.location
        data = bytes(mapping.page_view(loc.offset, loc.meta.nbytes))
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

    def _get_streamed(self, page_hashes: Sequence[bytes]) -> PageBatch:
        """The pages' bytes through GetPagesStream (found=False pages are None)."""
        locations = [PageLocation(False, "", 0, PageMeta(h, "", 0, 0)) for h in page_hashes]
        chunks: list[list[bytes]] = [[] for _ in page_hashes]
        try:
            request = kvstore_pb2.GetPagesRequest(page_hashes=list(page_hashes))
            # the whole stream has one deadline: give big batches 50 ms a page on top
            stream = self._stub.GetPagesStream(request, timeout=self.timeout_s + 0.05 * len(page_hashes))
            for chunk in stream:
                if chunk.HasField("location"):
                    locations[chunk.index] = location_from_pb(chunk.location)
                if chunk.data:
                    chunks[chunk.index].append(chunk.data)
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from None
        pages = [
            (parts[0] if len(parts) == 1 else b"".join(parts)) if loc.found else None
            for loc, parts in zip(locations, chunks, strict=True)
        ]
        for loc, page in zip(locations, pages, strict=True):
            if page is not None and len(page) != loc.meta.nbytes:
                raise KVStoreError(f"page {loc.meta.page_hash.hex()}: got {len(page)} of {loc.meta.nbytes} bytes")
        return PageBatch(pages, locations)

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
        token_hex = response.arena_token.hex() or next(
            (str(v) for k, v in call.initial_metadata() or () if k == TOKEN_METADATA_KEY), ""
        )
        info = StoreInfo(
            response.replica_id,
            response.arena_path,
            response.arena_bytes,
            response.used_bytes,
            response.num_pages,
            response.evictions,
            response.num_cold_pages,
            response.cold_bytes,
            response.cold_raw_bytes,
            response.num_pinned_pages,
            response.num_compressed,
            response.num_restored,
        )
        return info, token_hex

    def _ensure_resolved(self) -> Mapping | None:
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
                self._mapping = map_arena(info, token_hex)
                logger.info("kvstore %s: shared-memory path via %s", self.address, info.arena_path)
            except SharedMemoryUnavailable as e:
                if self._force_shared:
                    raise
                logger.info("kvstore %s: inline path (%s)", self.address, e)
        self._resolved = True

    def _remap(self, stale: Mapping) -> Mapping | None:
        """The store's arena changed (restart): map the new one (or fall back to inline)."""
        with self._lock:
            if self._mapping is stale:
                logger.warning("kvstore %s: arena token changed; remapping", self.address)
                stale.close()
                self._resolve_locked()
            return self._mapping


class _KeepAlive:
    """Renews the pin owners a client holds pins for, every third of their ttl (every DEFAULT_RENEW_S
    for the store's default ttl, 30 s unless configured lower), while the client is open."""

    def __init__(self, client: KVStoreClient) -> None:
        self._client = client
        self._owner_ttl: dict[str, float] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def add(self, owner_id: str, ttl_s: float) -> None:
        with self._cond:
            if self._stopped:
                return
            old = self._owner_ttl.get(owner_id)
            if old is None or _renew_period(ttl_s) < _renew_period(old):
                self._owner_ttl[owner_id] = ttl_s  # renewed with the ttl that needs it most often
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvstore-pin-keepalive", daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, owner_id: str) -> None:
        with self._cond:
            self._owner_ttl.pop(owner_id, None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                period = min((_renew_period(t) for t in self._owner_ttl.values()), default=PIN_TTL_S)
                self._cond.wait(period)
                if self._stopped:
                    return
                owners = dict(self._owner_ttl)
            for owner_id, ttl_s in owners.items():
                try:
                    self._client.renew(owner_id, ttl_s)
                except KVStoreError as e:
                    logger.warning("kvstore %s: renewing pins of %s failed: %s", self._client.address, owner_id, e)


def _renew_period(ttl_s: float) -> float:
    return ttl_s / 3 if ttl_s else DEFAULT_RENEW_S
