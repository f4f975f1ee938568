"""Pages by DMA from a store's arena mapped in this process.

CPU: the process-wide list of mapped arenas names the arena a page view lies in, and the unmap hooks
run (so a CUDA registration is dropped) before the client unmaps it; `arena_mappings` maps a
same-host arena at once (before any page moved), a remote one not at all.
GPU (`-m gpu`): memory registered with cudaHostRegister is pinned, every restore method is
byte-identical to the torch reference, and KVStoreHostPages.fetch_to(..., cuda) from a real kvstore
is byte-identical to the CPU read, by DMA from the registered arena on the same host and through the
pinned staging buffer when streamed, and so are `hold(cuda)`'s reads of one layer's bytes at a time;
`prepare(cuda)` registers the arena before the first fetch;
the registration goes when the client closes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import mmap
import shutil
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from services.kvstore.arena import HEADER_BYTES
from services.kvstore.mapping import ArenaRange, mapped_arena_at, mapped_arenas, on_unmap
from tests.conftest import StartStore

if TYPE_CHECKING:  # the client needs grpc and redis-py, which a GPU machine may lack: imported in the tests
    from services.kvstore.client import KVStoreClient

SMOLLM2_PAGE = 64 * 30 * 2 * 3 * 64 * 2  # bf16: tokens x layers x K,V x kv heads x head dim x bytes
GEMMA3_PAGE = 64 * 18 * 2 * 256 * 2  # Gemma 3 270M, full-attention layers, bf16

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _put(client: KVStoreClient, num_pages: int, page_nbytes: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    from services.kvstore.client import PageMeta

    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(16) for _ in range(num_pages)]
    data = [rng.bytes(page_nbytes) for _ in range(num_pages)]
    client.put_pages([(PageMeta(h, "bf16", 64, page_nbytes), d) for h, d in zip(hashes, data, strict=True)])
    return hashes, data


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_page_views_lie_in_a_listed_arena_and_unmap_hooks_run_first(start_store: StartStore) -> None:
    from services.kvstore.client import KVStoreClient

    store = start_store(host_kv_mib=8)
    client = KVStoreClient(store.address, shared_memory=True)
    hashes, data = _put(client, 3, 8192, seed=1)
    seen: list[ArenaRange] = []
    remove = on_unmap(seen.append)
    try:
        with client.get_pages(hashes) as batch:
            arenas = {mapped_arena_at(_address(view)) for view in batch}  # type: ignore[arg-type]
            locations = batch.locations
            views = [bytes(v) for v in batch]  # type: ignore[arg-type]
        assert views == data
        (arena,) = arenas
        assert arena is not None and arena.replica_id == store.replica_id
        mapping = client.arena_mapping()
        assert mapping is not None and (arena.address, arena.nbytes) == (mapping.address, mapping.nbytes)
        del mapping
        raw = (ctypes.c_uint8 * 8192).from_address(arena.address + locations[0].offset)
        assert bytes(raw) == data[0]  # offsets are file offsets from the arena's address
        assert mapped_arena_at(arena.address - 1) is None
        client.close()
        assert seen == [arena]
        assert mapped_arena_at(arena.address) is None
    finally:
        remove()
        client.close()


def test_arena_mappings_map_a_same_host_arena_at_once(start_store: StartStore) -> None:
    from services.kvstore.client import KVStoreClient

    store = start_store(host_kv_mib=8)
    with KVStoreClient(store.address, shared_memory=False) as remote:
        assert remote.arena_mappings() == {}
    assert not any(a.replica_id == store.replica_id for a in mapped_arenas())
    client = KVStoreClient(store.address)
    try:
        mappings = client.arena_mappings()  # no page put or fetched yet
        assert list(mappings) == [store.replica_id]
        mapping = mappings.pop(store.replica_id)
        arena = mapped_arena_at(mapping.address)
        assert arena is not None and (arena.address, arena.nbytes) == (mapping.address, mapping.nbytes)
        assert arena.nbytes == HEADER_BYTES + 8 * 2**20 and arena in mapped_arenas()
        assert client.arena_mappings()[store.replica_id].address == arena.address  # mapped once
        del mapping
        client.close()
        assert arena not in mapped_arenas()
    finally:
        client.close()


# ---- GPU ------------------------------------------------------------------------------------------


@pytest.fixture
def gpu_store(start_store: StartStore) -> StartStore:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return start_store


@pytest.fixture
def _redis_server() -> None:
    if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None:
        pytest.skip("redis-server or redis-py is not installed here (the kvstore needs its catalog)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("page_nbytes", [SMOLLM2_PAGE, GEMMA3_PAGE], ids=["smollm2", "gemma3"])
def test_every_restore_method_from_registered_memory_equals_the_reference(page_nbytes: int) -> None:
    from services.engine.kernels.pages.restore import (
        host_tensor,
        register_host,
        restore_pages,
        restore_reference,
        unregister_host,
    )

    num_pages = 24
    mm = mmap.mmap(-1, 4096 + num_pages * page_nbytes)
    holder = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(holder)
    src = host_tensor(address, len(mm))
    src.copy_(torch.randint(0, 256, (len(mm),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    assert not src.is_pinned()
    register_host(address, len(mm))
    try:
        assert src.is_pinned()
        gen = torch.Generator().manual_seed(1)
        order = torch.randperm(num_pages, generator=gen).tolist()[:16]
        offsets = [4096 + p * page_nbytes for p in sorted(order[:8])] + [4096 + p * page_nbytes for p in order[8:]]
        rows = torch.randperm(16, generator=gen).tolist()
        expected = restore_reference(src, offsets, page_nbytes, torch.device("cuda"))
        third = page_nbytes // 3 // 16 * 16
        parts = [(0, third), (2 * third, 3 * third)]  # e.g. a slot's paged layers
        packed = torch.cat([expected[:, lo:hi] for lo, hi in parts], dim=1)
        for method in ("copies", "triton", "reference"):
            out = torch.zeros(16, page_nbytes, dtype=torch.uint8, device="cuda")
            restore_pages(src, offsets, out, rows, method=method)
            torch.cuda.synchronize()
            assert torch.equal(out[torch.tensor(rows, device="cuda")], expected), method
            out = torch.zeros(16, 2 * third, dtype=torch.uint8, device="cuda")
            restore_pages(src, offsets, out, rows, method=method, parts=parts)
            torch.cuda.synchronize()
            assert torch.equal(out[torch.tensor(rows, device="cuda")], packed), method
    finally:
        torch.cuda.synchronize()
        unregister_host(address)
        del src, holder
        mm.close()


@pytest.mark.gpu
@needs_cuda
def test_a_refused_registration_raises_and_leaves_no_error_behind() -> None:
    """cudaHostRegister refusing a range (already registered; a null range) is a RestoreError, and the
    error the runtime kept for this thread is consumed: torch's next launch does not raise it as its own
    (the engine then restores that arena through staged copies)."""
    from services.engine.kernels.pages.restore import RestoreError, register_host, unregister_host

    mm = mmap.mmap(-1, 1 << 20)
    holder = ctypes.c_char.from_buffer(mm)
    address = ctypes.addressof(holder)
    register_host(address, len(mm))
    try:
        for where in (address, 0):
            with pytest.raises(RestoreError, match="cudaHostRegister"):
                register_host(where, len(mm))
            assert torch.ones(4, device="cuda").sum().item() == 4.0
    finally:
        unregister_host(address)
        del holder
        mm.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["copies", "triton"])
@pytest.mark.parametrize("shared", [True, False], ids=["same-host", "streamed"])
def test_fetch_to_cuda_is_byte_identical_to_the_cpu_read(
    _redis_server: None, gpu_store: StartStore, shared: bool, method: str
) -> None:
    """fetch_to(cuda) equals the CPU read, by DMA from the arena or through staging; hold(cuda)'s reads of one layer's
    bytes equal the pages' too; every pin goes once the reads are done."""
    from services.engine.kv.write_through import WriteThrough
    from services.engine.ring.host_pages import KVStoreHostPages, pinned_arenas
    from services.kvstore.client import KVStoreClient

    # the arena on tmpfs, as deployed (/dev/shm is the store's default): cudaHostRegister refused an
    # arena file on the test's temporary directory on the H200 host (CUDA error 1)
    store = gpu_store(host_kv_mib=128, args=("--arena-dir", "/dev/shm"))
    writer = KVStoreClient(store.address)
    hashes, data = _put(writer, 40, SMOLLM2_PAGE, seed=2)
    client = KVStoreClient(store.address, shared_memory=shared)
    host = KVStoreHostPages(client, WriteThrough(writer, "bf16", 8), SMOLLM2_PAGE, "dma-test", method, method)
    try:
        order = list(range(8, 40)) + [3, 1, 7, 0]  # a coalesced run, then single pages out of order
        pages = host.fetch_to([hashes[i] for i in order], torch.device("cuda"))
        assert pages.device.type == "cuda" and pages.shape == (len(order), SMOLLM2_PAGE)
        reference = host.fetch_to([hashes[i] for i in order], torch.device("cpu"))
        assert torch.equal(pages.cpu(), reference)
        assert pages[-1].cpu().numpy().tobytes() == data[0]
        mapping = client.arena_mapping()
        registered = {(a.address, a.nbytes) for a in pinned_arenas().registered}
        if shared:
            assert mapping is not None and (mapping.address, mapping.nbytes) in registered
            assert host.num_staged == 0  # every page by DMA from the arena
        else:
            assert mapping is None and host.num_staged == len(order)
        del mapping
        # held: each read one byte range (a layer's) of some pages, from the arena or the copy taken at hold
        held = host.hold(hashes[4:36], torch.device("cuda"))
        assert held.num_copied == (0 if shared else 32)
        layer = SMOLLM2_PAGE // 30  # one of SmolLM2's 30 layers' K and V
        for part, picked in (((7 * layer, 8 * layer), list(range(32))), ((0, layer), [31, 2, 17])):
            got = held.read(picked, part, torch.device("cuda"))
            assert got.device.type == "cuda" and got.shape == (len(picked), layer)
            want = [data[4 + i][part[0] : part[1]] for i in picked]
            assert [got[k].cpu().numpy().tobytes() for k in range(len(picked))] == want
        held.release()
        host.settle()  # pins are released off the step's path (a held batch's once its copies are done)
        assert writer.info().num_pinned_pages == 0
    finally:
        host.close()
        writer.close()
    assert not any(a.replica_id == store.replica_id for a in pinned_arenas().registered)  # unregistered on close


