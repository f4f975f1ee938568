"""Every finished page the engine computes is written through to a real kvstore process and reads
back by its hash, byte for byte equal to the page in the device pool."""

from __future__ import annotations

import pytest
import torch

from services.common.pagehash import chain_hashes
from services.engine.kv.write_through import WriteThrough
from services.engine.step.sequence import Done
from services.kvstore.client import KVStoreClient, PageNotFoundError
from tests.conftest import StartStore
from tests.engine.helpers import (
    drain,
    events_of,
    greedy,
    make_engine,
    random_prompt,
    reference_greedy,
    ring_limits,
    run_until_done,
    tiny_model,
)

VOCAB = 49152


@pytest.mark.parametrize("shared_memory", [True, False])
def test_pages_read_back_byte_for_byte(start_store: StartStore, smol_tokenizer, shared_memory: bool) -> None:
    store = start_store(host_kv_mib=16)
    engine = make_engine(tiny_model(VOCAB, seed=1), smol_tokenizer, num_slots=32, page_size=8)
    engine.write_through = WriteThrough(KVStoreClient(store.address, shared_memory=shared_memory), "fp32", 64)
    prompt = list(range(300, 323))  # 2 full pages of 8 + 7; 10 generated tokens fill 2 more pages
    seq = engine.submit("w", prompt, greedy(10), namespace="t1")
    run_until_done(engine, [seq])
    engine.write_through.flush()
    hashes = chain_hashes(seq.token_ids, 8, "tiny", "fp32", namespace="t1")
    assert len(hashes) == 4
    with KVStoreClient(store.address) as reader:
        for i, h in enumerate(hashes):
            slot = engine.slots.lookup(h)
            assert slot is not None, f"page {i} is not in the prefix cache"
            expected = engine.pool.read_page(slot).contiguous().view(torch.uint8).numpy().tobytes()
            assert reader.get_page(h) == expected
        with pytest.raises(PageNotFoundError):
            reader.get_page(chain_hashes(prompt, 8, "tiny", "fp32", namespace="other")[0])
    assert engine.write_through.num_written == 4 and engine.write_through.num_failed == 0
    engine.write_through.close()


def test_queued_pages_go_out_in_batches(start_store: StartStore) -> None:
    """Pages that wait while the writer is busy leave in one put_pages call, and every one reads back."""
    import threading

    store = start_store(host_kv_mib=16)
    client = KVStoreClient(store.address)
    calls: list[int] = []
    release = threading.Event()
    put_pages = client.put_pages

    def counting_put_pages(pages):  # type: ignore[no-untyped-def]
        calls.append(len(pages))
        release.wait(timeout=30)  # the first call holds the writer until every page is queued
        return put_pages(pages)

    client.put_pages = counting_put_pages  # type: ignore[method-assign]
    write_through = WriteThrough(client, "fp32", 64)
    pages = {bytes([i]) * 16: torch.full((256,), i, dtype=torch.uint8) for i in range(41)}
    for page_hash, data in pages.items():
        write_through.submit(page_hash, data, 8)
    release.set()
    write_through.flush()
    assert sum(calls) == 41 and len(calls) <= 3, calls  # 1 page, then the 40 that queued behind it
    assert write_through.num_written == 41 and write_through.num_failed == 0
    with KVStoreClient(store.address) as reader:
        for page_hash, data in pages.items():
            assert reader.get_page(page_hash) == data.numpy().tobytes()
    write_through.close()


