"""KVStoreHostPages.prepare against real kvstore processes (and a real redis catalog), on the CPU:
a CPU device maps and registers nothing; a CUDA device (cudaHostRegister mocked) maps and registers
the arena of every same-host replica before any page is fetched, a replica that joins later is
registered on first use, an arena that cannot be registered stays pageable (logged once), and an
unreachable store leaves everything to first use. GPU: tests/kvstore/test_dma.py."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest
import torch

import services.engine.ring.host_pages as host_pages
from services.engine.kernels.pages.restore import RestoreError
from services.engine.kv.write_through import WriteThrough
from services.engine.ring.host_pages import ArenaRegistration, KVStoreHostPages
from services.kvstore.client import KVStoreClient, PageMeta
from services.kvstore.cluster import KVStoreCluster
from services.kvstore.mapping import ArenaRange, mapped_arenas
from tests.conftest import StartStore, free_port

PAGE = 4096 + 48  # not a multiple of the arena's 4 KiB slots
CUDA = torch.device("cuda")  # only its type is read: cudaHostRegister is mocked, nothing runs on a GPU


@pytest.fixture
def register_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """cudaHostRegister / cudaHostUnregister mocked (recorded), with a registry of the test's own."""
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(host_pages, "register_host", lambda address, nbytes: calls.append(("register", address)))
    monkeypatch.setattr(host_pages, "unregister_host", lambda address: calls.append(("unregister", address)))
    monkeypatch.setattr(host_pages, "_pinned", None)
    return calls


def _put(client: KVStoreClient | KVStoreCluster, num_pages: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(16) for _ in range(num_pages)]
    data = [rng.bytes(PAGE) for _ in range(num_pages)]
    client.put_pages([(PageMeta(h, "fp32", 4, PAGE), d) for h, d in zip(hashes, data, strict=True)])
    return hashes, data


def _restore(host: KVStoreHostPages, client: KVStoreClient | KVStoreCluster, hashes: list[bytes]) -> list[bytes]:
    """The CUDA path's bookkeeping on CPU tensors: the pages through host._to_device."""
    out = torch.zeros(len(hashes), PAGE, dtype=torch.uint8)
    with client.get_pages(hashes) as batch:
        host._to_device(batch, out)
    return [out[k].numpy().tobytes() for k in range(len(hashes))]


def _arenas_of(replica_id: str) -> list[ArenaRange]:
    return [a for a in mapped_arenas() if a.replica_id == replica_id]


def test_prepare_on_the_cpu_maps_and_registers_nothing(start_store: StartStore, register_calls: list) -> None:
    store = start_store(host_kv_mib=8)
    client = KVStoreClient(store.address)
    host = KVStoreHostPages(client, WriteThrough(client, "fp32", 8), PAGE, "prepare-test")
    try:
        assert host.prepare(torch.device("cpu")) == ArenaRegistration(0, 0, 0.0, 0)
        assert host.prepare("cpu") == ArenaRegistration(0, 0, 0.0, 0)
        assert _arenas_of(store.replica_id) == []  # not even mapped
        assert register_calls == [] and host_pages._pinned is None
    finally:
        host.close()


