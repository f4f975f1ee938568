"""SlotAllocator: exact slot ids, states, prefix-cache reuse and LRU eviction order."""

from __future__ import annotations

import pytest

from services.engine.kv.slots import IntegrityError, PoolExhaustedError, SlotAllocator


def test_allocates_lowest_slots_first_and_exhausts() -> None:
    a = SlotAllocator(3)
    assert [a.allocate(), a.allocate(), a.allocate()] == [0, 1, 2]
    with pytest.raises(PoolExhaustedError):
        a.allocate()
    assert a.counts() == (3, 0, 3, 0)
    a.check_integrity()


def test_released_unhashed_slot_is_free_and_reused() -> None:
    a = SlotAllocator(2)
    s0 = a.allocate()
    a.release(s0)
    assert a.counts() == (2, 2, 0, 0)
    assert a.allocate() == s0


def test_finished_page_is_cached_then_reacquired_by_hash() -> None:
    a = SlotAllocator(2)
    s = a.allocate()
    assert a.register(s, b"h" * 16)
    a.release(s)
    assert a.counts() == (2, 1, 0, 1)
    assert a.lookup(b"h" * 16) == s
    a.acquire(s)
    assert a.counts() == (2, 1, 1, 0)
    a.acquire(s)  # a second sequence shares the page
    a.release(s)
    assert a.counts() == (2, 1, 1, 0)
    a.check_integrity()


def test_free_slots_are_used_before_cached_and_cached_evict_lru_first() -> None:
    a = SlotAllocator(3)
    s0, s1, s2 = a.allocate(), a.allocate(), a.allocate()
    a.register(s0, b"a" * 16)
    a.register(s1, b"b" * 16)
    a.release(s1)  # cached first -> evicted first
    a.release(s0)
    a.release(s2)  # unhashed -> free
    assert a.allocate() == s2
    assert a.allocate() == s1
    assert a.lookup(b"b" * 16) is None
    assert a.lookup(b"a" * 16) == s0
    a.check_integrity()


def test_register_refuses_a_duplicate_hash() -> None:
    a = SlotAllocator(2)
    s0, s1 = a.allocate(), a.allocate()
    assert a.register(s0, b"x" * 16)
    assert not a.register(s1, b"x" * 16)
    a.release(s1)
    assert a.counts().free == 1


def test_integrity_violation_names_the_numbers() -> None:
    a = SlotAllocator(2)
    a.allocate()
    a._free.append(0)  # corrupt on purpose: slot 0 is both owned and free
    with pytest.raises(IntegrityError, match=r"2 \+ 1 \+ 0 != 2"):
        a.check_integrity()
