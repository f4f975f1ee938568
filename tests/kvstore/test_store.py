"""PageStore: exact offsets, LRU order, leases and pins, reservations and their expiry, errors."""

from __future__ import annotations

import array
import hashlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from services.kvstore.arena import Arena
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
    StoreIntegrityError,
)

K4 = 4096


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class RecordingCatalog:
    """Collects the store's catalog updates in order (the redis one is tested in test_server)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, bytes]] = []

    def update(self, added: Sequence[PageLocation], removed: Sequence[bytes]) -> None:
        self.events += [("-", h) for h in removed] + [("+", loc.meta.page_hash) for loc in added]


def h(i: int) -> bytes:
    return hashlib.blake2b(bytes([i]), digest_size=16).digest()


def meta(i: int, nbytes: int = K4) -> PageMeta:
    return PageMeta(h(i), "fp32", 64, nbytes)


def data(i: int, nbytes: int = K4) -> bytes:
    return bytes([i % 256]) * nbytes


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def catalog() -> RecordingCatalog:
    return RecordingCatalog()


@pytest.fixture
def store(tmp_path: Path, clock: Clock, catalog: RecordingCatalog) -> Iterator[PageStore]:
    """Four 4 KiB slots; reservation ttl 10 s + grace 10 s; read lease 2 s."""
    arena = Arena(str(tmp_path / "arena"), 4 * K4, "r0")
    yield PageStore(arena, catalog, clock=clock, reservation_ttl_s=10, reservation_grace_s=10, read_lease_s=2)
    arena.close()


def fill(store: PageStore, ids: Sequence[int]) -> list[int]:
    return [store.put(meta(i), data(i)).location.offset for i in ids]


def test_put_get_read_lookup(store: PageStore, catalog: RecordingCatalog) -> None:
    assert fill(store, [1, 2]) == [4096, 8192]
    loc, got = store.read(h(2))
    assert got == data(2)
    assert loc == PageLocation(True, "r0", 8192, meta(2))
    assert store.get(h(1)) == PageLocation(True, "r0", 4096, meta(1))
    found = store.lookup([h(1), h(9), h(2)])
    assert [(x.found, x.offset) for x in found] == [(True, 4096), (False, 0), (True, 8192)]
    assert found[1].meta.page_hash == h(9)
    assert catalog.events == [("+", h(1)), ("+", h(2))]
    s = store.stats()
    assert (s.num_pages, s.used_bytes, s.num_reservations, s.evictions) == (2, 2 * K4, 0, 0)
    store.check_integrity()


def test_put_of_present_page_is_a_no_op(store: PageStore, catalog: RecordingCatalog) -> None:
    fill(store, [1])
    r = store.put(meta(1), data(1))
    assert r.already_present and r.location.offset == 4096
    assert store.stats().used_bytes == K4
    assert catalog.events == [("+", h(1))]
    with pytest.raises(InvalidPageError, match="is stored as"):
        store.put(PageMeta(h(1), "bf16", 64, K4), data(1))


def test_put_accepts_typed_buffers(store: PageStore) -> None:
    floats = array.array("f", [1.5] * (K4 // 4))
    store.put(meta(1), memoryview(floats))
    assert store.read(h(1))[1] == floats.tobytes()


@pytest.mark.parametrize(
    ("bad_meta", "payload", "message"),
    [
        (PageMeta(b"x" * 15, "fp32", 64, 10), b"x" * 10, "page hash must be 16 bytes, got 15"),
        (PageMeta(h(1), "fp32", 64, 0), b"", "nbytes must be >= 1, got 0"),
        (PageMeta(h(1), "fp32", 0, 10), b"x" * 10, "num_tokens must be >= 1, got 0"),
        (PageMeta(h(1), "", 64, 10), b"x" * 10, "kv_format must be 1..64 chars, got 0"),
        (PageMeta(h(1), "fp32", 64, 10), b"x" * 9, "page data is 9 bytes, meta says 10"),
    ],
)
def test_invalid_pages_are_refused(store: PageStore, bad_meta: PageMeta, payload: bytes, message: str) -> None:
    with pytest.raises(InvalidPageError, match=message):
        store.put(bad_meta, payload)
    assert store.stats().used_bytes == 0


def test_bad_hash_on_reads(store: PageStore) -> None:
    for call in (store.get, store.read, lambda x: store.lookup([h(1), x])):
        with pytest.raises(InvalidPageError, match="got 3"):
            call(b"abc")
    with pytest.raises(PageNotFoundError, match=h(5).hex()):
        store.read(h(5))


def test_page_larger_than_budget(store: PageStore) -> None:
    with pytest.raises(PageTooLargeError, match=f"page of {4 * K4 + 1} bytes exceeds the store budget of {4 * K4}"):
        store.put(meta(1, 4 * K4 + 1), data(1, 4 * K4 + 1))
    with pytest.raises(PageTooLargeError):
        store.reserve(meta(1, 4 * K4 + 1))
    store.put(meta(2, 4 * K4), data(2, 4 * K4))  # exactly the budget fits


def test_lru_eviction_order_and_slot_reuse(store: PageStore, catalog: RecordingCatalog) -> None:
    fill(store, [1, 2, 3, 4])
    store.read(h(1))  # 1 becomes most recently used
    store.lookup([h(2)])  # a lookup does not touch
    assert fill(store, [5]) == [8192]  # evicts 2, reuses its slot
    assert store.page_hashes() == [h(3), h(4), h(1), h(5)]
    store.put(meta(3), data(3))  # present: touched
    assert fill(store, [6]) == [16384]  # evicts 4
    assert catalog.events[-4:] == [("-", h(2)), ("+", h(5)), ("-", h(4)), ("+", h(6))]
    assert store.stats().evictions == 2
    assert not store.lookup([h(2)])[0].found
    assert store.read(h(5))[1] == data(5)
    store.check_integrity()


def test_bigger_page_evicts_until_a_run_is_free(store: PageStore, catalog: RecordingCatalog) -> None:
    fill(store, [1, 2, 3, 4])
    store.read(h(3))
    # LRU order 1, 2, 4, 3: evicting 1 frees 4 KiB, evicting 2 frees the adjacent 4 KiB: one run.
    assert store.put(meta(9, 2 * K4), data(9, 2 * K4)).location.offset == 4096
    assert [e for e in catalog.events if e[0] == "-"] == [("-", h(1)), ("-", h(2))]
    assert store.page_hashes() == [h(4), h(3), h(9)]
    assert fill(store, [5, 6]) == [16384, 12288]  # 4 goes (top slot, back to bump), then 3
    store.check_integrity()


def test_leased_pages_are_not_evicted(store: PageStore, clock: Clock) -> None:
    fill(store, [1, 2, 3, 4])
    store.get(h(1))
    store.get(h(2))
    store.lookup([h(3)])
    clock.now += 1.0  # leases of 1 and 2 run until +2.0
    fill(store, [5])  # evicts 3 (1 and 2 are leased; order was 3, 4, 1, 2)
    assert store.page_hashes() == [h(4), h(1), h(2), h(5)]
    store.get(h(4))
    store.get(h(5))
    with pytest.raises(StoreFullError, match="no room for 4096 bytes and nothing evictable: 4 pages"):
        fill(store, [6])
    clock.now += 1.5  # leases of 1 and 2 are over, 4 and 5 still run
    fill(store, [6])
    assert store.page_hashes() == [h(2), h(4), h(5), h(6)]
    store.check_integrity()


def test_reservations_are_invisible_until_committed(store: PageStore, catalog: RecordingCatalog) -> None:
    r = store.reserve(meta(1))
    assert (r.already_present, r.offset) == (False, 4096)
    assert not store.lookup([h(1)])[0].found
    with pytest.raises(PageNotFoundError):
        store.get(h(1))
    assert catalog.events == []
    with store.arena.view(r.offset, K4) as v:
        v[:] = data(1)
    assert store.commit(r.reservation_id) == PageLocation(True, "r0", 4096, meta(1))
    assert catalog.events == [("+", h(1))]
    assert store.read(h(1))[1] == data(1)
    again = store.reserve(meta(1))
    assert (again.already_present, again.offset, again.reservation_id) == (True, 4096, "")
    with pytest.raises(ReservationError, match="unknown reservation"):
        store.commit(r.reservation_id)
    store.check_integrity()


def test_reservations_hold_their_slot_and_are_not_evicted(store: PageStore) -> None:
    reservations = [store.reserve(meta(i)) for i in range(4)]
    assert [r.offset for r in reservations] == [4096, 8192, 12288, 16384]
    with pytest.raises(StoreFullError, match="4 reservations, 16384 of 16384 bytes used"):
        store.reserve(meta(9))
    assert store.stats().num_reservations == 4


def test_expired_reservation_cannot_commit_and_slot_returns_after_grace(store: PageStore, clock: Clock) -> None:
    r = store.reserve(meta(1))
    fill(store, [2, 3, 4])
    clock.now += 10.5
    with pytest.raises(ReservationError, match=r"expired 0\.500s ago \(ttl 10"):
        store.commit(r.reservation_id)
    clock.now += 5  # within grace: the slot may still be written by the late client
    assert fill(store, [5]) == [8192]  # so page 2 is evicted instead
    assert store.stats().num_reservations == 1
    clock.now += 5  # past ttl + grace
    assert fill(store, [6]) == [4096]  # the expired reservation's slot
    s = store.stats()
    assert (s.num_reservations, s.expired_reservations, s.evictions) == (0, 1, 1)
    with pytest.raises(ReservationError, match="unknown reservation"):
        store.commit(r.reservation_id)
    store.check_integrity()


def test_concurrent_reservations_of_one_page(store: PageStore, catalog: RecordingCatalog) -> None:
    a, b = store.reserve(meta(1)), store.reserve(meta(1))
    assert (a.offset, b.offset) == (4096, 8192)
    with store.arena.view(b.offset, K4) as v:
        v[:] = data(1)
    assert store.commit(b.reservation_id).offset == 8192
    assert store.commit(a.reservation_id).offset == 8192  # first commit won; a's slot is freed
    assert catalog.events == [("+", h(1))]
    s = store.stats()
    assert (s.num_pages, s.num_reservations, s.used_bytes) == (1, 0, K4)
    store.check_integrity()


def test_integrity_error_carries_the_numbers(store: PageStore) -> None:
    fill(store, [1, 2])
    del store._page_table[h(1)]  # lose a page on purpose
    with pytest.raises(StoreIntegrityError, match=r"1 \+ 0 slots \(1 distinct, 4096 bytes\) != 2 slots \(8192 bytes\)"):
        store.check_integrity()


def test_arena_token_check(store: PageStore) -> None:
    store.check_arena_token(store.arena.token)
    with pytest.raises(StaleArenaError, match="client mapped arena token 00"):
        store.check_arena_token(b"\0" * 16)


def test_concurrent_puts_and_reads_keep_the_books(tmp_path: Path) -> None:
    # 16 slots: the other 3 threads block at most 3 x 8 KiB (in-flight puts or pinned reads), which
    # leaves 40 KiB in at most 4 runs, so an 8 KiB page always finds a free run after eviction.
    arena = Arena(str(tmp_path / "arena"), 16 * K4, "r0")
    store = PageStore(arena)
    errors: list[BaseException] = []

    def worker(first: int) -> None:
        try:
            for i in range(first, first + 200):
                store.put(meta(i % 256, K4 * (1 + i % 2)), data(i % 256, K4 * (1 + i % 2)))
                try:
                    loc, got = store.read(h((i * 7) % 256))
                    assert got == data(got[0], loc.meta.nbytes) and got[0] == (i * 7) % 256
                except PageNotFoundError:
                    pass
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t * 50,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store.check_integrity()
    for page_hash in store.page_hashes():
        loc, got = store.read(page_hash)
        assert got == data(got[0], loc.meta.nbytes)
    arena.close()
