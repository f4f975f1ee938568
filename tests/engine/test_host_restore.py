"""Restoring pages from host memory: the restore kernels against their torch reference (CPU, Triton
interpreted), and KVStoreHostPages.fetch_to against a real kvstore process on both paths (shared
memory and streamed), including lost and wrong-sized pages (PagesLostError: recompute)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from services.engine.kernels.pages.restore import RestoreError, Run, copy_runs, restore_pages, restore_reference
from services.engine.kv.write_through import WriteThrough
from services.engine.ring.host_pages import KVStoreHostPages, PagesLostError
from services.kvstore.client import KVStoreClient, PageMeta
from tests.conftest import StartStore

PAGE = 4096 + 48  # not a multiple of the arena's 4 KiB slots: the runs must still be exact


def _source(num_pages: int, page_nbytes: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_pages * page_nbytes + 64,), dtype=torch.uint8, generator=gen)


def test_copy_runs_coalesce_pages_consecutive_in_source_and_rows() -> None:
    n = 100
    offsets = [0, 100, 200, 500, 600, 300, 400]
    rows = [0, 1, 2, 3, 4, 6, 5]
    assert copy_runs(offsets, rows, n) == [Run(0, 0, 3), Run(3, 500, 2), Run(6, 300, 1), Run(5, 400, 1)]
    assert copy_runs([], [], n) == []


@pytest.mark.parametrize("method", ["copies", "reference"])
def test_restore_matches_the_reference(method: str) -> None:
    src = _source(12, PAGE)
    offsets = [5 * PAGE, 6 * PAGE, 7 * PAGE, 0, 11 * PAGE + 16, 3 * PAGE, 2 * PAGE]
    rows = [6, 0, 1, 2, 3, 4, 5]
    out = torch.zeros(7, PAGE, dtype=torch.uint8)
    restore_pages(src, offsets, out, rows, method=method)
    expected = restore_reference(src, offsets, PAGE, torch.device("cpu"))
    assert torch.equal(out[torch.tensor(rows)], expected)
    assert torch.equal(out[6], src[5 * PAGE : 6 * PAGE])  # and the reference is what it says


def _parts_reference(src: torch.Tensor, offsets: list[int], parts: list[tuple[int, int]]) -> torch.Tensor:
    return torch.stack([torch.cat([src[o + lo : o + hi] for lo, hi in parts]) for o in offsets])


@pytest.mark.parametrize("method", ["copies", "reference", "triton"])
@pytest.mark.parametrize(
    "parts",
    [[(1024, 2048)], [(0, 512), (1024, 1536), (3584, 4096)], [(16, 1040), (2048, 2560), (4096, PAGE)]],
    ids=["one", "same-size", "mixed-sizes"],
)
def test_restoring_parts_of_pages_packs_exactly_those_bytes(method: str, parts: list[tuple[int, int]]) -> None:
    """A restore of some byte ranges of each page (a slot's paged layers): each part lands packed in its
    page's row, whichever method moves them; rows are in any order."""
    if method == "triton":
        pytest.importorskip("triton")
    src = _source(8, PAGE, seed=4)
    offsets = [5 * PAGE, 0, 2 * PAGE, 3 * PAGE, 7 * PAGE]
    rows = [4, 0, 3, 1, 2]
    width = sum(hi - lo for lo, hi in parts)
    out = torch.zeros(5, width, dtype=torch.uint8)
    restore_pages(src, offsets, out, rows, method=method, parts=parts)
    assert torch.equal(out[torch.tensor(rows)], _parts_reference(src, offsets, parts))
    with pytest.raises(RestoreError, match="bytes for parts"):
        restore_pages(src, offsets, torch.zeros(5, width + 16, dtype=torch.uint8), rows, method=method, parts=parts)


def test_triton_gather_matches_the_reference() -> None:
    pytest.importorskip("triton")
    page = 3 * 4096 + 16 * 5  # words beyond one block, a ragged last block
    src = _source(9, page, seed=1)
    offsets = [8 * page, 0, 3 * page, 4 * page, 16]
    rows = [1, 2, 0, 4, 3]
    out = torch.zeros(5, page, dtype=torch.uint8)
    restore_pages(src, offsets, out, rows, method="triton")
    assert torch.equal(out[torch.tensor(rows)], restore_reference(src, offsets, page, torch.device("cpu")))


def test_restore_refuses_what_it_cannot_do_with_the_numbers() -> None:
    src = _source(4, PAGE)
    out = torch.zeros(2, PAGE, dtype=torch.uint8)
    with pytest.raises(RestoreError, match=f"offset {4 * PAGE}"):
        restore_pages(src, [0, 4 * PAGE], out)
    with pytest.raises(RestoreError, match="row 2"):
        restore_pages(src, [0, PAGE], out, rows=[0, 2])
    with pytest.raises(RestoreError, match="uint8"):
        restore_pages(src.view(torch.int32), [0], out)
    if importlib.util.find_spec("triton") is not None:
        with pytest.raises(RestoreError, match="aligned"):
            restore_pages(src, [0, PAGE + 1], torch.zeros(2, 4096, dtype=torch.uint8), method="triton")
    with pytest.raises(RestoreError, match="not in"):
        restore_pages(src, [0], out[:1], method="bogus")


# ---- fetch_to against a real kvstore ------------------------------------------------------------


def _put(client: KVStoreClient, num_pages: int, page_nbytes: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    hashes = [rng.bytes(16) for _ in range(num_pages)]
    data = [rng.bytes(page_nbytes) for _ in range(num_pages)]
    client.put_pages([(PageMeta(h, "fp32", 4, page_nbytes), d) for h, d in zip(hashes, data, strict=True)])
    return hashes, data


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "streamed"])
def test_fetch_to_cpu_returns_the_stored_bytes_in_request_order(start_store: StartStore, shared: bool) -> None:
    store = start_store(host_kv_mib=16)
    writer = KVStoreClient(store.address)
    hashes, data = _put(writer, 6, PAGE, seed=2)
    client = KVStoreClient(store.address, shared_memory=shared)
    host = KVStoreHostPages(client, WriteThrough(writer, "fp32", 8), PAGE, "restore-test")
    try:
        order = [4, 0, 5, 1]
        pages = host.fetch_to([hashes[i] for i in order], torch.device("cpu"))
        assert pages.dtype == torch.uint8 and pages.shape == (4, PAGE) and pages.device.type == "cpu"
        assert [pages[k].numpy().tobytes() for k in range(4)] == [data[i] for i in order]
        listed = host.fetch([hashes[3]])
        assert len(listed) == 1 and listed[0].numpy().tobytes() == data[3]
        assert (host.num_fetched, host.fetched_bytes) == (5, 5 * PAGE)
        parts = ((16, 1040), (2048, 2560))  # e.g. a slot's paged layers: only those bytes move
        packed = host.fetch_to([hashes[i] for i in order], torch.device("cpu"), parts)
        assert packed.shape == (4, 1024 + 512)
        assert [packed[k].numpy().tobytes() for k in range(4)] == [data[i][16:1040] + data[i][2048:2560] for i in order]
        assert host.fetched_bytes == 5 * PAGE + 4 * 1536
        assert client.shared_memory is shared
        host.settle()  # the batches' pins are released off the step's path
        assert client.info().num_pinned_pages == 0
    finally:
        host.close()
        writer.close()