def test_prepare_registers_every_same_host_replica_before_the_first_restore(
    start_store: StartStore, redis_url: str, register_calls: list[tuple[str, int]]
) -> None:
    prefix = f"kvmem-test-{uuid.uuid4().hex[:8]}:"
    rids = [f"hp-{uuid.uuid4().hex[:6]}-{i}" for i in range(3)]
    for rid in rids[:2]:
        start_store(host_kv_mib=8, replica_id=rid, prefix=prefix)
    writer = KVStoreCluster(redis_url, prefix, shared_memory=False, refresh_s=0.05)  # maps nothing
    cluster = KVStoreCluster(redis_url, prefix, refresh_s=0.05)
    write_through = WriteThrough(writer, "fp32", 8)  # type: ignore[arg-type]  # as the builder does
    host = KVStoreHostPages(cluster, write_through, PAGE, "prepare-test")
    try:
        assert [_arenas_of(rid) for rid in rids] == [[], [], []]
        result = host.prepare(CUDA)
        arenas = [_arenas_of(rid) for rid in rids[:2]]  # mapped now, before any page was fetched
        assert all(len(a) == 1 for a in arenas), arenas
        first = [a for (a,) in arenas]
        assert sorted(register_calls) == sorted(("register", a.address) for a in first)  # each once
        assert result.num_registered == 2 and result.num_pageable == 0
        assert result.registered_mib == sum(a.nbytes for a in first) >> 20 and result.elapsed_s >= 0
        assert sorted(host_pages.pinned_arenas().registered) == sorted(first)

        start_store(host_kv_mib=8, replica_id=rids[2], prefix=prefix)  # joins after start-up
        hashes, data = _put(writer, 30, seed=1)
        assert _restore(host, cluster, hashes) == data
        assert {a.replica_id for a in mapped_arenas() if a.replica_id in rids} == set(rids)
        (late,) = _arenas_of(rids[2])
        assert register_calls[2:] == [("register", late.address)]  # on first use, once
        assert host.num_staged == 0  # every page from a registered arena

        again = host.prepare(CUDA)  # nothing left to register
        assert (again.num_registered, again.num_pageable) == (3, 0) and len(register_calls) == 3
    finally:
        host.close()
        writer.close()
    assert sorted(register_calls[3:]) == sorted(("unregister", a.address) for a in [*first, late])
    assert host_pages.pinned_arenas().registered == []


