"""The KVStore gRPC servicer (decode, call PageStore, encode) and `serve(config)`."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc

from services.common import auth, health
from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.arena import Arena, sweep_stale_arenas
from services.kvstore.catalog import Catalog
from services.kvstore.codec import PageCodec
from services.kvstore.config import KVStoreConfig
from services.kvstore.pages import (
    InvalidPageError,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    PageTooLargeError,
    ReservationError,
    StaleArenaError,
    StoreFullError,
    check_hash,
)
from services.kvstore.store import PageStore

logger = logging.getLogger(__name__)

# GetInfo sends the arena token in this initial-metadata key; a same-host client sends it back on
# Reserve, Commit and GetPage so a stale mapping (store restarted) is refused rather than misused.
TOKEN_METADATA_KEY = "kvmem-arena-token"
_MAX_GRPC_MESSAGE = 2**31 - 1
STREAM_CHUNK_BYTES = 4 << 20  # GetPagesStream splits pages into chunks of at most this many bytes

_T = TypeVar("_T")


def status_code_for(exc: Exception) -> grpc.StatusCode:
    """The one mapping from the store's typed errors to gRPC status codes."""
    for exc_type, code in (
        (InvalidPageError, grpc.StatusCode.INVALID_ARGUMENT),
        (PageNotFoundError, grpc.StatusCode.NOT_FOUND),
        (PageTooLargeError, grpc.StatusCode.OUT_OF_RANGE),
        (StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (ReservationError, grpc.StatusCode.FAILED_PRECONDITION),
        (StaleArenaError, grpc.StatusCode.ABORTED),
    ):
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


def _rpc(
    method: Callable[[Any, Any, grpc.ServicerContext], _T],
) -> Callable[[Any, Any, grpc.ServicerContext], _T]:
    """Turn exceptions into a status (typed ones with their message, others as INTERNAL)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> _T:
        try:
            return method(self, request, context)
        except Exception as e:
            code = status_code_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method.__name__)
                context.abort(code, f"internal error in {method.__name__} ({type(e).__name__}); see kvstore log")
            logger.debug("%s: %s %s", method.__name__, code.name, e)
            context.abort(code, str(e))
            raise  # context.abort raises; this line is not reached

    return wrapper


def _rpc_stream(
    method: Callable[[Any, Any, grpc.ServicerContext], Iterator[_T]],
) -> Callable[[Any, Any, grpc.ServicerContext], Iterator[_T]]:
    """`_rpc` for server-streaming methods (errors raised while iterating become a status too)."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[_T]:
        try:
            yield from method(self, request, context)
        except Exception as e:
            code = status_code_for(e)
            if code == grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method.__name__)
                context.abort(code, f"internal error in {method.__name__} ({type(e).__name__}); see kvstore log")
            context.abort(code, str(e))

    return wrapper


def meta_from_pb(m: kvstore_pb2.PageMeta) -> PageMeta:
    return PageMeta(bytes(m.page_hash), m.kv_format, m.num_tokens, m.nbytes)


def meta_to_pb(meta: PageMeta) -> kvstore_pb2.PageMeta:
    return kvstore_pb2.PageMeta(
        page_hash=meta.page_hash, kv_format=meta.kv_format, num_tokens=meta.num_tokens, nbytes=meta.nbytes
    )


def location_to_pb(loc: PageLocation) -> kvstore_pb2.PageLocation:
    return kvstore_pb2.PageLocation(
        found=loc.found, replica_id=loc.replica_id, offset=loc.offset, meta=meta_to_pb(loc.meta), cold=loc.cold
    )


def location_from_pb(loc: kvstore_pb2.PageLocation) -> PageLocation:
    m = loc.meta
    return PageLocation(
        loc.found, loc.replica_id, loc.offset, PageMeta(m.page_hash, m.kv_format, m.num_tokens, m.nbytes), loc.cold
    )