def test_fetch_to_raises_pages_lost_for_missing_and_wrong_sized_pages(start_store: StartStore) -> None:
    store = start_store(host_kv_mib=16)
    writer = KVStoreClient(store.address)
    hashes, _ = _put(writer, 3, PAGE, seed=3)
    odd, _ = _put(writer, 1, PAGE + 16, seed=4)  # another format under a hash: unusable here
    write_through = WriteThrough(writer, "fp32", 8)
    write_through.mark_written(hashes + odd)
    host = KVStoreHostPages(KVStoreClient(store.address), write_through, PAGE, "restore-test")
    gone = b"\x07" * 16
    try:
        with pytest.raises(PagesLostError) as lost:
            host.fetch_to([hashes[0], gone, hashes[1]], torch.device("cpu"))
        assert lost.value.page_hashes == [gone]
        with pytest.raises(PagesLostError) as wrong:
            host.fetch_to([hashes[2], odd[0]], torch.device("cpu"))
        assert wrong.value.page_hashes == odd
        assert not write_through.is_written(odd[0]) and write_through.is_written(hashes[2])
        assert host.num_fetched == 0
        assert writer.info().num_pinned_pages == 0
    finally:
        host.close()
        writer.close()


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "streamed"])
def test_device_path_groups_arena_pages_and_stages_the_rest(
    start_store: StartStore, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The CUDA path's bookkeeping, run on CPU tensors with cudaHostRegister mocked: arena views are
    restored from their (registered once) arena by offset, streamed pages through the staging buffer;
    the registration goes before the client unmaps the arena."""
    import services.engine.ring.host_pages as host_pages

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(host_pages, "register_host", lambda address, nbytes: calls.append(("register", address)))
    monkeypatch.setattr(host_pages, "unregister_host", lambda address: calls.append(("unregister", address)))
    monkeypatch.setattr(host_pages, "_pinned", None)  # a registry of this test's own
    store = start_store(host_kv_mib=16)
    writer = KVStoreClient(store.address)
    hashes, data = _put(writer, 7, PAGE, seed=5)
    client = KVStoreClient(store.address, shared_memory=shared)
    host = KVStoreHostPages(client, WriteThrough(writer, "fp32", 8), PAGE, "restore-test")
    try:
        order = [2, 3, 4, 0, 6, 5]
        for _ in range(2):
            out = torch.zeros(len(order), PAGE, dtype=torch.uint8)
            with client.get_pages([hashes[i] for i in order]) as batch:
                host._to_device(batch, out)
            assert [out[k].numpy().tobytes() for k in range(len(order))] == [data[i] for i in order]
        parts = ((0, 512), (2048, 2560))  # only these bytes of each page, from the arena or the staging buffer
        out = torch.zeros(len(order), 1024, dtype=torch.uint8)
        with client.get_pages([hashes[i] for i in order]) as batch:
            host._to_device(batch, out, parts)
        expected = [data[i][:512] + data[i][2048:2560] for i in order]
        assert [out[k].numpy().tobytes() for k in range(len(order))] == expected
        mapping = client.arena_mapping()
        if shared:
            assert mapping is not None and calls == [("register", mapping.address)]  # once
            assert host.num_staged == 0
            address = mapping.address
            del mapping
            host.close()
            assert calls[-1] == ("unregister", address) and host_pages.pinned_arenas().registered == []
        else:
            assert mapping is None and calls == [] and host.num_staged == 3 * len(order)
    finally:
        host.close()
        writer.close()
