"""The shared-memory arena: one file under arena_dir holding every page, with a slot allocator.

The file is fully allocated at creation (posix_fallocate), so a too-small tmpfs is reported at
start-up. Layout: a HEADER_BYTES header at offset 0 (magic, version, data size, a random token, replica id),
then `capacity` bytes of page slots. Offsets handed out are file offsets, 4 KiB aligned.

Every arena file is named `kvmem-arena-<replica id>` and held under an flock while its store lives (the
kernel drops the lock when the process dies, even by SIGKILL). A store replaces its own stale file at start
and `sweep_stale_arenas` removes the unlocked files of dead stores (other replica ids) from the directory,
so a crashed store's arena does not outlive it past the next start of any store (or the launcher's sweep).

Allocator: a slot's size class is its byte size rounded up to SLOT_ALIGN. New slots are cut from a
bump pointer; freed slots go to their class's free list (reused last-freed-first). A freed slot
that ends at the bump pointer is returned to the bump region instead (repeatedly), so when every
slot is free the whole arena is one free run again. Pages of one model all have one size, so the
fast paths are all that normally runs; with mixed sizes, when neither the class's free list nor
the bump region can serve, adjacent free slots of other classes are merged (`_alloc_merged`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import struct
import time
from collections import Counter
from typing import NamedTuple

logger = logging.getLogger(__name__)

SLOT_ALIGN = 4096
HEADER_BYTES = 4096
MAGIC = b"KVMEMAR1"
VERSION = 1
TOKEN_BYTES = 16
_HEADER = struct.Struct("<8sIIQ16sH")  # magic, version, header_bytes, capacity, token, len(replica_id)
_MAX_REPLICA_ID = HEADER_BYTES - _HEADER.size
# Map with page tables filled in up front: first writes into a fresh mapping otherwise fault per 4 KiB.
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ArenaError(Exception):
    """Misuse of the arena (bad offset, double free, wrong file, file in use)."""


class ArenaIntegrityError(ArenaError):
    """The allocator's books do not balance; the message carries the numbers."""


class ArenaHeader(NamedTuple):
    """What a client reads at offset 0 of an arena file to check it mapped the right one."""

    version: int
    header_bytes: int
    capacity: int
    token: bytes
    replica_id: str


class ArenaStats(NamedTuple):
    capacity: int  # bytes of page slots (the budget)
    used_bytes: int  # bytes in allocated slots
    free_list_bytes: int  # bytes in freed slots waiting for reuse by their class
    unused_bytes: int  # bytes never cut into slots (above the bump pointer)
    num_used: int