def page_chunks(index: int, location: PageLocation, data: bytes) -> Iterator[kvstore_pb2.PageChunk]:
    """A page's stream messages: the location with the first chunk of bytes, then the rest."""
    view = memoryview(data)
    yield kvstore_pb2.PageChunk(
        index=index, location=location_to_pb(location), offset=0, data=bytes(view[:STREAM_CHUNK_BYTES])
    )
    for start in range(STREAM_CHUNK_BYTES, len(data), STREAM_CHUNK_BYTES):
        yield kvstore_pb2.PageChunk(index=index, offset=start, data=bytes(view[start : start + STREAM_CHUNK_BYTES]))


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """Thin gRPC edge over a PageStore."""

    def __init__(self, store: PageStore) -> None:
        self._store = store

    def _check_token(self, context: grpc.ServicerContext) -> None:
        for key, value in context.invocation_metadata():
            if key == TOKEN_METADATA_KEY:
                try:
                    token = bytes.fromhex(str(value))
                except ValueError:
                    token = b""
                self._store.check_arena_token(token)

    @_rpc
    def GetInfo(
        self, request: kvstore_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.GetInfoResponse:
        context.send_initial_metadata(((TOKEN_METADATA_KEY, self._store.arena.token.hex()),))
        s = self._store.stats()
        return kvstore_pb2.GetInfoResponse(
            replica_id=self._store.replica_id,
            arena_path=self._store.arena.path,
            arena_bytes=s.arena_bytes,
            used_bytes=s.used_bytes,
            num_pages=s.num_pages,
            evictions=s.evictions,
            arena_token=self._store.arena.token,
            num_cold_pages=s.num_cold_pages,
            cold_bytes=s.cold_bytes,
            cold_raw_bytes=s.cold_raw_bytes,
            num_pinned_pages=s.num_pinned_pages,
            num_compressed=s.num_compressed,
            num_restored=s.num_restored,
        )

    @_rpc
    def Reserve(
        self, request: kvstore_pb2.ReserveRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.ReserveResponse:
        self._check_token(context)
        r = self._store.reserve(meta_from_pb(request.meta))
        return kvstore_pb2.ReserveResponse(
            already_present=r.already_present, offset=r.offset, reservation_id=r.reservation_id
        )

    @_rpc
    def Commit(self, request: kvstore_pb2.CommitRequest, context: grpc.ServicerContext) -> kvstore_pb2.CommitResponse:
        self._check_token(context)
        return kvstore_pb2.CommitResponse(location=location_to_pb(self._store.commit(request.reservation_id)))

    @_rpc
    def PutPage(
        self, request: kvstore_pb2.PutPageRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.PutPageResponse:
        r = self._store.put(meta_from_pb(request.meta), request.data)
        return kvstore_pb2.PutPageResponse(location=location_to_pb(r.location), already_present=r.already_present)

    @_rpc
    def GetPage(
        self, request: kvstore_pb2.GetPageRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.GetPageResponse:
        if request.with_data:
            location, data = self._store.read(bytes(request.page_hash))
            return kvstore_pb2.GetPageResponse(location=location_to_pb(location), data=data)
        self._check_token(context)
        return kvstore_pb2.GetPageResponse(location=location_to_pb(self._store.get(bytes(request.page_hash))))

    @_rpc
    def Lookup(self, request: kvstore_pb2.LookupRequest, context: grpc.ServicerContext) -> kvstore_pb2.LookupResponse:
        locations = self._store.lookup([bytes(h) for h in request.page_hashes])
        return kvstore_pb2.LookupResponse(locations=[location_to_pb(loc) for loc in locations])

    @_rpc
    def ReservePages(
        self, request: kvstore_pb2.ReservePagesRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.ReservePagesResponse:
        self._check_token(context)
        made = self._store.reserve_many([meta_from_pb(m) for m in request.metas])
        return kvstore_pb2.ReservePagesResponse(
            reservations=[
                kvstore_pb2.ReserveResponse(
                    already_present=r.already_present, offset=r.offset, reservation_id=r.reservation_id
                )
                for r in made
            ]
        )

    @_rpc
    def CommitPages(
        self, request: kvstore_pb2.CommitPagesRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.CommitPagesResponse:
        self._check_token(context)
        locations = [self._store.commit(r) for r in request.reservation_ids]
        return kvstore_pb2.CommitPagesResponse(locations=[location_to_pb(loc) for loc in locations])

    @_rpc
    def PutPages(
        self, request: kvstore_pb2.PutPagesRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.PutPagesResponse:
        results = [self._store.put(meta_from_pb(p.meta), p.data) for p in request.pages]
        return kvstore_pb2.PutPagesResponse(
            results=[
                kvstore_pb2.PutPageResponse(location=location_to_pb(r.location), already_present=r.already_present)
                for r in results
            ]
        )

    @_rpc
    def GetPages(
        self, request: kvstore_pb2.GetPagesRequest, context: grpc.ServicerContext
    ) -> kvstore_pb2.GetPagesResponse:
        self._check_token(context)
        owner_id, locations = self._store.get_many(
            [bytes(h) for h in request.page_hashes], request.owner_id, request.pin_ttl_s
        )
        return kvstore_pb2.GetPagesResponse(locations=[location_to_pb(loc) for loc in locations], owner_id=owner_id)

    @_rpc_stream
    def GetPagesStream(
        self, request: kvstore_pb2.GetPagesRequest, context: grpc.ServicerContext
    ) -> Iterator[kvstore_pb2.PageChunk]:
        page_hashes = [bytes(h) for h in request.page_hashes]
        for h in page_hashes:
            check_hash(h)
        for index, h in enumerate(page_hashes):
            try:
                location, data = self._store.read(h)
            except PageNotFoundError:
                yield kvstore_pb2.PageChunk(index=index, location=location_to_pb(self._store.lookup([h])[0]))
                continue
            yield from page_chunks(index, location, data)

    @_rpc
    def Pin(self, request: kvstore_pb2.PinRequest, context: grpc.ServicerContext) -> kvstore_pb2.PinResponse:
        locations = self._store.pin(request.owner_id, [bytes(h) for h in request.page_hashes], request.ttl_s)
        return kvstore_pb2.PinResponse(locations=[location_to_pb(loc) for loc in locations])

    @_rpc
    def Unpin(self, request: kvstore_pb2.UnpinRequest, context: grpc.ServicerContext) -> kvstore_pb2.UnpinResponse:
        page_hashes = [bytes(h) for h in request.page_hashes] or None
        return kvstore_pb2.UnpinResponse(num_unpinned=self._store.unpin(request.owner_id, page_hashes))


class Maintenance:
    """The store's background thread: expires unrenewed pins and compresses cold pages."""

    def __init__(self, store: PageStore, interval_s: float) -> None:
        self._store = store
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-maintenance", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._store.expire_pins()
                while self._store.compress_cold() and not self._stop.is_set():
                    pass
            except Exception:  # keep serving; the next round tries again
                logger.exception("maintenance round failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class KVStoreService:
    """A running kvstore: the gRPC server plus what it owns (store, arena, catalog registration)."""

    def __init__(
        self,
        config: KVStoreConfig,
        server: grpc.Server,
        store: PageStore,
        catalog: Catalog,
        port: int,
        maintenance: Maintenance,
        redis_probe: health.RedisProbe | None = None,
    ):
        self.config = config
        self.server = server
        self.store = store
        self.catalog = catalog
        self.port = port
        self.maintenance = maintenance
        self.redis_probe = redis_probe

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return bool(self.server.wait_for_termination(timeout))

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop serving, unregister from redis (with every page entry), unlink the arena."""
        self.server.stop(grace).wait()
        self.maintenance.stop()
        if self.redis_probe is not None:
            self.redis_probe.close()
        self.catalog.unregister()
        self.catalog.close()
        self.store.arena.close()


def serve(config: KVStoreConfig) -> KVStoreService:
    """Create the arena, start the gRPC server on config.listen_addr and register in redis."""
    sweep_stale_arenas(config.arena_dir)
    arena = Arena(config.arena_path, config.arena_bytes, config.replica_id)
    catalog = Catalog(
        config.redis_url, config.replica_id, config.advertise_addr, config.catalog_prefix, config.heartbeat_s
    )
    try:
        store = PageStore(
            arena,
            catalog,
            pin_ttl_s=config.pin_ttl_s,
            cold_after_s=config.cold_after_s or None,
            codec=PageCodec(config.zstd_level),
        )
        catalog.pages_source = lambda: store.lookup(store.page_hashes())
        max_message = min(config.arena_bytes + (1 << 20), _MAX_GRPC_MESSAGE)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvstore-rpc"),
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
            ],
            interceptors=auth.server_interceptors(config.internal_secret),
        )
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
        health_servicer = health.add_health(server)
        port = server.add_insecure_port(config.listen_addr)
        if port == 0:
            raise OSError(f"cannot listen on {config.listen_addr}")
        server.start()
        try:
            catalog.register()
        except BaseException:
            server.stop(None)
            raise
    except BaseException:
        catalog.close()
        arena.close()
        raise
    probe = health.RedisProbe(config.redis_url, health.redis_status_setter(health_servicer))
    return KVStoreService(config, server, store, catalog, port, Maintenance(store, config.maintenance_s), probe)
