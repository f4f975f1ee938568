"""Scheduler: which sequences run in the next forward step and with how many tokens.

Running sequences go first, oldest first (decode: 1 token; unfinished prefill: a chunk), then
waiting ones are admitted FIFO while the prefill token budget, `max_running` and free slots allow.
When a running sequence needs a slot and none is left, the youngest running sequence is preempted:
its slots are released (its finished pages stay in the prefix cache) and it goes back to the front
of the queue, to be recomputed from its tokens (prompt + output so far) later.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import NamedTuple

from services.common.pagehash import chain_hashes
from services.engine.sequence import PageTable, SeqStatus, Sequence
from services.engine.slots import SlotAllocator

logger = logging.getLogger(__name__)


class Work(NamedTuple):
    """`num_new` tokens of `seq` starting at position `start` go through the model this step."""

    seq: Sequence
    start: int
    num_new: int

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence, so its last logits give the next token."""
        return self.start + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(
        self,
        slots: SlotAllocator,
        page_size: int,
        prefill_chunk: int,
        max_running: int,
        model_id: str,
        kv_format: str,
    ) -> None:
        self.slots = slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.model_id = model_id
        self.kv_format = kv_format
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """The work of the next step; allocates the slots it needs."""
        works: list[Work] = []
        budget = self.prefill_chunk
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            want = 1 if seq.num_uncomputed == 1 else min(seq.num_uncomputed, budget)
            if want == 0:
                continue
            if not self._make_room(seq, want):
                continue
            works.append(Work(seq, seq.num_computed, want))
            if want > 1 or seq.num_uncomputed > 1:
                budget -= want
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            self._match_prefix(seq)
            want = min(seq.num_uncomputed, budget)
            want = min(want, self._fits(seq, want))
            if want <= 0:
                self._unmatch(seq)
                break
            self.waiting.popleft()
            self._grow(seq, seq.num_computed + want)
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            self.running.append(seq)
            works.append(Work(seq, seq.num_computed, want))
            budget -= want
        return works

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's slots and forget it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_all(seq)
        seq.status = SeqStatus.FINISHED

    # -- slots -----------------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _fits(self, seq: Sequence, want: int) -> int:
        """How many of `want` new tokens get slots from what is available now (no preemption)."""
        have = len(seq.page_table.slot_ids) * self.page_size - seq.num_computed
        extra = self.slots.num_available() * self.page_size
        return min(want, have + extra)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        table = seq.page_table
        while len(table.slot_ids) < self._pages_for(num_tokens):
            table.slot_ids.append(self.slots.allocate())

    def _make_room(self, seq: Sequence, want: int) -> bool:
        """Allocate slots for `want` more tokens of a running sequence, preempting the youngest."""
        need = self._pages_for(seq.num_computed + want) - len(seq.page_table.slot_ids)
        while need > self.slots.num_available():
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        self._grow(seq, seq.num_computed + want)
        return True

    def _preempt(self, seq: Sequence) -> None:
        logger.info("preempting %s (%d tokens) for lack of slots", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self._release_all(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_all(self, seq: Sequence) -> None:
        for slot in seq.page_table.slot_ids:
            self.slots.release(slot)
        seq.page_table = PageTable()
        seq.num_computed = 0

    # -- prefix cache ----------------------------------------------------------------------------

    def _match_prefix(self, seq: Sequence) -> None:
        """Reuse the longest run of cached full pages; at least one token is always recomputed."""
        if seq.num_computed or seq.page_table.slot_ids:
            return
        reusable = (seq.num_tokens - 1) // self.page_size
        hashes = chain_hashes(
            seq.token_ids[: reusable * self.page_size],
            self.page_size,
            self.model_id,
            self.kv_format,
            seq.namespace,
        )
        for page_hash in hashes:
            slot = self.slots.lookup(page_hash)
            if slot is None:
                break
            self.slots.acquire(slot)
            seq.page_table.slot_ids.append(slot)
            seq.page_table.page_hashes.append(page_hash)
        seq.num_computed = len(seq.page_table.slot_ids) * self.page_size
        if not seq.admitted_once:
            seq.num_cached = seq.num_computed

    def _unmatch(self, seq: Sequence) -> None:
        """Give back what _match_prefix took when the sequence could not be admitted after all."""
        self._release_all(seq)
        if not seq.admitted_once:
            seq.num_cached = 0
