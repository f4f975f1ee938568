"""A same-host client's mapping of a store's arena file, checked against the store's header token.

`ArenaMapping.address` / `nbytes` are what a CUDA client registers as pinned host memory
(`torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)` or cupy), so page copies from the
mapping to the device are DMA transfers; `view` is the whole file (offsets are file offsets).

Every arena mapped in this process is listed (`mapped_arenas`; `mapped_arena_at`: which arena holds
an address, e.g. of a page view from `get_pages`), and `on_unmap` hooks run before one is unmapped,
so whoever registered it with CUDA unregisters it first (a later mapping may reuse the same addresses).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Callable
from typing import NamedTuple

from services.kvstore.arena import HEADER_BYTES, MAP_FLAGS, ArenaError, parse_header
from services.kvstore.pages import KVStoreError

logger = logging.getLogger(__name__)


class SharedMemoryUnavailable(KVStoreError):
    """shared_memory=True was asked for but the store's arena cannot be mapped and verified here."""


class StoreInfo(NamedTuple):
    replica_id: str
    arena_path: str
    arena_bytes: int
    used_bytes: int
    num_pages: int
    evictions: int
    num_cold_pages: int = 0
    cold_bytes: int = 0
    cold_raw_bytes: int = 0
    num_pinned_pages: int = 0
    num_compressed: int = 0
    num_restored: int = 0


class ArenaMapping(NamedTuple):
    """Where a store's arena is mapped in this process (valid until the client closes or remaps)."""

    address: int  # virtual address of file offset 0
    nbytes: int  # header + slots
    replica_id: str
    view: memoryview  # writable view of the whole file: never write into pages you did not reserve


class ArenaRange(NamedTuple):
    """Where one arena is mapped in this process; holds no reference to the mapping itself."""

    address: int  # virtual address of file offset 0
    nbytes: int  # header + slots
    replica_id: str
    token_hex: str  # the store's arena token: a restarted store's arena has another


UnmapHook = Callable[[ArenaRange], None]
_live_lock = threading.Lock()
_live: dict[int, ArenaRange] = {}  # by address: every arena mapped in this process
_unmap_hooks: list[UnmapHook] = []


def mapped_arenas() -> list[ArenaRange]:
    """Every arena mapped in this process now (by any client), by address."""
    with _live_lock:
        return sorted(_live.values())


def mapped_arena_at(address: int) -> ArenaRange | None:
    """The arena mapped in this process that holds `address`, or None."""
    with _live_lock:
        for arena in _live.values():
            if arena.address <= address < arena.address + arena.nbytes:
                return arena
    return None


def on_unmap(hook: UnmapHook) -> Callable[[], None]:
    """Call hook(arena) before any arena of this process is unmapped; returns the function that removes it."""
    with _live_lock:
        _unmap_hooks.append(hook)

    def remove() -> None:
        with _live_lock:
            if hook in _unmap_hooks:
                _unmap_hooks.remove(hook)

    return remove


def _address_of(mm: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mm)  # exports the buffer only while we read its address
    address = ctypes.addressof(holder)
    del holder
    return address


class Mapping(NamedTuple):
    mm: mmap.mmap
    token_hex: str
    replica_id: str
    arena_bytes: int

    def arena_mapping(self) -> ArenaMapping:
        return ArenaMapping(_address_of(self.mm), len(self.mm), self.replica_id, memoryview(self.mm))

    def arena_range(self) -> ArenaRange:
        return ArenaRange(_address_of(self.mm), len(self.mm), self.replica_id, self.token_hex)

    def page_view(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of nbytes at offset (raises KVStoreError outside the mapping)."""
        if offset < HEADER_BYTES or offset + nbytes > len(self.mm):
            raise KVStoreError(f"page at [{offset}, {offset + nbytes}) is outside the mapped arena")
        return memoryview(self.mm)[offset : offset + nbytes].toreadonly()

    def close(self) -> None:
        """Run the unmap hooks, then unmap now, or when the last view handed out is released."""
        if self.mm.closed:
            return
        arena = self.arena_range()
        with _live_lock:
            _live.pop(arena.address, None)
            hooks = list(_unmap_hooks)
        for hook in hooks:
            try:
                hook(arena)
            except Exception:  # a hook must not keep the arena mapped
                logger.exception("unmap hook failed for the arena of %s", self.replica_id)
        try:
            self.mm.close()
        except BufferError:
            logger.debug("arena mapping of %s still has views; unmapped when they go", self.replica_id)


def map_arena(info: StoreInfo, token_hex: str) -> Mapping:
    """Map the arena file named by info and check it is that store's (raises SharedMemoryUnavailable)."""
    if not token_hex:
        raise SharedMemoryUnavailable("the store sent no arena token")
    try:
        fd = os.open(info.arena_path, os.O_RDWR)
    except OSError as e:
        raise SharedMemoryUnavailable(f"cannot open {info.arena_path}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES + info.arena_bytes:
            raise SharedMemoryUnavailable(
                f"{info.arena_path} is {size} bytes, store says {HEADER_BYTES} + {info.arena_bytes}"
            )
        mm = mmap.mmap(fd, HEADER_BYTES + info.arena_bytes, flags=MAP_FLAGS)
    finally:
        os.close(fd)
    try:
        header = parse_header(mm[:HEADER_BYTES])
    except ArenaError as e:
        mm.close()
        raise SharedMemoryUnavailable(f"{info.arena_path}: {e}") from None
    if (header.token.hex(), header.replica_id, header.capacity) != (
        token_hex,
        info.replica_id,
        info.arena_bytes,
    ):
        mm.close()
        raise SharedMemoryUnavailable(
            f"{info.arena_path} belongs to another store: token {header.token.hex()} replica "
            f"{header.replica_id} capacity {header.capacity}, expected {token_hex} {info.replica_id} "
            f"{info.arena_bytes}"
        )
    mapping = Mapping(mm, token_hex, info.replica_id, info.arena_bytes)
    arena = mapping.arena_range()
    with _live_lock:
        _live[arena.address] = arena
    return mapping