def test_an_arena_that_cannot_be_registered_stays_pageable_and_is_logged_once(
    start_store: StartStore, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[int] = []

    def refuse(address: int, nbytes: int) -> None:
        attempts.append(address)
        raise RestoreError(f"cudaHostRegister of {nbytes} bytes at {address:#x} failed: CUDA error 1")

    monkeypatch.setattr(host_pages, "register_host", refuse)
    monkeypatch.setattr(host_pages, "_pinned", None)
    store = start_store(host_kv_mib=8)
    client = KVStoreClient(store.address)
    host = KVStoreHostPages(client, WriteThrough(client, "fp32", 8), PAGE, "prepare-test")
    try:
        hashes, data = _put(client, 5, seed=2)
        with caplog.at_level(logging.WARNING, logger=host_pages.__name__):
            result = host.prepare(CUDA)
            assert (result.num_registered, result.registered_mib, result.num_pageable) == (0, 0, 1)
            for _ in range(2):
                assert _restore(host, client, hashes[::-1]) == data[::-1]
        (arena,) = _arenas_of(store.replica_id)
        assert attempts == [arena.address]  # tried once, at prepare
        assert host.num_staged == 2 * len(hashes)  # the staged copies instead
        assert [r.message for r in caplog.records if "stays pageable" in r.message] == [
            f"arena of {store.replica_id} stays pageable (staged copies): cudaHostRegister of "
            f"{arena.nbytes} bytes at {arena.address:#x} failed: CUDA error 1"
        ]  # once, not on every restore
        assert host_pages.pinned_arenas().registered == []
    finally:
        host.close()


def test_prepare_with_the_store_unreachable_leaves_it_to_first_use(
    register_calls: list, caplog: pytest.LogCaptureFixture
) -> None:
    client = KVStoreClient(f"127.0.0.1:{free_port()}", timeout_s=2.0)
    host = KVStoreHostPages(client, WriteThrough(client, "fp32", 8), PAGE, "prepare-test")
    try:
        with caplog.at_level(logging.WARNING, logger=host_pages.__name__):
            result = host.prepare(CUDA)
        assert (result.num_registered, result.registered_mib, result.num_pageable) == (0, 0, 0)
        assert register_calls == [] and "on first restore instead" in caplog.text
    finally:
        host.close()


def test_same_host_arenas_maps_the_local_arena_and_keeps_no_reference(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=8)
    with KVStoreClient(store.address, shared_memory=False) as client:
        assert host_pages.same_host_arenas(client) == [] and _arenas_of(store.replica_id) == []
    with KVStoreClient(store.address) as client:
        (arena,) = host_pages.same_host_arenas(client)
        assert _arenas_of(store.replica_id) == [arena]
    assert _arenas_of(store.replica_id) == []  # the returned ranges kept nothing mapped


@pytest.mark.parametrize("arena", [True, False], ids=["from-the-arena", "copied-at-hold"])
def test_held_pages_read_byte_ranges_of_any_of_them_until_released(
    start_store: StartStore,
    register_calls: list[tuple[str, int]],
    arena: bool,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """hold: the pages stay pinned in the store while reads copy byte ranges (a layer's) of any of them, in the
    order asked, from the registered arena (a CUDA engine; registration mocked, the copies to CPU tensors here) or
    from one copy taken at hold (a CPU engine); release drops the pins once the reads are done. A CUDA engine's
    reads go through the triton gather (interpreted here) until a range it cannot take (bytes not 16-byte
    aligned), then by copies (logged); a CPU engine's copy."""
    monkeypatch.setattr(host_pages, "_held_fallback_logged", [])  # the fallback's warning: once a process
    store = start_store(host_kv_mib=8)
    client = KVStoreClient(store.address)  # same host: get_pages answers views into the mapped arena
    host = KVStoreHostPages(client, WriteThrough(client, "fp32", 8), PAGE, "held-test")
    try:
        hashes, data = _put(client, 12, seed=7)
        held = host.hold(hashes[2:10], CUDA if arena else torch.device("cpu"))
        assert held.num_copied == (0 if arena else 8)
        assert bool(register_calls) == arena
        assert held._method == ("triton" if arena else "copies")
        for part, order in (((0, PAGE), list(range(8))), ((100, 1100), [5, 0, 7]), ((PAGE - 48, PAGE), [3])):
            got = held.read(order, part, torch.device("cpu"))
            assert got.shape == (len(order), part[1] - part[0])
            assert [got[k].numpy().tobytes() for k in range(len(order))] == [
                data[2 + i][part[0] : part[1]] for i in order
            ]
        assert held._method == "copies"  # after the unaligned range
        assert ("held reads by copies instead of triton" in caplog.text) == arena
        assert client.info().num_pinned_pages == 8  # held: the store keeps them
        held.release()
        host.settle()
        assert client.info().num_pinned_pages == 0
        with pytest.raises(AssertionError):
            held.read([0], (0, 16), torch.device("cpu"))
    finally:
        host.close()


def test_a_page_on_its_way_to_the_store_is_read_and_pinned_after_its_write(start_store: StartStore) -> None:
    """A page demoted while its write-through is held up: `wait(queued_ok=True)` lets it go at once (the plain
    wait does not), a read of it waits for the write and gets its bytes, and its pin reaches the store after the
    put; a page whose write fails settles too (a read then finds it lost)."""
    import threading
    import time

    store = start_store(host_kv_mib=8)
    client = KVStoreClient(store.address)
    release = threading.Event()
    events: list[str] = []
    put_pages, pin = client.put_pages, client.pin

    def held_put(pages):  # type: ignore[no-untyped-def]
        release.wait(timeout=30)
        events.append("put")
        return put_pages(pages)

    client.put_pages = held_put  # type: ignore[method-assign]
    client.pin = lambda owner, hashes: events.append("pin") or pin(owner, hashes)  # type: ignore[method-assign]
    write_through = WriteThrough(client, "fp32", 8)
    host = KVStoreHostPages(client, write_through, PAGE, owner_id="engine-a")
    page = torch.from_numpy(np.random.default_rng(3).integers(0, 255, PAGE, dtype=np.uint8))
    h = b"\x07" * 16
    write_through.submit(h, page, 4)
    assert not host.wait([h], 0.05) and host.wait([h], 0.05, queued_ok=True)
    host.pin([h])
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.extend(host.fetch([h])))
    reader.start()
    time.sleep(0.2)
    assert not got and reader.is_alive()  # the read waits for the write
    release.set()
    reader.join(timeout=10)
    assert got and torch.equal(got[0], page)
    host.close()
    assert events == ["put", "pin"], events

    failing = WriteThrough(client, "fp32", 8)
    client.put_pages = lambda pages: (_ for _ in ()).throw(OSError("store gone"))  # type: ignore[method-assign]
    lost = b"\x08" * 16
    failing.submit(lost, page, 4)
    assert failing.wait_settled([lost], 10.0) and not failing.is_written(lost) and failing.num_failed == 1
    failing.close()
