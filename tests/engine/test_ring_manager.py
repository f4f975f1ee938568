"""The ring manager's bookkeeping alone, without an engine or a store: the resident-set check, plan reuse, and the
prefetched restores written in one batch (and first, when a preemption releases slots inside the batch)."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.kv.slots import SlotAllocator
from services.engine.ring.ring import RingManager
from services.engine.ring.state import SeqRing
from services.engine.ring.summaries import PageSummaries
from services.engine.step.sequence import NOT_RESIDENT, PageTable
from tests.engine.helpers import ring_limits


def test_resident_check_agrees_with_the_set_of_resident_pages() -> None:
    """PageTable.resident_exactly (the scheduler's O(resident pages) invariant check) answers as comparing
    the set of resident pages would, and fails on a table with a page too many, too few, or past its end."""
    rng = random.Random(5)
    for _ in range(200):
        table = PageTable(slot_ids=[rng.choice([NOT_RESIDENT, rng.randrange(64)]) for _ in range(rng.randrange(12))])
        resident = frozenset(table.resident_pages())
        assert resident == {p for p, s in enumerate(table.slot_ids) if s != NOT_RESIDENT}
        assert table.resident_exactly(resident)
        other = frozenset(p for p in range(14) if rng.random() < 0.4)
        assert table.resident_exactly(other) == (other == resident)
    table = PageTable(slot_ids=[3, NOT_RESIDENT, 5, 0])
    assert table.resident_exactly(frozenset({0, 2, 3}))
    assert not table.resident_exactly(frozenset({0, 2}))  # page 3 holds a slot the plan does not want
    assert not table.resident_exactly(frozenset({0, 1, 2, 3}))  # page 1 has none
    assert not table.resident_exactly(frozenset({0, 2, 3, 4}))  # past the table


def test_plans_are_reused_only_for_the_same_length_evidence_and_skeleton() -> None:
    manager = RingManager(ring_limits(budget_pages=8), SlotAllocator(4), pool=None, host=None)  # type: ignore[arg-type]
    ring = SeqRing(summaries=PageSummaries(1, 20, 1, 4, torch.device("cpu")), policy="sparse", query_start=0)
    ring.skeleton = {10}
    ring.evidence = {4, 5}
    plan = manager.plan(ring, 60)
    assert manager.plan(ring, 58) is plan  # the same 15 pages
    assert manager.plan(ring, 64).recent != plan.recent  # a new page
    ring.evidence = {6}  # a re-selection
    assert manager.plan(ring, 60).evidence == {6}
    ring.skeleton = {11}
    assert manager.plan(ring, 60).skeleton == {11}
    ring.evidence = {4, 5}
    ring.skeleton = {10}
    assert manager.plan(ring, 60) == plan


class _RecordingPool:
    slot_nbytes = 8

    def __init__(self) -> None:
        self.writes: list[tuple[list[int], list[list[int]]]] = []

    def write_pages(self, slots: list[int], pages: torch.Tensor) -> None:
        self.writes.append((list(slots), pages.tolist()))


def _prefetched_sequences(
    pages: list[int],
) -> tuple[_RecordingPool, RingManager, list[SeqRing], list[tuple[list[int], list[bytes]]]]:
    """Two sequences of 4 pages, none resident, whose `pages` were fetched ahead (as apply_pending leaves them:
    page p of sequence i holds the bytes [i, p]), beside a manager over a recording pool."""
    pool = _RecordingPool()
    manager = RingManager(ring_limits(budget_pages=8), SlotAllocator(16), pool=pool, host=object())  # type: ignore[arg-type]
    rings, tables = [], []
    for i in range(2):
        r = SeqRing(summaries=PageSummaries(1, 20, 1, 4, torch.device("cpu")), policy="sparse", query_start=0)
        hashes = [bytes([i, p]) for p in range(4)]
        r.prefetched = {hashes[p]: k for k, p in enumerate(pages)}
        r.prefetched_data = torch.tensor([[i, p] for p in pages], dtype=torch.uint8)
        rings.append(r)
        tables.append(([NOT_RESIDENT] * 4, hashes))
    return pool, manager, rings, tables


def test_prefetched_restores_are_written_in_one_batch() -> None:
    """Inside batched_writes the prefetched pages of several sequences reach the pool in one write, as the
    block ends, also when it raises; the same slots get the same bytes as one write per sequence."""
    pool, manager, rings, tables = _prefetched_sequences([1, 3])
    with pytest.raises(RuntimeError), manager.batched_writes():
        manager._restore(*tables[0], [1, 3], rings[0])
        manager._restore(*tables[1], [3], rings[1])  # only one of its pages: its row picked out
        assert pool.writes == []
        raise RuntimeError("a later sequence has no room")
    slots = [tables[0][0][1], tables[0][0][3], tables[1][0][3]]
    assert pool.writes == [(slots, [[0, 1], [0, 3], [1, 3]])]
    assert manager.num_prefetched == 3


def test_a_preemption_inside_batched_writes_writes_what_was_deferred_first() -> None:
    """flush_writes (the scheduler's _preempt calls it) writes the restores deferred so far at once, and the block
    goes on deferring: a slot restored in the block and then released by a preemption is written before anything
    can reuse it, and in order with what comes after."""
    pool, manager, rings, tables = _prefetched_sequences([2])
    manager.flush_writes()  # outside a block: nothing deferred, nothing written
    with manager.batched_writes():
        manager._restore(*tables[0], [2], rings[0])
        manager.flush_writes()
        assert pool.writes == [([tables[0][0][2]], [[0, 2]])]
        manager.flush_writes()  # nothing new
        manager._restore(*tables[1], [2], rings[1])
        assert len(pool.writes) == 1
    assert pool.writes == [([tables[0][0][2]], [[0, 2]]), ([tables[1][0][2]], [[1, 2]])]