@pytest.mark.gpu
@needs_cuda
def test_prepare_registers_the_arena_before_the_first_fetch(_redis_server: None, gpu_store: StartStore) -> None:
    from services.engine.kv.write_through import WriteThrough
    from services.engine.ring.host_pages import KVStoreHostPages, pinned_arenas
    from services.kvstore.client import KVStoreClient

    store = gpu_store(host_kv_mib=128, args=("--arena-dir", "/dev/shm"))  # tmpfs, as deployed (see above)
    writer = KVStoreClient(store.address, shared_memory=False)  # the host's client maps the only view
    hashes, data = _put(writer, 16, SMOLLM2_PAGE, seed=3)
    client = KVStoreClient(store.address)
    host = KVStoreHostPages(client, WriteThrough(writer, "bf16", 8), SMOLLM2_PAGE, "dma-test")
    try:
        assert not any(a.replica_id == store.replica_id for a in pinned_arenas().registered)
        result = host.prepare(torch.device("cuda"))
        mapping = client.arena_mapping()
        assert mapping is not None
        arena = (mapping.address, mapping.nbytes)
        del mapping
        assert arena in {(a.address, a.nbytes) for a in pinned_arenas().registered}  # before any fetch
        assert (result.num_registered, result.registered_mib, result.num_pageable) == (1, arena[1] >> 20, 0)
        assert host.num_fetched == 0
        order = [5, 6, 7, 0, 15, 2]
        pages = host.fetch_to([hashes[i] for i in order], torch.device("cuda"))
        assert pages.device.type == "cuda"
        assert [pages[k].cpu().numpy().tobytes() for k in range(len(order))] == [data[i] for i in order]
        assert host.num_staged == 0  # by DMA from the arena registered at prepare
        assert [(a.address, a.nbytes) for a in pinned_arenas().registered if a.replica_id == store.replica_id] == [
            arena
        ]  # not registered again
        host.settle()
        assert writer.info().num_pinned_pages == 0
    finally:
        host.close()
        writer.close()
    assert not any(a.replica_id == store.replica_id for a in pinned_arenas().registered)  # unregistered on close
