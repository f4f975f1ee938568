"""PageStore pins by owner (eviction, counts, expiry, leases of get_many) and the cold tier
(compression in place, budget at compressed size, transparent restore), with exact numbers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.kvstore.arena import Arena, round_up
from services.kvstore.codec import PageCodec
from services.kvstore.store import (
    InvalidPageError,
    PageMeta,
    PageStore,
    StoreFullError,
    StoreIntegrityError,
)
from tests.kvstore.test_store import K4, Clock, RecordingCatalog, data, fill, h, meta

K16 = 16 * K4


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def catalog() -> RecordingCatalog:
    return RecordingCatalog()


@pytest.fixture
def store(tmp_path: Path, clock: Clock, catalog: RecordingCatalog) -> Iterator[PageStore]:
    """Four 4 KiB slots; pins last 5 s unless renewed."""
    arena = Arena(str(tmp_path / "arena"), 4 * K4, "r0")
    yield PageStore(arena, catalog, clock=clock, read_lease_s=2, pin_ttl_s=5)
    arena.close()


# ---- pins -----------------------------------------------------------------------------------------


def test_pinned_pages_are_never_evicted(store: PageStore) -> None:
    fill(store, [1, 2, 3, 4])
    locations = store.pin("engine-a", [h(1), h(2), h(9)])
    assert [loc.found for loc in locations] == [True, True, False]
    assert fill(store, [5, 6]) == [12288, 16384]  # 3 and 4 go; 1 and 2 are pinned
    assert store.page_hashes() == [h(1), h(2), h(5), h(6)]
    store.pin("engine-b", [h(5), h(6)])
    with pytest.raises(StoreFullError, match=r"4 pages pinned or leased \(4 pinned by 2 owners\)"):
        fill(store, [7])
    assert store.unpin("engine-a", [h(1)]) == 1
    assert fill(store, [7]) == [4096]  # 1 is evictable again
    s = store.stats()
    assert (s.num_pinned_pages, s.num_pin_owners, s.evictions) == (3, 2, 3)
    store.check_integrity()


def test_pins_are_counted_per_owner(store: PageStore) -> None:
    fill(store, [1, 2])
    store.pin("a", [h(1), h(1), h(2)])
    store.pin("b", [h(1)])
    assert store.owner_pins("a") == {h(1): 2, h(2): 1}
    assert store.unpin("a", [h(1)]) == 0  # a still holds one pin on 1, b another
    assert store.unpin("a", [h(1), h(2)]) == 1  # 2 is free; 1 is still b's
    assert store.owner_pins("a") == {}
    assert store.unpin("b") == 1
    assert store.unpin("nobody") == 0
    assert store.stats().num_pinned_pages == 0
    store.check_integrity()


def test_pins_expire_unless_renewed(store: PageStore, clock: Clock) -> None:
    fill(store, [1, 2, 3, 4])
    store.pin("engine", [h(1)])  # deadline +5
    clock.now += 4
    store.pin("engine", [])  # the heartbeat: deadline now +5 from here
    clock.now += 4
    assert fill(store, [5]) == [8192]  # 1 survives (pinned), 2 goes
    clock.now += 2  # 6 s after the last renewal
    assert fill(store, [6]) == [4096]  # the owner expired on this allocation: 1 goes
    s = store.stats()
    assert (s.num_pin_owners, s.expired_pin_owners, s.num_pinned_pages) == (0, 1, 0)
    store.check_integrity()


def test_get_many_pins_under_a_lease_or_an_owner(store: PageStore, clock: Clock) -> None:
    fill(store, [1, 2, 3])
    lease_id, locations = store.get_many([h(2), h(8), h(1)])
    assert lease_id.startswith("lease-")
    assert [(loc.found, loc.offset) for loc in locations] == [(True, 8192), (False, 0), (True, 4096)]
    assert store.owner_pins(lease_id) == {h(2): 1, h(1): 1}
    owner, _ = store.get_many([h(3)], owner_id="engine", ttl_s=60)
    assert owner == "engine"
    assert fill(store, [4, 5, 6]) == [16384] * 3  # 1, 2, 3 are pinned: the last slot turns over
    assert store.page_hashes() == [h(2), h(1), h(3), h(6)]
    assert store.unpin(lease_id) == 2
    clock.now += 10  # the lease would have expired anyway (ttl 5); the engine's pin (60) holds
    store.expire_pins()
    assert store.owner_pins("engine") == {h(3): 1}
    store.check_integrity()


def test_bad_owner_and_ttl_are_refused(store: PageStore) -> None:
    fill(store, [1])
    with pytest.raises(InvalidPageError, match="owner id must be 1..128 chars, got 0"):
        store.pin("", [h(1)])
    with pytest.raises(InvalidPageError, match=r"pin ttl must be in \[0, 3600.0\] s"):
        store.pin("a", [h(1)], ttl_s=-1)
    with pytest.raises(InvalidPageError, match="got 3"):
        store.get_many([b"abc"])
    assert store.stats().num_pinned_pages == 0


def test_integrity_catches_a_pin_on_an_absent_page(store: PageStore) -> None:
    fill(store, [1])
    store.pin("a", [h(1)])
    store._pins.pin("a", [h(7)], 1e9)  # books broken on purpose
    with pytest.raises(StoreIntegrityError, match="1 pinned pages absent"):
        store.check_integrity()


# ---- cold tier ------------------------------------------------------------------------------------


def kv_like(i: int, nbytes: int = K16) -> bytes:
    """fp32 values with bf16 precision (low 16 bits zero), like KV upcast from bf16: compresses about 2x."""
    values = np.random.default_rng(i).standard_normal(nbytes // 4).astype(np.float32)
    return (values.view(np.uint32) & 0xFFFF0000).astype(np.uint32).tobytes()


def kv_meta(i: int, nbytes: int = K16) -> PageMeta:
    return PageMeta(h(i), "fp32", 64, nbytes)


@pytest.fixture
def cold_store(tmp_path: Path, clock: Clock, catalog: RecordingCatalog) -> Iterator[PageStore]:
    """Four 64 KiB pages of room; pages untouched for 10 s are compressed."""
    arena = Arena(str(tmp_path / "arena"), 4 * K16, "r0")
    yield PageStore(arena, catalog, clock=clock, read_lease_s=2, cold_after_s=10, codec=PageCodec())
    arena.close()


def test_cold_pages_are_compressed_in_place_and_count_their_compressed_size(
    cold_store: PageStore, clock: Clock, catalog: RecordingCatalog
) -> None:
    store, codec = cold_store, PageCodec()
    for i in range(1, 4):
        store.put(kv_meta(i), kv_like(i))
    store.put(kv_meta(4), np.random.default_rng(4).bytes(K16))  # noise: does not shrink
    clock.now += 5
    store.read(h(1))
    clock.now += 6  # 2, 3, 4 untouched for 11 s; 1 for 6 s
    assert store.compress_cold() == 2
    blobs = {i: codec.compress(memoryview(kv_like(i)), "fp32") for i in (2, 3)}
    assert all(len(b) < K16 * 0.6 for b in blobs.values())
    found = store.lookup([h(i) for i in range(1, 5)])
    assert [loc.cold for loc in found] == [False, True, True, False]
    # the arena was full: 2 was compressed in place (its slot's tail freed), 3 went into that tail
    # and its own slot was freed
    tail = 4096 + K16 + round_up(len(blobs[2]))
    assert [loc.offset for loc in found] == [4096, 4096 + K16, tail, 4096 + 3 * K16]
    s = store.stats()
    assert (s.num_cold_pages, s.cold_bytes, s.cold_raw_bytes) == (2, sum(map(len, blobs.values())), 2 * K16)
    assert s.used_bytes == 2 * K16 + sum(round_up(len(b)) for b in blobs.values())
    assert catalog.events[-2:] == [("+", h(2)), ("+", h(3))]  # moves are published
    store.check_integrity()
    assert store.compress_cold() == 0  # 4 is marked incompressible, 1 is not cold yet


def test_cold_page_restores_byte_for_byte_and_warms(cold_store: PageStore, clock: Clock) -> None:
    store = cold_store
    for i in (1, 2):
        store.put(kv_meta(i), kv_like(i))
    clock.now += 11
    assert store.compress_cold() == 2
    assert store.read(h(1))[1] == kv_like(1)
    location = store.get(h(2))
    assert not location.cold
    with store.arena.view(location.offset, K16) as v:
        assert bytes(v) == kv_like(2)
    s = store.stats()
    assert (s.num_cold_pages, s.num_restored, s.used_bytes) == (0, 2, 2 * K16)
    store.check_integrity()


def test_compression_makes_room_without_evicting(cold_store: PageStore, clock: Clock) -> None:
    store = cold_store
    for i in range(1, 5):
        store.put(kv_meta(i), kv_like(i))
    clock.now += 11
    assert store.compress_cold() == 4
    for i in range(5, 7):  # two more full pages fit in what compression gave back
        store.put(kv_meta(i), kv_like(i))
    s = store.stats()
    assert (s.num_pages, s.evictions, s.num_cold_pages) == (6, 0, 4)
    store.check_integrity()
    # restoring needs a full slot again: the least recently used page that can go, goes
    _, got = store.read(h(3))
    assert got == kv_like(3)
    assert store.stats().evictions >= 1
    assert h(3) in store.page_hashes()
    for page_hash in store.page_hashes():
        i = next(i for i in range(1, 7) if h(i) == page_hash)
        assert store.read(page_hash)[1] == kv_like(i)
    store.check_integrity()


def test_pinned_leased_and_recent_pages_stay_warm(cold_store: PageStore, clock: Clock) -> None:
    store = cold_store
    for i in range(1, 4):
        store.put(kv_meta(i), kv_like(i))
    store.pin("engine", [h(1)])
    clock.now += 11
    store.get(h(2))  # leased for 2 s (and touched)
    assert store.compress_cold() == 1  # only 3
    clock.now += 30  # lease over, 2 untouched for 30 s; the pin on 1 is renewed
    store.pin("engine", [])
    assert store.compress_cold() == 1  # 2
    assert [loc.cold for loc in store.lookup([h(1), h(2), h(3)])] == [False, True, True]
    store.check_integrity()


def test_no_cold_tier_without_cold_after(store: PageStore, clock: Clock) -> None:
    fill(store, [1])
    clock.now += 1e6
    assert store.compress_cold() == 0
    assert store.read(h(1))[1] == data(1)
    assert meta(1).nbytes == K4


def test_a_failed_restore_leaves_no_pins_behind(cold_store: PageStore, clock: Clock) -> None:
    store = cold_store
    for i in range(1, 5):
        store.put(kv_meta(i), kv_like(i))
    clock.now += 11
    assert store.compress_cold() == 4
    for i in (5, 6):
        store.put(kv_meta(i), kv_like(i))
    store.pin("engine", [h(i) for i in range(1, 7)])  # nothing may go: no room to restore 1
    with pytest.raises(StoreFullError, match="6 pinned by 2 owners"):
        store.get_many([h(5), h(1)], owner_id="reader")
    assert store.owner_pins("reader") == {}
    assert store.unpin("engine") == 6
    _, locations = store.get_many([h(5), h(1)], owner_id="reader")
    assert [loc.cold for loc in locations] == [False, False]
    assert store.owner_pins("reader") == {h(5): 1, h(1): 1}
    store.check_integrity()
