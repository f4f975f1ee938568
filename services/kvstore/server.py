"""The KVStore gRPC servicer (decode, call PageStore, encode) and `serve(config)`."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc

from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.arena import Arena
from services.kvstore.catalog import Catalog
from services.kvstore.config import KVStoreConfig
from services.kvstore.store import (
    InvalidPageError,
    PageLocation,
    PageMeta,
    PageNotFoundError,
    PageStore,
    PageTooLargeError,
    ReservationError,
    StaleArenaError,
    StoreFullError,
)

logger = logging.getLogger(__name__)

# GetInfo sends the arena token in this initial-metadata key; a same-host client sends it back on
# Reserve, Commit and GetPage so a stale mapping (store restarted) is refused rather than misused.
TOKEN_METADATA_KEY = "kvmem-arena-token"
_MAX_GRPC_MESSAGE = 2**31 - 1

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


def meta_from_pb(m: kvstore_pb2.PageMeta) -> PageMeta:
    return PageMeta(bytes(m.page_hash), m.kv_format, m.num_tokens, m.nbytes)


def meta_to_pb(meta: PageMeta) -> kvstore_pb2.PageMeta:
    return kvstore_pb2.PageMeta(
        page_hash=meta.page_hash, kv_format=meta.kv_format, num_tokens=meta.num_tokens, nbytes=meta.nbytes
    )


def location_to_pb(loc: PageLocation) -> kvstore_pb2.PageLocation:
    return kvstore_pb2.PageLocation(
        found=loc.found, replica_id=loc.replica_id, offset=loc.offset, meta=meta_to_pb(loc.meta)
    )


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


class KVStoreService:
    """A running kvstore: the gRPC server plus what it owns (store, arena, catalog registration)."""

    def __init__(self, config: KVStoreConfig, server: grpc.Server, store: PageStore, catalog: Catalog, port: int):
        self.config = config
        self.server = server
        self.store = store
        self.catalog = catalog
        self.port = port

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return bool(self.server.wait_for_termination(timeout))

    def stop(self, grace: float | None = 2.0) -> None:
        """Stop serving, unregister from redis (with every page entry), unlink the arena."""
        self.server.stop(grace).wait()
        self.catalog.unregister()
        self.catalog.close()
        self.store.arena.close()


def serve(config: KVStoreConfig) -> KVStoreService:
    """Create the arena, start the gRPC server on config.listen_addr and register in redis."""
    arena = Arena(config.arena_path, config.arena_bytes, config.replica_id)
    catalog = Catalog(
        config.redis_url, config.replica_id, config.advertise_addr, config.catalog_prefix, config.heartbeat_s
    )
    try:
        store = PageStore(arena, catalog)
        max_message = min(config.arena_bytes + (1 << 20), _MAX_GRPC_MESSAGE)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvstore-rpc"),
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
            ],
        )
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
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
    return KVStoreService(config, server, store, catalog, port)
