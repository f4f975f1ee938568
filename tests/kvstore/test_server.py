"""The kvstore as a real process (python -m services.kvstore) against a real redis."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis

from services.common.protos import kvstore_pb2, kvstore_pb2_grpc
from services.kvstore.catalog import Catalog
from services.kvstore.client import (
    KVStoreClient,
    KVStoreUnavailable,
    PageMeta,
    PageNotFoundError,
    PageTooLargeError,
    SharedMemoryUnavailable,
)
from services.kvstore.server import TOKEN_METADATA_KEY
from services.kvstore.store import PageLocation
from tests.conftest import REPO_ROOT, StartStore, Store, free_port, stop_store

KIB = 1024


@pytest.fixture
def store(start_store: StartStore) -> Store:
    return start_store()


def catalog_for(store: Store, redis_url: str) -> Catalog:
    return Catalog(redis_url, "reader", "none", prefix=store.prefix)


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Catalog writes are asynchronous (a writer thread): poll for the expected state."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def page(i: int, nbytes: int) -> tuple[PageMeta, bytes]:
    data = os.urandom(nbytes)
    return PageMeta(i.to_bytes(16, "big"), "bf16", 64, nbytes), data


def test_put_get_both_paths_byte_for_byte(store: Store, redis_url: str) -> None:
    shared = KVStoreClient(store.address, shared_memory=True)
    inline = KVStoreClient(store.address, shared_memory=False)
    auto = KVStoreClient(store.address)
    assert (shared.shared_memory, inline.shared_memory, auto.shared_memory) == (True, False, True)
    pages = [page(i, 1_500_000 + i) for i in range(4)]
    for i, (meta, data) in enumerate(pages):
        loc = (shared if i % 2 == 0 else inline).put_page(meta, data)
        assert (loc.found, loc.replica_id, loc.meta) == (True, store.replica_id, meta)
    for meta, data in pages:
        assert shared.get_page(meta.page_hash) == data
        assert inline.get_page(meta.page_hash) == data
    # the shared-memory put really wrote into the arena file, where the location says
    loc0 = inline.lookup([pages[0][0].page_hash])[0]
    with open(store.arena_path, "rb") as f:
        f.seek(loc0.offset)
        assert f.read(loc0.meta.nbytes) == pages[0][1]
    # putting a present page again is a no-op on either path
    assert shared.put_page(*pages[1]).offset == inline.put_page(*pages[1]).offset
    info = auto.info()
    assert (info.replica_id, info.arena_path, info.arena_bytes) == (store.replica_id, store.arena_path, 64 << 20)
    assert (info.num_pages, info.evictions) == (4, 0)
    assert info.used_bytes == sum(-(-m.nbytes // 4096) * 4096 for m, _ in pages)
    catalog = catalog_for(store, redis_url)
    wait_for(lambda: all(catalog.entry(m.page_hash) is not None for m, _ in pages))
    entry = catalog.entry(pages[2][0].page_hash)
    assert entry is not None
    assert (entry.replica_id, entry.nbytes, entry.kv_format, entry.num_tokens) == (
        store.replica_id,
        1_500_002,
        "bf16",
        64,
    )
    assert catalog.where(pages[2][0].page_hash) == store.address
    for c in (shared, inline, auto):
        c.close()


def test_lookup_in_order(store: Store) -> None:
    with KVStoreClient(store.address) as client:
        (m1, d1), (m2, d2) = page(1, 10_000), page(2, 20_000)
        client.put_page(m1, d1)
        client.put_page(m2, d2)
        missing = (99).to_bytes(16, "big")
        found = client.lookup([m2.page_hash, missing, m1.page_hash])
        assert [(x.found, x.meta.nbytes) for x in found] == [(True, 20_000), (False, 0), (True, 10_000)]
        assert found[1].meta.page_hash == missing
        assert client.lookup([]) == []
        with pytest.raises(PageNotFoundError, match=missing.hex()):
            client.get_page(missing)


def test_eviction_under_a_tiny_budget(start_store: StartStore, redis_url: str) -> None:
    store = start_store(host_kv_mib=1)  # four 256 KiB slots
    catalog = catalog_for(store, redis_url)
    with KVStoreClient(store.address, shared_memory=False) as client:
        pages = [page(i, 256 * KIB) for i in range(6)]
        offsets = [client.put_page(m, d).offset for m, d in pages[:4]]
        assert offsets == [4096 + i * 256 * KIB for i in range(4)]
        client.get_page(pages[0][0].page_hash)  # 0 becomes most recently used
        assert client.put_page(*pages[4]).offset == offsets[1]  # evicts 1
        assert client.put_page(*pages[5]).offset == offsets[2]  # evicts 2
        found = client.lookup([m.page_hash for m, _ in pages])
        assert [x.found for x in found] == [True, False, False, True, True, True]
        with pytest.raises(PageNotFoundError):
            client.get_page(pages[1][0].page_hash)
        assert client.get_page(pages[5][0].page_hash) == pages[5][1]
        info = client.info()
        assert (info.num_pages, info.evictions, info.used_bytes) == (4, 2, 1 << 20)
    present = [True, False, False, True, True, True]
    wait_for(lambda: [catalog.entry(m.page_hash) is not None for m, _ in pages] == present)
    wait_for(lambda: catalog.entry(pages[5][0].page_hash) is not None)
    assert catalog.where(pages[1][0].page_hash) is None


def test_bad_input_gets_status_codes_and_the_store_keeps_serving(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=1)
    channel = grpc.insecure_channel(store.address)
    stub = kvstore_pb2_grpc.KVStoreStub(channel)
    good = kvstore_pb2.PageMeta(page_hash=b"h" * 16, kv_format="bf16", num_tokens=64, nbytes=4)

    def code_of(call: Callable[[], object]) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert "Traceback" not in e.value.details()
        return e.value.code()

    short_hash = kvstore_pb2.PageMeta(page_hash=b"h" * 15, kv_format="bf16", num_tokens=64, nbytes=4)
    huge = kvstore_pb2.PageMeta(page_hash=b"g" * 16, kv_format="bf16", num_tokens=64, nbytes=(1 << 20) + 1)
    cases = {
        "put short hash": (lambda: stub.PutPage(kvstore_pb2.PutPageRequest(meta=short_hash, data=b"1234"))),
        "put no meta": (lambda: stub.PutPage(kvstore_pb2.PutPageRequest(data=b"1234"))),
        "put wrong length": (lambda: stub.PutPage(kvstore_pb2.PutPageRequest(meta=good, data=b"123"))),
        "get short hash": (lambda: stub.GetPage(kvstore_pb2.GetPageRequest(page_hash=b"abc", with_data=True))),
        "lookup short hash": (lambda: stub.Lookup(kvstore_pb2.LookupRequest(page_hashes=[b"h" * 16, b"x"]))),
        "put oversize": (lambda: stub.PutPage(kvstore_pb2.PutPageRequest(meta=huge, data=b"\0" * huge.nbytes))),
        "reserve oversize": (lambda: stub.Reserve(kvstore_pb2.ReserveRequest(meta=huge))),
        "commit unknown": (lambda: stub.Commit(kvstore_pb2.CommitRequest(reservation_id="nope"))),
        "get missing": (lambda: stub.GetPage(kvstore_pb2.GetPageRequest(page_hash=b"m" * 16))),
        "reserve stale token": (
            lambda: stub.Reserve(kvstore_pb2.ReserveRequest(meta=good), metadata=((TOKEN_METADATA_KEY, "00" * 16),))
        ),
    }
    codes = {name: code_of(call) for name, call in cases.items()}
    assert codes == {
        "put short hash": grpc.StatusCode.INVALID_ARGUMENT,
        "put no meta": grpc.StatusCode.INVALID_ARGUMENT,
        "put wrong length": grpc.StatusCode.INVALID_ARGUMENT,
        "get short hash": grpc.StatusCode.INVALID_ARGUMENT,
        "lookup short hash": grpc.StatusCode.INVALID_ARGUMENT,
        "put oversize": grpc.StatusCode.OUT_OF_RANGE,
        "reserve oversize": grpc.StatusCode.OUT_OF_RANGE,
        "commit unknown": grpc.StatusCode.FAILED_PRECONDITION,
        "get missing": grpc.StatusCode.NOT_FOUND,
        "reserve stale token": grpc.StatusCode.ABORTED,
    }
    assert store.proc.poll() is None
    put = stub.PutPage(kvstore_pb2.PutPageRequest(meta=good, data=b"1234"))
    assert put.location.found and not put.already_present
    assert stub.GetPage(kvstore_pb2.GetPageRequest(page_hash=b"h" * 16, with_data=True)).data == b"1234"
    info = stub.GetInfo(kvstore_pb2.GetInfoRequest())
    assert (info.num_pages, info.used_bytes) == (1, 4096)
    channel.close()
    with KVStoreClient(store.address) as client:  # the client refuses oversize pages itself
        with pytest.raises(PageTooLargeError, match="exceeds the store budget of 1048576"):
            client.put_page(*page(7, (1 << 20) + 1))


def test_start_failures_exit_cleanly(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "services.kvstore", "--arena-dir", str(tmp_path), "--replica-id", "x"]
    bad = subprocess.run([*base, "--host-kv-mib", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2
    assert "host_kv_mib must be >= 1, got 0" in bad.stderr
    no_redis = subprocess.run(
        [*base, "--listen-addr", f"127.0.0.1:{free_port()}", "--redis-url", f"redis://127.0.0.1:{free_port()}/0"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert no_redis.returncode == 1
    assert "kvstore failed to start: ConnectionError" in no_redis.stderr
    assert "Traceback" not in no_redis.stderr
    assert list(tmp_path.iterdir()) == []  # the arena file was unlinked


def test_client_errors_without_a_store() -> None:
    with KVStoreClient(f"127.0.0.1:{free_port()}", timeout_s=1.0) as client:
        with pytest.raises(KVStoreUnavailable, match="UNAVAILABLE"):
            client.info()


def test_forced_shared_memory_needs_the_arena_file(store: Store) -> None:
    os.rename(store.arena_path, store.arena_path + ".moved")  # as if the store were on another host
    try:
        with KVStoreClient(store.address, shared_memory=True) as forced:
            with pytest.raises(SharedMemoryUnavailable, match="cannot open"):
                forced.put_page(*page(1, 100))
        with KVStoreClient(store.address) as auto:
            meta, data = page(2, 100)
            auto.put_page(meta, data)
            assert not auto.shared_memory
            assert auto.get_page(meta.page_hash) == data
    finally:
        os.rename(store.arena_path + ".moved", store.arena_path)


def test_sigterm_unregisters_and_unlinks(store: Store, redis_url: str) -> None:
    catalog = catalog_for(store, redis_url)
    with KVStoreClient(store.address) as client:
        meta, data = page(1, 5000)
        client.put_page(meta, data)
    wait_for(lambda: catalog.where(meta.page_hash) == store.address)
    assert catalog.replicas() == {store.replica_id: store.address}
    assert stop_store(store) == 0
    assert not os.path.exists(store.arena_path)
    assert catalog.replicas() == {}
    assert catalog.entry(meta.page_hash) is None
    r = redis.Redis.from_url(redis_url)
    assert r.keys(f"{store.prefix}*") == []
    assert any("kvstore stopped" in line for line in store.lines)


def test_client_remaps_after_store_restart(start_store: StartStore, caplog: pytest.LogCaptureFixture) -> None:
    first = start_store()
    with KVStoreClient(first.address, shared_memory=True) as client:
        (m1, d1), (m2, d2) = page(1, 300_000), page(2, 300_000)
        client.put_page(m1, d1)
        assert stop_store(first) == 0
        second = start_store(port=int(first.address.rsplit(":", 1)[1]), replica_id=first.replica_id)
        client.put_page(m2, d2)  # the old mapping is refused (ABORTED), the client maps the new arena
        assert client.shared_memory
        assert "arena token changed; remapping" in caplog.text
        assert client.get_page(m2.page_hash) == d2
        with pytest.raises(PageNotFoundError):
            client.get_page(m1.page_hash)
        assert client.info().num_pages == 1
    assert second.proc.poll() is None


# ---- catalog against the real redis ----------------------------------------------------------------


def test_catalog_owner_only_removal_and_restart_cleanup(redis_url: str) -> None:
    prefix = f"kvmem-test-{uuid.uuid4().hex[:8]}:"

    def loc(replica: str, i: int) -> PageLocation:
        return PageLocation(True, replica, 4096 * i, PageMeta(i.to_bytes(16, "big"), "fp32", 64, 100))

    a = Catalog(redis_url, "a", "host-a:1", prefix=prefix, heartbeat_s=0.2)
    b = Catalog(redis_url, "b", "host-b:1", prefix=prefix, heartbeat_s=0.2)
    a2 = Catalog(redis_url, "a", "host-a:2", prefix=prefix, heartbeat_s=0.2)
    try:
        _exercise_catalogs(a, b, a2, loc)
    finally:
        for c in (a, b, a2):
            c.close()
    assert redis.Redis.from_url(redis_url).keys(f"{prefix}*") == []


def _exercise_catalogs(a: Catalog, b: Catalog, a2: Catalog, loc: Callable[[str, int], PageLocation]) -> None:
    a.register()
    b.register()
    a.update([loc("a", 1), loc("a", 2)], [])
    assert a.flush()
    b.update([loc("b", 2)], [])  # b registers page 2 later: the entry now names b
    assert b.flush()
    assert (a.where((1).to_bytes(16, "big")), a.where((2).to_bytes(16, "big"))) == ("host-a:1", "host-b:1")
    a.update([], [(2).to_bytes(16, "big")])  # a evicts its copy: b's entry must stay
    assert a.flush()
    assert a.where((2).to_bytes(16, "big")) == "host-b:1"
    assert a.replicas() == {"a": "host-a:1", "b": "host-b:1"}
    # a crashes (no unregister); a new run of replica a clears what the old one left
    a.close()
    a2.register()
    assert a2.entry((1).to_bytes(16, "big")) is None
    assert a2.where((2).to_bytes(16, "big")) == "host-b:1"
    # b stops beating: its pages are not reported as available
    b._stop.set()
    wait_for(lambda: a2.where((2).to_bytes(16, "big")) is None, timeout_s=3)
    assert set(a2.replicas()) == {"a"}
    b.unregister()
    a2.unregister()
