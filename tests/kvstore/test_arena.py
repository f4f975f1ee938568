"""Arena: header, exact slot offsets, free-list order, trimming, integrity, file lifecycle."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.kvstore.arena import (
    HEADER_BYTES,
    Arena,
    ArenaError,
    ArenaIntegrityError,
    parse_header,
    round_up,
)

K4 = 4096


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[Arena]:
    """A 16-slot (64 KiB) arena."""
    a = Arena(str(tmp_path / "kvmem-arena-t"), 16 * K4, "t")
    yield a
    a.close()


def test_header_identifies_the_file(arena: Arena) -> None:
    raw = Path(arena.path).read_bytes()
    assert len(raw) == HEADER_BYTES + 16 * K4
    header = parse_header(raw[:HEADER_BYTES])
    assert (header.replica_id, header.token, header.capacity) == ("t", arena.token, 16 * K4)
    assert len(arena.token) == 16


def test_parse_header_rejects_other_files() -> None:
    with pytest.raises(ArenaError, match="not a kvmem arena"):
        parse_header(b"\0" * HEADER_BYTES)
    with pytest.raises(ArenaError, match="needs"):
        parse_header(b"KVMEM")


def test_round_up_to_size_class() -> None:
    assert [round_up(n) for n in (1, 4095, 4096, 4097, 8192)] == [4096, 4096, 4096, 8192, 8192]


def test_bump_offsets_are_exact(arena: Arena) -> None:
    assert arena.alloc(1) == 4096
    assert arena.alloc(4096) == 8192
    assert arena.alloc(4097) == 12288  # 8 KiB class
    assert arena.alloc(100) == 20480
    s = arena.stats()
    assert (s.used_bytes, s.free_list_bytes, s.unused_bytes, s.num_used) == (5 * K4, 0, 11 * K4, 4)
    arena.check_integrity()


def test_free_list_is_last_freed_first(arena: Arena) -> None:
    small = [arena.alloc(K4) for _ in range(4)]
    assert small == [4096, 8192, 12288, 16384]
    assert arena.alloc(2 * K4) == 20480  # keeps the small slots below the bump pointer
    arena.free(8192, K4)
    arena.free(4096, K4)
    arena.free(16384, K4)
    assert arena.stats().free_list_bytes == 3 * K4
    assert [arena.alloc(K4) for _ in range(4)] == [16384, 4096, 8192, 28672]
    arena.check_integrity()


def test_freeing_the_top_slots_returns_them_to_the_bump_region(arena: Arena) -> None:
    a, b, c = arena.alloc(K4), arena.alloc(K4), arena.alloc(2 * K4)
    assert (a, b, c) == (4096, 8192, 12288)
    arena.free(8192, K4)  # b is not at the top: goes to the free list
    assert arena.stats().free_list_bytes == K4
    arena.free(12288, 2 * K4)  # at the top: trims c, then b (now at the top too)
    s = arena.stats()
    assert (s.used_bytes, s.free_list_bytes, s.unused_bytes) == (K4, 0, 15 * K4)
    assert arena.alloc(3 * K4) == 8192
    arena.check_integrity()


def test_full_arena_returns_none_then_splits_a_bigger_free_slot(arena: Arena) -> None:
    assert [arena.alloc(4 * K4) for _ in range(4)] == [4096, 20480, 36864, 53248]
    assert arena.alloc(1) is None
    arena.free(20480, 4 * K4)
    assert arena.alloc(K4) == 20480  # no 4 KiB slot, no bump room: split the 16 KiB one
    s = arena.stats()
    assert (s.used_bytes, s.free_list_bytes) == (13 * K4, 3 * K4)
    assert arena.alloc(4 * K4) is None
    assert arena.alloc(3 * K4) == 24576  # the split's tail is a 12 KiB slot
    arena.check_integrity()


def test_adjacent_free_slots_merge_only_when_nothing_else_fits(arena: Arena) -> None:
    assert [arena.alloc(K4) for _ in range(16)] == [4096 * (i + 1) for i in range(16)]
    for offset in (20480, 24576, 32768, 40960):
        arena.free(offset, K4)
    assert arena.alloc(2 * K4) == 20480  # 20480 + 24576 are adjacent; 32768 and 40960 are not
    assert arena.alloc(2 * K4) is None
    assert arena.alloc(K4) == 40960  # the 4 KiB free list is still used first
    arena.check_integrity()


def test_bad_frees_raise(arena: Arena) -> None:
    off = arena.alloc(K4)
    assert off is not None
    with pytest.raises(ArenaError, match="class 8192: slot is 4096"):
        arena.free(off, 2 * K4)
    arena.free(off, K4)
    with pytest.raises(ArenaError, match="not in use"):
        arena.free(off, K4)
    with pytest.raises(ArenaError):
        arena.alloc(0)


def test_check_integrity_reports_the_numbers(arena: Arena) -> None:
    arena.alloc(K4)
    arena.alloc(K4)
    arena.alloc(K4)
    arena.free(4096, K4)
    arena.check_integrity()
    arena._num_cut[K4] += 1  # corrupt the books on purpose
    with pytest.raises(ArenaIntegrityError, match=r"class 4096: free \+ used != cut slots: 1 \+ 2 != 4"):
        arena.check_integrity()
    arena._num_cut[K4] -= 1
    arena._bump += K4
    with pytest.raises(ArenaIntegrityError, match=r"free \+ used \+ unused != total bytes: 4096 \+ 8192 \+ 49152"):
        arena.check_integrity()


def test_views_write_through_to_the_file(arena: Arena) -> None:
    off = arena.alloc(10)
    assert off is not None
    with arena.view(off, 10) as v:
        v[:] = b"0123456789"
    with open(arena.path, "rb") as f:
        f.seek(off)
        assert f.read(10) == b"0123456789"
    with pytest.raises(ArenaError, match="outside slots"):
        arena.view(0, 10)
    with pytest.raises(ArenaError, match="outside slots"):
        arena.view(arena.end - 5, 10)


def test_close_unlinks_and_is_idempotent(tmp_path: Path) -> None:
    a = Arena(str(tmp_path / "a"), K4, "a")
    assert os.path.exists(a.path)
    a.close()
    assert not os.path.exists(a.path)
    a.close()
    with pytest.raises(ArenaError, match="closed"):
        a.view(HEADER_BYTES, 1)


def test_live_file_is_refused_and_stale_file_replaced(tmp_path: Path) -> None:
    path = str(tmp_path / "a")
    live = Arena(path, K4, "a")
    with pytest.raises(ArenaError, match="held by a running store"):
        Arena(path, K4, "a")
    assert os.path.exists(path)
    live.close()
    Path(path).write_bytes(b"stale")  # left over by a crashed run: nobody holds its lock
    fresh = Arena(path, 2 * K4, "a")
    assert parse_header(Path(path).read_bytes()[:HEADER_BYTES]).capacity == 2 * K4
    fresh.close()


def test_capacity_must_be_whole_slots(tmp_path: Path) -> None:
    with pytest.raises(ArenaError, match="multiple of 4096"):
        Arena(str(tmp_path / "a"), K4 + 1, "a")