def round_up(nbytes: int) -> int:
    """The size class of an allocation of nbytes."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN


def pack_header(capacity: int, token: bytes, replica_id: str) -> bytes:
    """The header bytes for an arena (shorter than HEADER_BYTES; written at offset 0)."""
    rid = replica_id.encode()
    if len(rid) > _MAX_REPLICA_ID or len(token) != TOKEN_BYTES:
        raise ArenaError(f"header does not fit: replica id {len(rid)} bytes, token {len(token)} bytes")
    return _HEADER.pack(MAGIC, VERSION, HEADER_BYTES, capacity, token, len(rid)) + rid


def parse_header(buf: bytes | memoryview) -> ArenaHeader:
    """Decode the header at the start of `buf`; raises ArenaError when it is not an arena header."""
    if len(buf) < _HEADER.size:
        raise ArenaError(f"arena header needs {_HEADER.size} bytes, got {len(buf)}")
    magic, version, header_bytes, capacity, token, rid_len = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION:
        raise ArenaError(f"not a kvmem arena (magic {magic!r}, version {version})")
    rid = bytes(buf[_HEADER.size : _HEADER.size + rid_len]).decode()
    return ArenaHeader(version, header_bytes, capacity, token, rid)


class Arena:
    """The store's arena file (created on construction, unlinked on close) and its allocator."""

    def __init__(self, path: str, capacity: int, replica_id: str) -> None:
        if capacity < SLOT_ALIGN or capacity % SLOT_ALIGN:
            raise ArenaError(f"capacity must be a positive multiple of {SLOT_ALIGN}, got {capacity}")
        self.path = path
        self.capacity = capacity
        self.replica_id = replica_id
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.file_bytes = HEADER_BYTES + capacity
        self._fd = _create_locked(path, self.file_bytes)
        self._inode = os.fstat(self._fd).st_ino
        self._mm: mmap.mmap | None = mmap.mmap(self._fd, self.file_bytes, flags=MAP_FLAGS)
        self._mm[:HEADER_BYTES] = pack_header(capacity, self.token, replica_id).ljust(HEADER_BYTES, b"\0")
        self._bump = HEADER_BYTES
        self._free: dict[int, dict[int, None]] = {}  # size class -> free slot offsets (insertion order)
        self._free_by_end: dict[int, int] = {}  # end offset of a free slot -> its offset
        self._used: dict[int, int] = {}  # offset -> size class
        self._num_cut: Counter[int] = Counter()  # size class -> slots cut from the bump region
        logger.info("arena %s: %d bytes of slots + %d header", path, capacity, HEADER_BYTES)

    @property
    def end(self) -> int:
        return self.file_bytes

    def alloc(self, nbytes: int) -> int | None:
        """A slot of at least nbytes: the class's last freed slot, else a new one cut from the bump
        region, else a run of adjacent free slots of other classes merged; None when none fits."""
        if nbytes <= 0:
            raise ArenaError(f"alloc of {nbytes} bytes")
        cls = round_up(nbytes)
        free = self._free.get(cls)
        if free:
            offset, _ = free.popitem()
            del self._free_by_end[offset + cls]
        elif self._bump + cls <= self.end:
            offset = self._bump
            self._bump += cls
            self._num_cut[cls] += 1
        else:
            merged = self._alloc_merged(cls)
            if merged is None:
                return None
            offset = merged
        self._used[offset] = cls
        return offset

    def _alloc_merged(self, cls: int) -> int | None:
        """Slow path for mixed sizes: take the first run of adjacent free slots of >= cls bytes;
        the run's tail beyond cls becomes one free slot of its own class."""
        run: list[tuple[int, int]] = []  # (offset, class) of adjacent free slots
        run_start = run_bytes = 0
        for offset, slot_cls in sorted((o, c) for c, offsets in self._free.items() for o in offsets):
            if offset != run_start + run_bytes:
                run, run_start, run_bytes = [], offset, 0
            run.append((offset, slot_cls))
            run_bytes += slot_cls
            if run_bytes >= cls:
                for o, c in run:
                    del self._free[c][o]
                    del self._free_by_end[o + c]
                    self._num_cut[c] -= 1
                self._num_cut[cls] += 1
                if run_bytes > cls:
                    tail, tail_cls = run_start + cls, run_bytes - cls
                    self._num_cut[tail_cls] += 1
                    self._free.setdefault(tail_cls, {})[tail] = None
                    self._free_by_end[tail + tail_cls] = tail
                return run_start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the slot at offset (allocated for nbytes) to its class's free list."""
        cls = round_up(nbytes)
        have = self._used.get(offset)
        if have != cls:
            raise ArenaError(f"free of offset {offset} class {cls}: slot is {'not in use' if have is None else have}")
        del self._used[offset]
        self._free.setdefault(cls, {})[offset] = None
        self._free_by_end[offset + cls] = offset
        self._trim()

    def shrink(self, offset: int, nbytes: int, new_nbytes: int) -> None:
        """Keep the first new_nbytes of the slot at offset (allocated for nbytes); the tail becomes a free
        slot of its own class (the cold tier compresses a page in place, then gives the rest back)."""
        cls, new_cls = round_up(nbytes), round_up(new_nbytes)
        have = self._used.get(offset)
        if have != cls or not 0 < new_cls < cls:
            raise ArenaError(f"shrink of offset {offset} from class {cls} to {new_cls}: slot is {have}")
        self._used[offset] = new_cls
        tail, tail_cls = offset + new_cls, cls - new_cls
        self._num_cut[cls] -= 1
        self._num_cut[new_cls] += 1
        self._num_cut[tail_cls] += 1
        self._free.setdefault(tail_cls, {})[tail] = None
        self._free_by_end[tail + tail_cls] = tail
        self._trim()

    def _trim(self) -> None:
        """Give free slots that end at the bump pointer back to the bump region."""
        while (offset := self._free_by_end.pop(self._bump, None)) is not None:
            cls = self._bump - offset
            del self._free[cls][offset]
            self._num_cut[cls] -= 1
            self._bump = offset

    def view(self, offset: int, nbytes: int) -> memoryview:
        """A writable view of nbytes at offset (release it before close)."""
        if self._mm is None:
            raise ArenaError("arena is closed")
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > self.end:
            raise ArenaError(f"view [{offset}, {offset + nbytes}) outside slots [{HEADER_BYTES}, {self.end})")
        return memoryview(self._mm)[offset : offset + nbytes]

    def stats(self) -> ArenaStats:
        used = sum(self._used.values())
        free = sum(cls * len(offsets) for cls, offsets in self._free.items())
        return ArenaStats(self.capacity, used, free, self.end - self._bump, len(self._used))

    def check_integrity(self) -> None:
        """Raise ArenaIntegrityError unless free + used == cut per class and overall."""
        used_per_class = Counter(self._used.values())
        for cls in sorted(set(self._num_cut) | set(used_per_class) | set(self._free)):
            num_free, num_used, num_cut = (
                len(self._free.get(cls, ())),
                used_per_class[cls],
                self._num_cut[cls],
            )
            if num_free + num_used != num_cut:
                raise ArenaIntegrityError(
                    f"class {cls}: free + used != cut slots: {num_free} + {num_used} != {num_cut}"
                )
        s = self.stats()
        if s.free_list_bytes + s.used_bytes + s.unused_bytes != s.capacity:
            raise ArenaIntegrityError(
                f"free + used + unused != total bytes: {s.free_list_bytes} + {s.used_bytes} + "
                f"{s.unused_bytes} != {s.capacity}"
            )
        if len(self._free_by_end) != sum(len(o) for o in self._free.values()):
            raise ArenaIntegrityError(
                f"free slots by end != free slots: {len(self._free_by_end)} != "
                f"{sum(len(o) for o in self._free.values())}"
            )

    def close(self) -> None:
        """Unmap, unlink the file (if it is still ours) and release the lock. Idempotent."""
        if self._mm is None:
            return
        try:
            self._mm.close()
        except BufferError:
            logger.warning("arena %s: views still exported at close; the mapping stays until they go", self.path)
        self._mm = None
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        logger.info("arena %s: closed and unlinked", self.path)


