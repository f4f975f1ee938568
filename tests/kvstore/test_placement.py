"""HashRing: deterministic placement, balance, and minimal movement when membership changes."""

from __future__ import annotations

import hashlib

import pytest

from services.kvstore.placement import EmptyRingError, HashRing

PAGES = [hashlib.blake2b(i.to_bytes(4, "big"), digest_size=16).digest() for i in range(3000)]


def shares(ring: HashRing) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in PAGES:
        out[ring.owner(h)] = out.get(ring.owner(h), 0) + 1
    return out


def test_placement_is_deterministic_and_balanced() -> None:
    a, b = HashRing(["r0", "r1", "r2"]), HashRing(["r2", "r0", "r1"])
    assert [a.owner(h) for h in PAGES] == [b.owner(h) for h in PAGES]
    counts = shares(a)
    assert set(counts) == {"r0", "r1", "r2"}
    assert all(600 < n < 1400 for n in counts.values()), counts  # 1000 each on average


def test_removing_a_replica_moves_only_its_pages() -> None:
    ring = HashRing(["r0", "r1", "r2"])
    smaller = ring.without("r1")
    for h in PAGES:
        if ring.owner(h) != "r1":
            assert smaller.owner(h) == ring.owner(h)
        else:
            assert smaller.owner(h) in {"r0", "r2"}


def test_adding_a_replica_moves_pages_only_to_it() -> None:
    ring, bigger = HashRing(["r0", "r1", "r2"]), HashRing(["r0", "r1", "r2", "r3"])
    moved = [h for h in PAGES if bigger.owner(h) != ring.owner(h)]
    assert all(bigger.owner(h) == "r3" for h in moved)
    assert 400 < len(moved) < 1100  # about a quarter


def test_owners_are_distinct_and_start_with_the_owner() -> None:
    ring = HashRing(["r0", "r1", "r2"], vnodes=8)
    for h in PAGES[:100]:
        owners = ring.owners(h, 3)
        assert owners[0] == ring.owner(h) and sorted(owners) == ["r0", "r1", "r2"]
    assert HashRing(["solo"]).owners(PAGES[0], 3) == ["solo"]


def test_empty_ring() -> None:
    with pytest.raises(EmptyRingError, match="no kvstore replica is alive"):
        HashRing([]).owner(PAGES[0])
    with pytest.raises(ValueError, match="vnodes must be >= 1"):
        HashRing(["r0"], vnodes=0)
