"""The ring's host pages: `HostPages`, what the engine asks of the store holding demoted pages, `PagesLostError`
when copies are gone, and KVStoreHostPages, the kvstore's implementation (pages written through, pinned, read
back).

Reads are batched. `fetch_to(page_hashes, device)` returns the pages as one uint8 [P, page_nbytes]
tensor on `device`:
- same host: `get_pages` answers views into the store's arena, mapped in this process; on CUDA the
  arena is registered once as pinned memory (cudaHostRegister, seconds for GBs: at engine start-up by
  `prepare` for every same-host replica the client knows then, else on first use: a replica that
  joined later, a restarted store's new arena; unregistered before it is unmapped: client close or
  store restart) and the pages move by DMA straight from the arena, coalesced into a few copies
  (kernels/pages/restore.py), then the batch's pins are released; an arena that cannot be registered
  stays pageable (logged once) and its pages go the staging way below;
- another host: the streamed bytes are packed into a pinned staging buffer, then one H2D copy;
- CPU device: one memcpy per page into the result.
`parts` (KVPool.slot_parts, local_parts) fetches only those bytes of each page: a restore into slots
moves the paged layers, not the sliding layers whose rows live in local rings.
Pins (a demoted page's host copy kept from eviction) and unpins go to the store off the step's path,
in order, on the same thread that releases fetched batches. A page may be demoted while its write-through is
still under way (its bytes are out of the pool already): its pin, and any read of it, wait for that write.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch

from services.engine.kernels.pages.restore import (
    Part,
    RestoreError,
    host_tensor,
    parts_nbytes,
    register_host,
    restore_pages,
    unregister_host,
)
from services.engine.kv.write_through import WriteThrough
from services.kvstore.mapping import ArenaRange, mapped_arena_at, on_unmap
from services.kvstore.pages import KVStoreError, PageBatch, PageNotFoundError

if TYPE_CHECKING:
    from services.kvstore.client import KVStoreClient
    from services.kvstore.cluster import KVStoreCluster

logger = logging.getLogger(__name__)
SETTLE_TIMEOUT_S = 30.0  # the longest a read or a pin waits for pages still being written through


class PagesLostError(RuntimeError):
    """Host copies are gone (their store replica went away); the sequence must recompute them."""

    def __init__(self, page_hashes: list[bytes]) -> None:
        super().__init__(f"{len(page_hashes)} page(s) lost from the host store")
        self.page_hashes = page_hashes


class HostPages(Protocol):
    """Where demoted pages come back from (the kvstore's authoritative copies)."""

    def has(self, page_hash: bytes) -> bool: ...

    def fetch_to(
        self, page_hashes: list[bytes], device: torch.device, parts: tuple[tuple[int, int], ...] | None = None
    ) -> torch.Tensor:
        """Pages as one uint8 [P, page_nbytes] tensor on `device`, in order, in one batched transfer
        (by DMA from the registered host copy where it can), or with `parts` only those byte ranges of
        each page, packed (KVPool.slot_parts); PagesLostError when one is gone."""
        ...

    def hold(self, page_hashes: list[bytes], device: torch.device | str) -> HeldPages:
        """These pages kept readable (their store pins held) for reads of a few byte ranges at a time (a layer's),
        each straight to the device that asks (HeldPages), until released; PagesLostError when one is gone."""
        ...

    def wait(self, page_hashes: list[bytes], timeout_s: float, queued_ok: bool = False) -> bool:
        """Block until these pages have a host copy, or with `queued_ok` have one or are on their way to the store
        (their bytes copied out of the pool already: a read waits for them); False on timeout."""
        ...

    def pin(self, page_hashes: list[bytes]) -> None:
        """Keep these host copies from eviction (one pin each) until unpinned; may take effect a little
        later (off the step's path): a page evicted meanwhile is recomputed like any lost page."""
        ...

    def leading_present(self, page_hashes: list[bytes]) -> int:
        """How many leading pages of a hash chain have a host copy."""
        ...

    def unpin(self, page_hashes: list[bytes]) -> None: ...

    def close(self) -> None:
        """Release the store connection and any registered host memory (engine stop)."""
        ...


class HeldPages:
    """Host pages held for one step (KVStoreHostPages.hold): their store pins kept, each `read` copying some byte
    ranges of some of them (one layer's, at a time) to a device, asynchronously on its current stream, straight from
    their registered arena by DMA (kernels/pages/restore.py); the pages in no registered arena (another host's, a
    pageable arena, a CPU engine's) are copied once into host memory at hold. The exact policy's long contexts: a 32K
    prompt's host pages at the 8B shape are 2 GB in fp8, and copying them all into host memory before the first
    layer could read its 64 MB kept the device idle ~450 ms a 12K prompt (bench/RESULTS.md, round 10). `release`
    once every read is queued: the pins go when the copies are done, off the caller's path."""

    def __init__(
        self, batch: PageBatch, page_nbytes: int, method: str, background: Callable[..., None], device_copies: bool
    ) -> None:
        self._batch = batch
        self._method = method
        self._background = background
        # (source: a uint8 host tensor, byte offset of each page in it, the page's index in the batch)
        self._sources: list[Source] = []
        copied = list(range(len(batch)))
        if device_copies:
            by_arena, copied = _arena_sources(batch, pinned_arenas())
            self._sources.extend(by_arena.values())
        if copied:  # pinned for a device's reads: asynchronous copies, and the triton method reads it in place (UVA)
            own = torch.empty(len(copied) * page_nbytes, dtype=torch.uint8, pin_memory=device_copies)
            packed = own.numpy()
            for k, i in enumerate(copied):
                packed[k * page_nbytes : (k + 1) * page_nbytes] = np.frombuffer(batch[i], dtype=np.uint8)  # type: ignore[arg-type]
            self._sources.append((own, [k * page_nbytes for k in range(len(copied))], copied))
        self.num_copied = len(copied)
        self._released = False

    def read(self, indices: list[int], part: Part, device: torch.device) -> torch.Tensor:
        """Bytes [lo, hi) = `part` of the pages at these batch indices -> uint8 [len(indices), hi - lo] on `device`,
        in that order (asynchronous on CUDA: the tensor is ready for the work queued after it)."""
        assert not self._released, "read after release"
        out = torch.empty(len(indices), part[1] - part[0], dtype=torch.uint8, device=device)
        where = {i: k for k, i in enumerate(indices)}
        with pinned_arenas().lock:  # registered arenas stay registered while the copies are queued
            for src, offsets, rows in self._sources:
                picked = [(off, where[i]) for off, i in zip(offsets, rows, strict=True) if i in where]
                if picked:
                    self._restore(src, [o for o, _ in picked], out, [r for _, r in picked], part)
        return out

    def _restore(self, src: torch.Tensor, offsets: list[int], out: torch.Tensor, rows: list[int], part: Part) -> None:
        """One source's share of a read by this batch's method; pages the triton gather cannot take (bytes not
        16-byte aligned: kernels/pages/restore.py) by copies from then on (logged once a process: a pool's layout
        is the same every step)."""
        try:
            restore_pages(src, offsets, out, rows, self._method, (part,))
        except RestoreError as exc:
            if self._method == "copies":
                raise
            if not _held_fallback_logged:
                _held_fallback_logged.append(True)
                logger.warning("held reads by copies instead of %s: %s", self._method, exc)
            self._method = "copies"
            restore_pages(src, offsets, out, rows, self._method, (part,))

    def release(self) -> None:
        """Drop the pins once the copies queued so far are done (on CUDA an event on the current stream, waited
        for off the caller's path)."""
        if self._released:
            return
        self._released = True
        done = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            done = torch.cuda.Event()
            done.record()
        self._background(_release_after, self._batch, done)


Source = tuple[torch.Tensor, list[int], list[int]]  # a uint8 host tensor, pages' byte offsets in it, their indices
_held_fallback_logged: list[bool] = []  # HeldPages._restore's warning, once a process


def _arena_sources(batch: PageBatch, pinned: PinnedArenas) -> tuple[dict[int, Source], list[int]]:
    """The batch's pages by the registered arena they lie in, {arena address: (the arena's tensor, each page's byte
    offset in it, its index in the batch)}, and the indices of the pages in none (another host's, a pageable
    arena's): those are copied into pinned memory by the caller."""
    sources: dict[int, Source] = {}
    elsewhere: list[int] = []
    for i, data in enumerate(batch):
        address = _address(data) if isinstance(data, memoryview) else None
        hit = pinned.find(address) if address is not None else None
        if address is None or hit is None:
            elsewhere.append(i)
            continue
        arena, tensor = hit
        _, offsets, rows = sources.setdefault(arena.address, (tensor, [], []))
        offsets.append(address - arena.address)
        rows.append(i)
    return sources, elsewhere


def _release_after(batch: PageBatch, done: torch.cuda.Event | None) -> None:
    if done is not None:
        done.synchronize()
    batch.release()


class ArenaRegistration(NamedTuple):
    """What KVStoreHostPages.prepare did with the client's same-host arenas."""

    num_registered: int  # registered as pinned memory (now, or before this call)
    registered_mib: int  # their size
    elapsed_s: float  # the whole call: mapping and registering
    num_pageable: int  # not registered: cudaHostRegister refused (staged copies), or unmapped meanwhile


class PinnedArenas:
    """The kvstore arenas of this process registered with CUDA as pinned memory (process-wide: an
    address range can be registered once). An arena is registered by `register` (an engine's start-up)
    or else the first time a page view in it is restored, and unregistered just before it is unmapped;
    one that cannot be registered stays pageable (logged once). Hold `lock` while copies from a
    registered arena are in flight: an unmap waits for it."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._arenas: dict[int, tuple[ArenaRange, torch.Tensor]] = {}  # by address
        self._failed: set[ArenaRange] = set()
        self._remove_hook = on_unmap(self._unmapped)

    def register(self, arena: ArenaRange) -> bool:
        """Register `arena` now unless it already is; False when it is no longer mapped or stays pageable."""
        with self.lock:
            return mapped_arena_at(arena.address) == arena and self._entry(arena) is not None

    def find(self, address: int) -> tuple[ArenaRange, torch.Tensor] | None:
        """The registered arena holding `address` and a uint8 [nbytes] tensor over it (registered now
        if needed); None when no mapped arena holds it or it cannot be registered."""
        with self.lock:
            live = mapped_arena_at(address)
            return self._entry(live) if live is not None else None

    @property
    def registered(self) -> list[ArenaRange]:
        with self.lock:
            return [arena for arena, _ in self._arenas.values()]

    def _entry(self, live: ArenaRange) -> tuple[ArenaRange, torch.Tensor] | None:
        """The mapped arena `live`, registered (now if needed), with its tensor; None if it stays pageable."""
        with self.lock:
            entry = self._arenas.get(live.address)
            if entry is not None and entry[0] != live:  # unmapped without close, another arena there now
                self._unmapped(entry[0])
                entry = None
            if entry is not None:
                return entry
            if live in self._failed:
                return None
            try:
                register_host(live.address, live.nbytes)
            except RestoreError as e:
                logger.warning("arena of %s stays pageable (staged copies): %s", live.replica_id, e)
                self._failed.add(live)
                return None
            entry = self._arenas[live.address] = (live, host_tensor(live.address, live.nbytes))
            return entry

    def _unmapped(self, arena: ArenaRange) -> None:
        with self.lock:
            self._failed.discard(arena)
            entry = self._arenas.pop(arena.address, None)
            if entry is not None:
                if torch.cuda.is_initialized():  # a held batch's copies may still be in flight (HeldPages.read)
                    torch.cuda.synchronize()
                unregister_host(arena.address)
                logger.info("unregistered the arena of %s (%d MiB)", arena.replica_id, arena.nbytes >> 20)


_pinned: PinnedArenas | None = None
_pinned_lock = threading.Lock()


def pinned_arenas() -> PinnedArenas:
    """The process's registry of pinned arenas (created on first use: a CUDA prepare or restore)."""
    global _pinned
    with _pinned_lock:
        if _pinned is None:
            _pinned = PinnedArenas()
        return _pinned


class KVStoreHostPages:
    """Implements ring.HostPages over a kvstore client and the engine's write-through.

    Pages a running sequence relies on are pinned under the engine's owner id (the store never
    evicts a pinned page; pins lapse if the engine dies). `restore_method` picks the kernels/pages/restore.py
    method for device restores ("copies" or "triton"), `held_method` the one of held reads on CUDA: a layer's
    bytes of many pages, one unit a page (no run coalesces), which `copies` moves as one cudaMemcpyAsync each (an
    H100's 4 x 12K ring prefill at the 8B shape: 16,880 copies, 135 ms of copying and 323 ms of gaps between them)
    and `triton` in one gather launch a read (an H200's: 548 launches, 86 ms; bench/RESULTS.md round 11).
    """

    def __init__(
        self,
        client: KVStoreClient | KVStoreCluster,
        write_through: WriteThrough,
        page_nbytes: int,
        owner_id: str = "",
        restore_method: str = "copies",
        held_method: str = "triton",
    ) -> None:
        self._client = client
        self._write_through = write_through
        self._page_nbytes = page_nbytes  # KVPool.page_nbytes: pages travel as bytes in their stored format
        self._owner = owner_id
        self._method = restore_method
        self._held_method = held_method
        self._staging: torch.Tensor | None = None  # pinned uint8 [>= P * page_nbytes]: streamed pages
        self.num_fetched = 0
        self.fetched_bytes = 0
        self.num_staged = 0  # pages that reached a device through the staging buffer (not from an arena)
        # a fetched batch's pins are dropped off the step's path: once the copies are done they only keep the
        # store from evicting pages already on the device, and the Unpin round trip cost a restoring step ~1 ms
        self._releases = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmem-unpin")
        self._fetch_lock = threading.Lock()

    def prepare(self, device: torch.device | str) -> ArenaRegistration:
        """At engine start-up: map the arena of every replica on this host that the client knows of and,
        on CUDA, register each as pinned memory now, so that the first restore does not wait seconds for
        it (a replica that joins later is still registered on first use). Does nothing on the CPU.
        Never raises: with the store unreachable everything is left to first use, and an arena that
        cannot be registered stays pageable (staged copies)."""
        if torch.device(device).type != "cuda":
            return ArenaRegistration(0, 0, 0.0, 0)
        start = time.monotonic()
        try:
            arenas = same_host_arenas(self._client)
        except (KVStoreError, OSError) as exc:
            logger.warning("kvstore arenas not registered at start-up (on first restore instead): %s", exc)
            return ArenaRegistration(0, 0, time.monotonic() - start, 0)
        pinned = pinned_arenas()
        registered = [arena for arena in arenas if pinned.register(arena)]
        result = ArenaRegistration(
            len(registered), sum(a.nbytes for a in registered) >> 20, time.monotonic() - start,
            len(arenas) - len(registered),
        )  # fmt: skip
        logger.info("registered %d kvstore arena(s), %d MiB, as pinned memory in %.2f s; %d stay pageable", *result)
        return result

    def has(self, page_hash: bytes) -> bool:
        return self._write_through.is_written(page_hash)

    def wait(self, page_hashes: list[bytes], timeout_s: float, queued_ok: bool = False) -> bool:
        return self._write_through.wait_written(page_hashes, timeout_s, queued_ok)

    def leading_present(self, page_hashes: list[bytes]) -> int:
        """How many leading pages of a hash chain the store holds (they count as written through)."""
        if not page_hashes:
            return 0
        found = 0
        for loc in self._client.lookup(page_hashes):
            if not loc.found:
                break
            found += 1
        self._write_through.mark_written(page_hashes[:found])
        return found

    def present(self, keys: list[bytes]) -> list[bool]:
        """Which of these keys the store holds (one lookup; pages or other stored objects alike)."""
        return [loc.found for loc in self._client.lookup(keys)] if keys else []

    def fetch_blob(self, key: bytes, nbytes: int) -> torch.Tensor | None:
        """One stored object that is not a page (a recurrent-state snapshot, recurrent_state.py) as uint8
        [nbytes] on the CPU; None when it is gone or of another size."""
        self._write_through.wait_settled([key], SETTLE_TIMEOUT_S)
        try:
            batch = self._client.get_pages([key])
        except PageNotFoundError:
            return None
        try:
            data = next(iter(batch))
            if data is None or len(data) != nbytes:
                return None
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        finally:
            batch.release()

    def fetch(self, page_hashes: list[bytes]) -> list[torch.Tensor]:
        """Pages as uint8 [page_nbytes] CPU tensors (KVPool.read_page's layout; rows of one tensor), in one
        batched read; PagesLostError when any is gone."""
        return list(self.fetch_to(page_hashes, torch.device("cpu")))

    def fetch_to(
        self, page_hashes: list[bytes], device: torch.device, parts: tuple[Part, ...] | None = None
    ) -> torch.Tensor:
        """Pages as one uint8 [P, page_nbytes] tensor on `device` (rows in request order; KVPool.read_page's
        layout), or with `parts` just those byte ranges of each page, packed [P, their size]; in one batched
        read; PagesLostError when any is gone. On CUDA the copies are done on return."""
        with self._fetch_lock:  # the engine's step and the ring's prefetcher share the staging buffer
            return self._fetch_to(page_hashes, torch.device(device), parts or None)

    def hold(self, page_hashes: list[bytes], device: torch.device | str) -> HeldPages:
        """HeldPages over these pages (in order) for reads to `device` (DMA from registered arenas on CUDA);
        PagesLostError when any is gone. Release it once its reads are queued."""
        with self._fetch_lock:  # in turn with fetch_to (the prefetcher's thread): the store reads and the counts
            batch = self._get(page_hashes)
            cuda = torch.device(device).type == "cuda"
            try:  # off CUDA a held read copies (the triton gather is a CUDA kernel)
                held = HeldPages(
                    batch, self._page_nbytes, self._held_method if cuda else "copies", self._background, cuda
                )
            except BaseException:
                batch.release()
                raise
            self.num_fetched += len(page_hashes)
            self.num_staged += held.num_copied
        return held

    def _fetch_to(self, page_hashes: list[bytes], device: torch.device, parts: tuple[Part, ...] | None) -> torch.Tensor:
        batch = self._get(page_hashes)
        try:
            width = parts_nbytes(parts) if parts else self._page_nbytes
            out = torch.empty(len(page_hashes), width, dtype=torch.uint8, device=device)
            if device.type == "cpu":
                rows = out.numpy()
                for i, data in enumerate(batch):
                    page = np.frombuffer(data, dtype=np.uint8)  # type: ignore[arg-type]
                    rows[i] = page if parts is None else np.concatenate([page[lo:hi] for lo, hi in parts])
            else:
                self._to_device(batch, out, parts)
        except BaseException:
            batch.release()
            raise
        self._background(batch.release)  # the copies are done
        self.num_fetched += len(page_hashes)
        self.fetched_bytes += out.numel()
        return out

    def pin(self, page_hashes: list[bytes]) -> None:
        """Pin these host copies for this engine, off the caller's path (in order with unpin). A failed pin
        is logged: the page may then be evicted, and a restore that misses it recomputes it."""
        if self._owner and page_hashes:
            self._background(self._pin_written, list(page_hashes))

    def unpin(self, page_hashes: list[bytes]) -> None:
        """Drop this engine's pins (off the caller's path; a failed unpin is logged: pins lapse by themselves)."""
        if self._owner and page_hashes:
            self._background(self._pins, self._client.unpin, list(page_hashes))

    def _pin_written(self, page_hashes: list[bytes]) -> None:
        """Pin once the pages still on their way to the store (demoted before their write-through) are there."""
        self._write_through.wait_settled(page_hashes, SETTLE_TIMEOUT_S)
        self._pins(self._client.pin, page_hashes)

    def _pins(self, call: Callable[[str, list[bytes]], object], page_hashes: list[bytes]) -> None:
        """client.pin or client.unpin for this engine, on the release thread; a failure is logged."""
        try:
            call(self._owner, page_hashes)
        except Exception as exc:  # noqa: BLE001 - never fail the step thread's work for a pin
            logger.warning("%s of %d page(s) failed: %s", call.__name__, len(page_hashes), exc)

    def _background(self, fn: Callable[..., object], *args: object) -> None:
        """Run on the release thread (in submission order), or here once it is closed (engine stopping)."""
        try:
            self._releases.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    def close(self) -> None:
        """Drop the pins still being released, then close the client: its arena mappings are unregistered
        (if registered), then unmapped."""
        self._releases.shutdown(wait=True)
        self._staging = None
        self._client.close()

    def settle(self) -> None:
        """Wait until every fetched batch's pins are dropped and every pin and unpin has reached the store
        (tests and benchmarks that count pins)."""
        self._releases.submit(lambda: None).result()

    # ---- reads ------------------------------------------------------------------------------------

    def _get(self, page_hashes: list[bytes]) -> PageBatch:
        """The batch (views pinned until released); PagesLostError for missing or wrong-sized pages. Pages still on
        their way to the store (demoted before their write-through finished: ring.demote) are waited for first."""
        self._write_through.wait_settled(page_hashes, SETTLE_TIMEOUT_S)
        try:
            batch = self._client.get_pages(page_hashes)
        except PageNotFoundError as exc:
            lost = list(getattr(exc, "page_hashes", None) or page_hashes)
            self._write_through.forget(lost)
            raise PagesLostError(lost) from exc
        wrong = [
            h for h, data in zip(page_hashes, batch, strict=True) if data is None or len(data) != self._page_nbytes
        ]
        if wrong:  # another KV format or model under the same hash: unusable here, recompute
            batch.release()
            logger.error("%d host page(s) are not %d bytes; treating them as lost", len(wrong), self._page_nbytes)
            self._write_through.forget(wrong)
            raise PagesLostError(wrong)
        return batch

    def _to_device(self, batch: PageBatch, out: torch.Tensor, parts: tuple[Part, ...] | None = None) -> None:
        """Arena views by DMA from their registered arena, other pages through the pinned staging
        buffer; returns when the copies are done (the batch's pins may go)."""
        n = self._page_nbytes
        pinned = pinned_arenas()
        with pinned.lock:  # registered arenas stay registered until the copies are done
            sources, staged = _arena_sources(batch, pinned)
            if staged:
                staging = self._staging_for(len(staged) * n)
                packed = staging.numpy()
                for k, i in enumerate(staged):
                    packed[k * n : (k + 1) * n] = np.frombuffer(batch[i], dtype=np.uint8)  # type: ignore[arg-type]
                sources[-1] = (staging, [k * n for k in range(len(staged))], staged)
                self.num_staged += len(staged)
            for src, offsets, rows in sources.values():
                restore_pages(src, offsets, out, rows, self._method, parts)
            if out.device.type == "cuda":
                torch.cuda.current_stream(out.device).synchronize()

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging


def same_host_arenas(client: KVStoreClient | KVStoreCluster) -> list[ArenaRange]:
    """The arenas of the client's replicas on this host (a KVStoreClient's one, or every live replica
    of a KVStoreCluster), mapped now where they were not yet; [] when all are remote."""
    arenas = []
    for mapping in client.arena_mappings().values():
        arena = mapped_arena_at(mapping.address)
        mapping.view.release()  # a live view would keep the arena mapped after its client unmaps it
        if arena is not None:
            arenas.append(arena)
    return arenas


def _address(view: memoryview) -> int:
    """The host address of a (read-only) buffer's first byte."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