def _create_locked(path: str, file_bytes: int) -> int:
    """Create the arena file exclusively, holding an flock; a stale unlocked file is replaced."""
    try:
        old = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    else:
        try:
            fcntl.flock(old, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ArenaError(f"arena file {path} is held by a running store") from None
        finally:
            os.close(old)
        logger.warning("arena %s: replacing a stale file from an earlier run", path)
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, file_bytes)
        _allocate(fd, path, file_bytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def _allocate(fd: int, path: str, file_bytes: int) -> None:
    """Back the whole file now: a tmpfs that is too small fails here, not as SIGBUS in a writer later."""
    try:
        os.posix_fallocate(fd, 0, file_bytes)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        st = os.statvfs(os.path.dirname(path) or ".")
        raise ArenaError(
            f"cannot back arena {path}: need {file_bytes} bytes, {st.f_bavail * st.f_frsize} bytes free"
        ) from None


ARENA_PREFIX = "kvmem-arena-"
SWEEP_MIN_AGE_S = 10.0  # a younger unlocked file may be a store between create and flock: left alone


def remove_if_stale(path: str, min_age_s: float = 0.0) -> bool:
    """Unlink the arena file at `path` when no living store holds its lock (and it is at least min_age_s
    old); True when it was removed."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        st = os.fstat(fd)
        if time.time() - st.st_mtime < min_age_s:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a living store holds it
        try:
            if os.stat(path).st_ino != st.st_ino:
                return False  # replaced meanwhile
        except FileNotFoundError:
            return False
        os.unlink(path)
        logger.warning("arena %s: removed (its store is gone)", path)
        return True
    finally:
        os.close(fd)


def sweep_stale_arenas(arena_dir: str, min_age_s: float = SWEEP_MIN_AGE_S) -> list[str]:
    """Remove every `kvmem-arena-*` file in arena_dir that no living store holds; returns the removed paths."""
    try:
        names = sorted(n for n in os.listdir(arena_dir) if n.startswith(ARENA_PREFIX))
    except FileNotFoundError:
        return []
    return [p for p in (os.path.join(arena_dir, n) for n in names) if remove_if_stale(p, min_age_s)]
