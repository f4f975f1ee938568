"""Batched puts and gets, pins and the cold tier against a real kvstore process, on both data paths:
shared memory (views into the mapped arena) and bytes over gRPC (PutPages, GetPagesStream)."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
import pytest
import torch

from services.kvstore.arena import HEADER_BYTES
from services.kvstore.client import KVStoreClient, PageMeta, PageNotFoundError, StoreFullError
from tests.conftest import StartStore
from tests.kvstore.test_server import page, wait_for

KIB = 1024


def kv_page(i: int, nbytes: int) -> tuple[PageMeta, bytes]:
    """A bf16 page of normal values (its exponent plane compresses)."""
    g = torch.Generator().manual_seed(i)
    data = torch.randn(nbytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return PageMeta(i.to_bytes(16, "big"), "bf16", 64, nbytes), data


@pytest.mark.parametrize("shared_memory", [True, False])
def test_batched_put_and_get_byte_for_byte(start_store: StartStore, shared_memory: bool) -> None:
    store = start_store(host_kv_mib=64)
    pages = [page(i, 700_000 + i) for i in range(8)] + [page(99, 9 << 20)]  # the last one streams in 3 chunks
    with KVStoreClient(store.address, shared_memory=shared_memory) as client:
        assert client.shared_memory is shared_memory
        locations = client.put_pages(pages)
        assert [loc.meta for loc in locations] == [m for m, _ in pages]
        assert all(loc.found and loc.replica_id == store.replica_id for loc in locations)
        again = client.put_pages(pages[:2])  # present pages: no-ops, same places
        assert [loc.offset for loc in again] == [loc.offset for loc in locations[:2]]
        hashes = [m.page_hash for m, _ in reversed(pages)]
        with client.get_pages(hashes) as batch:
            assert [bytes(x) for x in batch] == [d for _, d in reversed(pages)]  # type: ignore[arg-type]
            kinds = {type(x) for x in batch}
            assert kinds == ({memoryview} if shared_memory else {bytes})
            if shared_memory:
                assert all(x.readonly for x in batch)  # type: ignore[union-attr]
                assert client.info().num_pinned_pages == 9  # pinned while the batch is held
        assert client.info().num_pinned_pages == 0
        assert client.info().num_pages == 9


@pytest.mark.parametrize("shared_memory", [True, False])
def test_batched_get_reports_missing_pages(start_store: StartStore, shared_memory: bool) -> None:
    store = start_store()
    (m1, d1), (m2, d2) = page(1, 5000), page(2, 6000)
    absent = (77).to_bytes(16, "big")
    with KVStoreClient(store.address, shared_memory=shared_memory) as client:
        client.put_pages([(m1, d1), (m2, d2)])
        with pytest.raises(PageNotFoundError, match=f"1 pages not in kvstore .*{absent.hex()}") as e:
            client.get_pages([m1.page_hash, absent, m2.page_hash])
        assert e.value.page_hashes == (absent,)
        assert client.info().num_pinned_pages == 0  # what was pinned was released
        with client.get_pages([m1.page_hash, absent, m2.page_hash], missing_ok=True) as batch:
            assert [None if x is None else bytes(x) for x in batch] == [d1, None, d2]
            assert [loc.found for loc in batch.locations] == [True, False, True]
        assert client.get_pages([]) == []


def test_views_come_from_the_registered_mapping(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=8)
    with KVStoreClient(store.address, shared_memory=True) as client:
        meta, data = page(5, 100_000)
        client.put_page(meta, data)
        mapping = client.arena_mapping()
        assert mapping is not None
        assert (mapping.nbytes, mapping.replica_id) == (HEADER_BYTES + (8 << 20), store.replica_id)
        with client.get_pages([meta.page_hash], owner_id="engine-7") as batch:
            offset = batch.locations[0].offset
            assert ctypes.string_at(mapping.address + offset, meta.nbytes) == data  # what cudaHostRegister sees
            restored = torch.empty(meta.nbytes, dtype=torch.uint8)
            restored.numpy()[:] = np.frombuffer(batch[0], dtype=np.uint8)  # type: ignore[arg-type]
            assert restored.numpy().tobytes() == data
        assert client.info().num_pinned_pages == 0
    with KVStoreClient(store.address, shared_memory=False) as remote:
        assert remote.arena_mapping() is None


def test_pins_hold_pages_under_a_tiny_budget(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=1)  # four 256 KiB slots
    with KVStoreClient(store.address, shared_memory=False) as client:
        pages = [page(i, 256 * KIB) for i in range(10)]
        client.put_pages(pages[:4])
        pinned = [pages[0][0].page_hash, pages[1][0].page_hash]
        assert [loc.found for loc in client.pin("engine-1", pinned)] == [True, True]
        client.put_pages(pages[4:7])  # 2, 3, 4, 5 come and go; 0 and 1 stay
        found = [loc.found for loc in client.lookup([m.page_hash for m, _ in pages])]
        assert found == [True, True, False, False, False, True, True, False, False, False]
        client.pin("engine-2", [pages[5][0].page_hash, pages[6][0].page_hash])
        with pytest.raises(StoreFullError, match="nothing evictable: 4 pages pinned or leased"):
            client.put_page(*pages[7])
        assert client.unpin("engine-1") == 2
        client.put_page(*pages[7])
        assert client.get_page(pages[5][0].page_hash) == pages[5][1]
        info = client.info()
        assert (info.num_pages, info.num_pinned_pages, info.used_bytes) == (4, 2, 1 << 20)


def test_pins_lapse_when_the_owner_stops_renewing(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=1)
    pages = [page(i, 256 * KIB) for i in range(8)]
    with KVStoreClient(store.address) as writer:
        writer.put_pages(pages[:4])
    alive = KVStoreClient(store.address)
    crashed = KVStoreClient(store.address)
    alive.pin("engine-alive", [pages[0][0].page_hash], ttl_s=1.0)
    crashed.pin("engine-crashed", [pages[1][0].page_hash], ttl_s=1.0)
    crashed.close()  # stops renewing, as a dead process would
    time.sleep(2.0)  # two ttls: the keep-alive of `alive` renewed it about six times
    alive.put_pages(pages[4:7])  # needs three slots: 1 is evictable again, 0 is not
    found = [loc.found for loc in alive.lookup([m.page_hash for m, _ in pages])]
    assert found == [True, False, False, False, True, True, True, False]
    assert alive.info().num_pinned_pages == 1
    alive.close()


def test_cold_tier_round_trip_byte_for_byte(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=16, args=["--cold-after-s", "0.3"])
    pages = [kv_page(i, 512 * KIB) for i in range(6)]
    with KVStoreClient(store.address) as client:
        client.put_pages(pages)
        wait_for(lambda: client.info().num_cold_pages == 6, timeout_s=10)
        info = client.info()
        assert info.cold_raw_bytes == 6 * 512 * KIB
        assert info.cold_raw_bytes / info.cold_bytes > 1.3  # bf16: the exponent plane shrinks
        assert info.used_bytes < 6 * 512 * KIB * 0.8  # the budget counts compressed bytes
        assert all(loc.cold for loc in client.lookup([m.page_hash for m, _ in pages]))
        with client.get_pages([m.page_hash for m, _ in pages[:3]]) as batch:  # restored transparently
            assert [bytes(x) for x in batch] == [d for _, d in pages[:3]]  # type: ignore[arg-type]
        with KVStoreClient(store.address, shared_memory=False) as remote:
            got = remote.get_pages([m.page_hash for m, _ in pages[3:]])
            assert [bytes(x) for x in got] == [d for _, d in pages[3:]]  # type: ignore[arg-type]
        info = client.info()
        assert info.num_restored == 6 and info.num_compressed >= 6
    assert os.path.exists(store.arena_path)
