"""A same-host client's mapping of a store's arena file, checked against the store's header token.

`ArenaMapping.address` / `nbytes` are what a CUDA client registers as pinned host memory
(`torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)` or cupy), so page copies from the
mapping to the device are DMA transfers; `view` is the whole file (offsets are file offsets).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
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


class Mapping(NamedTuple):
    mm: mmap.mmap
    token_hex: str
    replica_id: str
    arena_bytes: int

    def arena_mapping(self) -> ArenaMapping:
        holder = ctypes.c_char.from_buffer(self.mm)  # exports the buffer only while we read its address
        address = ctypes.addressof(holder)
        del holder
        return ArenaMapping(address, len(self.mm), self.replica_id, memoryview(self.mm))

    def page_view(self, offset: int, nbytes: int) -> memoryview:
        """A read-only view of nbytes at offset (raises KVStoreError outside the mapping)."""
        if offset < HEADER_BYTES or offset + nbytes > len(self.mm):
            raise KVStoreError(f"page at [{offset}, {offset + nbytes}) is outside the mapped arena")
        return memoryview(self.mm)[offset : offset + nbytes].toreadonly()

    def close(self) -> None:
        """Unmap now, or when the last view handed out is released."""
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
    return Mapping(mm, token_hex, info.replica_id, info.arena_bytes)