def test_pages_completed_in_one_step_are_read_out_of_the_pool_together(start_store: StartStore, smol_tokenizer) -> None:
    """Three sequences decoding in step complete their pages in the same steps: each step's completed pages
    leave the pool in one read (engine._write_pages), not one a sequence, and every page reads back from the
    store byte for byte; the prompt pages of one prefill step too."""
    store = start_store(host_kv_mib=16)
    engine = make_engine(tiny_model(VOCAB, seed=2), smol_tokenizer, num_slots=48, page_size=8, prefill_chunk=64)
    engine.write_through = WriteThrough(KVStoreClient(store.address), "fp32", 64)
    reads: list[int] = []
    read_pages = engine.pool.read_pages

    def counting(slots, local=None):  # type: ignore[no-untyped-def]
        reads.append(len(slots))
        return read_pages(slots, local)

    engine.pool.read_pages = counting  # type: ignore[method-assign]
    seqs = [
        engine.submit(f"b{i}", list(range(400 + 20 * i, 413 + 20 * i)), greedy(12), namespace=f"n{i}") for i in range(3)
    ]  # 13 prompt tokens: one page each at prefill; 3 more tokens end a page in the same step for all three
    run_until_done(engine, seqs)
    engine.write_through.flush()
    assert reads == [3, 3, 3], reads  # prefill's pages, then pages 2 and 3 of each sequence, a read a step
    with KVStoreClient(store.address) as reader:
        for i, seq in enumerate(seqs):
            hashes = chain_hashes(seq.token_ids, 8, "tiny", "fp32", namespace=f"n{i}")
            assert len(hashes) == 3
            for h in hashes:
                slot = engine.slots.lookup(h)
                assert slot is not None
                assert (
                    reader.get_page(h) == engine.pool.read_page(slot).contiguous().view(torch.uint8).numpy().tobytes()
                )
    assert engine.write_through.num_written == 9 and engine.write_through.num_failed == 0
    engine.write_through.close()


def test_pages_leave_the_pool_while_their_write_through_is_under_way(
    smol_tokenizer, store_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow writer (every put 20 ms late): chunks demote pages whose bytes are still queued for the store, the
    reads of those pages (the exact chunks' host pages) wait for their writes, and the tokens are the dense
    reference's."""
    import time

    model = tiny_model(VOCAB, seed=11)
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address, default_policy="exact")  # fmt: skip
    write_through, host = engine.write_through, engine.ring.host
    client = write_through._client
    put_pages = client.put_pages

    def late_put(pages):  # type: ignore[no-untyped-def]
        time.sleep(0.02)
        return put_pages(pages)

    monkeypatch.setattr(client, "put_pages", late_put)
    in_flight: list[int] = []
    wait = host.wait

    def counting_wait(hashes, timeout_s, queued_ok=False):  # type: ignore[no-untyped-def]
        ok = wait(hashes, timeout_s, queued_ok)
        in_flight.append(sum(not write_through.is_written(h) for h in hashes))  # still unwritten as demote goes on
        return ok

    monkeypatch.setattr(host, "wait", counting_wait)
    prompt = random_prompt(70, 5, VOCAB)
    seq = engine.submit("late-writes", prompt, greedy(12))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert isinstance(done, Done) and tokens == reference_greedy(model, prompt, 12)
    assert sum(in_flight) > 0, in_flight  # some demotions did not wait for the store
    assert engine.ring.num_demotions > 10 and write_through.num_failed == 0


def test_a_page_that_fails_before_its_put_leaves_the_writer_running(start_store: StartStore) -> None:
    """A failure while a batch is prepared (here the page's copy event) counts its pages failed and no longer
    queued, and the writer thread goes on with the next page; it used to end the thread, and every page queued
    after it stayed queued (the ring's demotions waiting on them, then a 429)."""

    class BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("the copy's event failed")

    store = start_store(host_kv_mib=16)
    wt = WriteThrough(KVStoreClient(store.address), "fp32", 64)
    bad, good = bytes([1]) * 16, bytes([2]) * 16
    wt.submit(bad, torch.zeros(64, dtype=torch.uint8), 8, ready=BrokenEvent())  # type: ignore[arg-type]
    assert wt.wait_settled([bad], timeout_s=30) and not wt.is_written(bad)
    wt.submit(good, torch.ones(64, dtype=torch.uint8), 8)
    assert wt.wait_written([good], timeout_s=30)
    assert (wt.num_failed, wt.num_written) == (1, 1)
    with KVStoreClient(store.address) as reader:
        assert reader.get_page(good) == bytes([1]) * 64
    wt.close()
