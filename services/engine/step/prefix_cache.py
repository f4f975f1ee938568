"""The prefix cache at admission: a waiting sequence takes the longest run of its pages that are already computed.

Full pages are found by their hash chain (services/common/pagehash.py) among the device's slots, then in the host
store (a ring adopts those lazily; without one they are restored now, as far as slots allow); the tail page's
computed start is copied from a cached partial page (never shared). A sequence with local rings (sliding-window
layers) takes over the ring a previous sequence parked at its prefix's last page, or fills a fresh one from the
host copies of the window before it; recurrent layers (qwen3_5) reuse a prefix only up to a page whose state
snapshot exists, restored into the sequence's state slot. At least one token is always recomputed (its logits
give the next token). The scheduler owns the sequences; this only fills their page tables and counts what it
reused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from services.common.pagehash import chain_hashes, root_hash
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.recurrent_state import RecurrentStates, state_key
from services.engine.kv.slots import SlotAllocator
from services.engine.ring.host_pages import HostPages, PagesLostError
from services.engine.ring.ring import RingManager, restore_pages
from services.engine.step.sequence import NOT_RESIDENT, Sequence
from services.kvstore.pages import KVStoreError

if TYPE_CHECKING:
    from services.engine.ring.host_pages import KVStoreHostPages

logger = logging.getLogger(__name__)


LOCAL_FILL_WAIT_S = 2.0  # how long a prefix waits for its last pages' host copies before recomputing


class PrefixCache:
    """Admission through cached prefixes (module docstring) for the scheduler's sequences."""

    def __init__(
        self,
        slots: SlotAllocator,
        page_size: int,
        model_id: str,
        kv_format: str,
        release_all: Callable[..., None],
        new_ring: Callable[[Sequence], None] | None = None,
        ring: RingManager | None = None,
        pool: KVPool | None = None,
        host: HostPages | None = None,
        states: RecurrentStates | None = None,
    ) -> None:
        self.slots = slots
        self.page_size = page_size
        self.model_id = model_id
        self.kv_format = kv_format
        self._release_all = release_all  # the scheduler's: every slot, ring and state of a sequence given back
        self._new_ring = new_ring
        self.ring = ring
        self.pool = pool  # for copying matched tail pages
        self.host = host  # the kvstore: prefixes whose pages left the device come back from it
        self.states = states
        self.num_host_restored = 0  # pages a sequence without a ring took from the host store
        self.num_local_reuses = 0  # prefixes that took over a parked local ring
        self.num_local_fills = 0  # prefixes whose local ring was filled from host copies
        self.num_state_restores = 0  # prefixes that restored a recurrent-state snapshot

    def keep_partial(self, seq: Sequence) -> None:
        """Offer the computed part of the tail page to later requests (its rows get copied, never shared)."""
        size = self.page_size
        table = seq.page_table
        last, filled = divmod(seq.num_computed, size)
        if filled == 0 or last >= len(table.slot_ids) or table.slot_ids[last] == NOT_RESIDENT:
            return
        if len(table.page_hashes) != last:
            return  # the hash chain is not complete up to the tail page
        parent = table.page_hashes[-1] if table.page_hashes else root_hash(seq.namespace)
        self.slots.register_partial(table.slot_ids[last], parent, tuple(seq.token_ids[last * size : seq.num_computed]))

    def _match_partial(self, seq: Sequence, limit: int | None = None) -> None:
        """After the full pages, copy the longest matching start of a cached tail page (leaving >= 1 token),
        at most `limit` tokens (local rings: what the adopted parked ring holds)."""
        size = self.page_size
        table = seq.page_table
        parent = table.page_hashes[-1] if table.page_hashes else root_hash(seq.namespace)
        end = min(seq.num_tokens - 1, seq.num_computed + size)
        if limit is not None:
            end = min(end, seq.num_computed + limit)
        want = seq.token_ids[seq.num_computed : end]
        best_slot, best = -1, 0
        for slot, tokens in self.slots.lookup_partial(parent):
            n = 0
            while n < min(len(tokens), len(want)) and tokens[n] == want[n]:
                n += 1
            if n > best:
                best_slot, best = slot, n
        if best == 0 or self.pool is None or self.slots.num_available() < 2:
            return
        self.slots.acquire(best_slot)  # keep it from being the slot we allocate
        dst = self.slots.allocate()
        self.pool.copy_rows(best_slot, dst, best)
        self.slots.release(best_slot)
        table.slot_ids.append(dst)
        seq.num_computed += best

    def admit(self, seq: Sequence, chunk: int) -> None:
        """Give the sequence its ring state and reuse the longest run of cached full pages
        (at least one token is always recomputed); `chunk`: the prefill tokens a step may take (room is kept
        for the next one)."""
        if seq.num_computed or seq.page_table.slot_ids:
            return
        local = self.pool.local if self.pool is not None else None
        if self._new_ring is not None:
            self._new_ring(seq)
        reusable = (seq.num_tokens - 1) // self.page_size
        hashes = chain_hashes(
            seq.token_ids[: reusable * self.page_size], self.page_size, self.model_id, self.kv_format, seq.namespace
        )
        if self.states is not None:  # a prefix ends where the linear layers' state was snapshotted
            seq.state_slot = self.states.allocate()
            hashes = hashes[: self._state_prefix(hashes)]
        for page_hash in hashes:
            slot = self.slots.lookup(page_hash)
            if slot is None:
                break
            self.slots.acquire(slot)
            seq.page_table.slot_ids.append(slot)
            seq.page_table.page_hashes.append(page_hash)
        device_pages = len(seq.page_table.slot_ids)
        if seq.ring is not None and self.ring is not None:  # then the host store, materialised lazily
            self.ring.summarize(seq.ring, seq.page_table.slot_ids, range(device_pages))
            self.ring.adopt_host_prefix(
                seq.ring, seq.page_table.slot_ids, seq.page_table.page_hashes, hashes[device_pages:]
            )
        elif self.host is not None and self.pool is not None and device_pages < len(hashes):
            self._restore_host_prefix(seq, hashes[device_pages:], chunk)
        if self.states is not None:
            self._restore_state(seq)
        seq.num_computed = len(seq.page_table.slot_ids) * self.page_size
        if self.states is not None:
            pass  # no tail page: its rows would need the state in the middle of a page
        elif local is None:
            self._match_partial(seq)
        elif not self._local_prefix(seq):
            self._release_all(seq, keep_partial=False, park=False)  # recomputed from the start
            seq.local_ring = local.allocate()
            if self._new_ring is not None:
                self._new_ring(seq)
        if not seq.admitted_once:
            seq.num_cached = seq.num_computed

    def _state_prefix(self, hashes: list[bytes]) -> int:
        """The most pages of `hashes` that end at a state snapshot, on the device or in the host store (0: none);
        a snapshot only in the store is brought to the device's snapshots now."""
        assert self.states is not None
        per = self.states.interval // self.page_size
        ends = [n for n in range(len(hashes) // per * per, 0, -per)]  # boundaries, longest first
        for n in ends:
            if self.states.has(hashes[n - 1]):
                return n
        if self.host is None or not ends:
            return 0
        host = cast("KVStoreHostPages", self.host)
        keys = [state_key(hashes[n - 1]) for n in ends]
        try:
            present = host.present(keys)
        except KVStoreError as exc:
            logger.warning("state snapshots not looked up (%s): the prefix is recomputed", exc)
            return 0
        for n, key, found in zip(ends, keys, present, strict=True):
            if not found:
                continue
            data = host.fetch_blob(key, self.states.nbytes)
            if data is not None:
                self.states.put_bytes(hashes[n - 1], data)
                return n
        return 0

    def _restore_state(self, seq: Sequence) -> None:
        """The matched prefix (cut back to the last page with a snapshot) and its state into the sequence's slot;
        no snapshot: nothing is reused."""
        assert self.states is not None
        table = seq.page_table
        per = self.states.interval // self.page_size
        n = len(table.slot_ids) // per * per
        while n > 0 and not self.states.has(table.page_hashes[n - 1]):
            n -= per
        if seq.ring is not None and n < len(table.slot_ids):  # the ring adopted its host pages: start over
            self._release_all(seq, keep_partial=False, park=False)
            seq.state_slot = self.states.allocate()
            if self._new_ring is not None:
                self._new_ring(seq)
            return
        if n < len(table.slot_ids):
            for slot in table.slot_ids[n:]:
                if slot != NOT_RESIDENT:
                    self.slots.release(slot)
            del table.slot_ids[n:]
            del table.page_hashes[n:]
        if n and self.states.restore(seq.state_slot, table.page_hashes[n - 1]):
            self.num_state_restores += 1

    def _local_prefix(self, seq: Sequence) -> bool:
        """The local ring of a sequence whose cached prefix of whole pages was just matched: the ring a
        previous sequence parked at that page (with as much of the tail page as both share), else a
        fresh ring filled from the host copies of the prefix's last pages. False when neither can be had."""
        assert self.pool is not None and self.pool.local is not None
        local, table = self.pool.local, seq.page_table
        parked = local.take(table.page_hashes[-1]) if table.page_hashes else None
        if parked is not None and not local.covers(parked, seq.num_computed):
            local.release(parked.ring_id)  # cannot happen with ring_span's size; never read a stale row
            parked = None
        if parked is not None:
            seq.local_ring = parked.ring_id
            self.num_local_reuses += 1
            ahead = seq.token_ids[seq.num_computed : seq.num_computed + len(parked.tail)]
            shared = next((i for i, (a, b) in enumerate(zip(ahead, parked.tail, strict=False)) if a != b), len(ahead))
            self._match_partial(seq, limit=shared)
            seq.local_end = seq.num_computed  # rows past it are the parked sequence's: overwritten, never read
            return True
        seq.local_ring = local.allocate()
        return seq.num_computed == 0 or self._fill_local_ring(seq)

    def _fill_local_ring(self, seq: Sequence) -> bool:
        """A reused prefix's last pages into the sequence's local ring (the window of its first new token),
        from their host copies; False when they cannot be had (the prefix is then dropped)."""
        assert self.pool is not None and self.pool.local is not None
        if self.host is None:
            return False
        local, size = self.pool.local, self.page_size
        end = seq.num_computed  # whole pages (a tail page is matched only with a parked ring)
        pages = list(range(max(0, end - local.window + 1) // size, end // size))
        hashes = [seq.page_table.page_hashes[p] for p in pages]
        missing = [h for h in hashes if not self.host.has(h)]
        if missing and self.host.leading_present(missing) < len(missing):
            # pages this engine computed may still be on their way to the store: wait a little, not the loop
            if not self.host.wait(missing, timeout_s=LOCAL_FILL_WAIT_S):
                logger.info("%s: its prefix's last pages have no host copy; recomputing", seq.request_id)
                return False
        try:
            data = self.host.fetch_to(hashes, self.pool.device, self.pool.local_parts)
        except PagesLostError:
            logger.info("%s: its prefix's last pages left the host store; recomputing", seq.request_id)
            return False
        self.pool.write_local_pages([local.page_row(seq.local_ring, p) for p in pages], data)
        self.num_local_fills += 1
        return True

    def _restore_host_prefix(self, seq: Sequence, chain: list[bytes], chunk: int) -> None:
        """Without a ring every page is resident: the leading pages of `chain` the host store holds come
        to the device now, in one batched restore, as far as slots allow while the next prefill chunk
        (and one page more) still fits. Pages gone from the store are simply recomputed."""
        assert self.host is not None and self.pool is not None
        size = self.page_size
        count = self.host.leading_present(chain)
        have = len(seq.page_table.slot_ids)
        while count > 0:
            rest = -(-min(chunk, seq.num_tokens - (have + count) * size) // size) + 1
            if count + rest <= self.slots.num_available():
                break
            count -= 1
        if count <= 0:
            return
        wanted = chain[:count]
        try:
            slots = restore_pages(self.host, self.pool, self.slots, wanted)
        except PagesLostError as exc:
            logger.info("%s: %d host page(s) are gone; recomputing them", seq.request_id, len(exc.page_hashes))
            return
        seq.page_table.slot_ids.extend(slots)
        seq.page_table.page_hashes.extend(wanted)
        self.num_host_restored += count

    def unmatch(self, seq: Sequence) -> None:
        """Give back what admit took when the sequence could not be admitted after all."""
        self._release_all(seq, keep_partial=False)
        if not seq.admitted_once:
            seq.num_cached = 0
