"""Scheduler: which sequences run in the next forward step and with how many tokens.

Running sequences go first, oldest first (decode: 1 token; unfinished prefill: a chunk), then
waiting ones are admitted FIFO while the prefill token budget, `max_running` and free slots allow.
When a running sequence needs a slot and none is left, the youngest running sequence is preempted:
its slots are released (its finished pages stay in the prefix cache) and it goes back to the front
of the queue, to be recomputed from its tokens (prompt + output so far) later.

With a ring (RingManager), a sequence keeps only its planned resident pages (buckets.py): before
each step the pages that left the plan are demoted and the planned ones are made resident; the last
prefill chunk of a sparse over-budget prompt first runs once as a scoring pass so that retrieval
sees the whole query before the chunk is computed for real.

Decode bursts: when every item of a step is a greedy decode the decode runner can run, the step is
`num_steps` decode steps in a row (up to `decode_burst`; one when a step re-selects), each one's argmax
the next one's input on the device, the host coming back only at the burst's end. A burst stays inside every sequence's
current page (no page is filled, demoted or allocated mid-burst), within its max_tokens, and ends at
or before the next re-selection step (a re-selection scores the burst's last query) and at the step where
the last re-selection takes effect (its scoring step + prefetch_steps): the same steps attend the same pages
whatever the burst size, so a sparse answer does not depend on it. A stop token
mid-burst ends the sequence there: the tokens after it are dropped, their K/V rows lie past
num_computed and are never read.

Split steps: a sequence whose tokens the host chooses (a grammar, penalties, logprobs, sampling) cannot run in a
burst. When every running sequence decodes and only some are greedy, steps alternate: one leaves the host-sampled
sequences out (they rest: nothing of theirs is scheduled, so their clocks, pages and rings do not move) and the
greedy ones burst; the next runs every sequence one step, the host sampling its rows. The greedy neighbours keep
most of their burst speed; a host-sampled sequence gets one token per burst + one steps of the device. Each
sequence still runs exactly its own steps, so its tokens and the pages its steps attend are those of the
unsplit schedule. Off by default (`split_bursts`): on the CPU (bench/neighbour_decode.py) it slowed the
host-sampled request 4-5x and the neighbours' gain was within the noise; the GPU, where bursts matter, is unmeasured.

Overlapped bursts: `continue_decode` schedules the decode step (or burst) after one still on the device,
for the same sequences, before its tokens are read (engine.py): the launched burst's tokens hold their
places as PENDING (Sequence.add_pending) and its K/V counts as computed, so the plan, the clock and the
page table move on exactly as if it had been read; only token values are unknown, and nothing here reads
them. The next step's input tokens are the device's own (Work.on_device).

Recurrent layers (qwen3_5's Gated DeltaNet, RecurrentStates): a running sequence holds a state slot; a prefix
is reused only up to a page whose state snapshot exists (on the device or in the kvstore), restored into the
slot at admission, never with a tail page; prefill chunks end at the snapshot boundaries they cross, so that
the state there is snapshotted (recurrent_state.py).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, NamedTuple, cast

from services.common.pagehash import chain_hashes, root_hash
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.recurrent_state import RecurrentStates, state_key
from services.engine.kv.slots import SlotAllocator
from services.engine.ring.buckets import BucketPlan
from services.engine.ring.ring import HostPages, PagesLostError, RingExhaustedError, RingManager, restore_pages
from services.engine.step.sequence import NOT_RESIDENT, PageTable, SeqStatus, Sequence
from services.kvstore.pages import KVStoreError

if TYPE_CHECKING:
    from services.engine.ring.host_pages import KVStoreHostPages

logger = logging.getLogger(__name__)


LOCAL_FILL_WAIT_S = 2.0  # how long a prefix waits for its last pages' host copies before recomputing


class Work(NamedTuple):
    """`num_new` tokens of `seq` starting at position `start` go through the model this step."""

    seq: Sequence
    start: int
    num_new: int
    score_tokens: int = 0  # trailing tokens of this work whose queries score pages (ring)
    score_only: bool = False  # a scoring pass: nothing is kept but the scores
    num_steps: int = 1  # a decode burst: this many greedy decode steps in a row (num_new == 1)
    on_device: bool = False  # its input token is the last step's argmax, not read by the host yet
    device_argmax: bool = False  # its tokens are each step's argmax, chosen on the device (a greedy decode burst)
    # the step attends every earlier page, host-only ones streamed in, and its scoring tokens rank the pages by
    # their real attention mass (RingLimits.query_pass "attention" and "exact"): the prompt's final selection
    exact_query: bool = False

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence, so its last logits give the next token."""
        return not self.score_only and self.start + self.num_new == self.seq.num_tokens


class _NoRoom(Exception):
    """Room for a continued step would take a preemption (continue_decode never preempts)."""


class Scheduler:
    def __init__(
        self,
        slots: SlotAllocator,
        page_size: int,
        prefill_chunk: int,
        max_running: int,
        model_id: str,
        kv_format: str,
        ring: RingManager | None = None,
        ring_chunk: int = 0,
        new_ring: Callable[[Sequence], None] | None = None,
        pool: KVPool | None = None,
        host: HostPages | None = None,
        decode_burst: int = 1,
        burst_ok: Callable[[list[Work]], bool] | None = None,
        states: RecurrentStates | None = None,
        split_bursts: bool = False,
    ) -> None:
        self.split_bursts = split_bursts  # split steps around host-sampled decodes (module docstring)
        self.states = states  # linear-attention layers' states (qwen3_5): prefixes end where a snapshot is
        self.num_state_restores = 0  # prefixes that restored a recurrent-state snapshot
        self.decode_burst = decode_burst  # most decode steps one step may run (1: no bursts)
        self.burst_ok = burst_ok  # can the runner run these works as a burst (the decode runner accepts them)
        self.pool = pool  # for copying matched tail pages
        self.host = host  # the kvstore: prefixes whose pages left the device come back from it
        self.num_host_restored = 0  # pages a sequence without a ring took from the host store
        self.num_local_reuses = 0  # prefixes that took over a parked local ring
        self.num_local_fills = 0  # prefixes whose local ring was filled from host copies
        self.slots = slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.model_id = model_id
        self.kv_format = kv_format
        self.ring = ring
        self.ring_chunk = ring_chunk or prefill_chunk
        self._new_ring = new_ring
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        # ring sequence -> (page table, pages, evidence, skeleton) of its last room-making
        self._room_keys: dict[Sequence, tuple[object, ...]] = {}
        self._failures: list[tuple[Sequence, str]] = []
        self._rest_turn = False  # split steps: this step leaves the host-sampled decodes out (_resting)

    def take_failures(self) -> list[tuple[Sequence, str]]:
        """Sequences the ring could not make room for since the last call (to be failed with 429)."""
        failures, self._failures = self._failures, []
        return failures

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """The work of the next step; allocates (and, with a ring, demotes and restores) slots."""
        works: list[Work] = []
        budget = self.prefill_chunk
        resting = self._resting()
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            decoding = seq.num_uncomputed == 1 and not seq.in_prefill
            if decoding and seq in resting:
                continue  # a split step: the greedy decodes burst without it (module docstring)
            want = 1 if decoding else self._chunk(seq, budget)
            if want == 0:
                continue
            if not self._make_room(seq, want):
                continue
            works.append(self._work(seq, want))
            if not decoding:
                budget -= want
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            if self.slots.num_available() == 0:
                break  # nothing could be admitted: skip the prefix match (it may read the host store)
            seq = self.waiting[0]
            self._admit_prefix(seq)
            want = self._chunk(seq, budget)
            if want <= 0 or not self._fits(seq, want):
                self._unmatch(seq)
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted_once = True
            self.running.append(seq)
            if not self._make_room(seq, want):
                break  # it preempted itself back into the queue
            works.append(self._work(seq, want))
            budget -= want
        return self._stamp(self._burst(works))

    def _resting(self) -> set[Sequence]:
        """The host-sampled decodes that sit out this step (split steps, module docstring): when bursts are on,
        nothing waits, every running sequence decodes and some but not all of them choose their tokens on the
        host, every other step leaves those out so that the greedy ones run as a burst; the step between runs
        every sequence once. Empty otherwise (and the alternation starts afresh)."""
        if not self.split_bursts or self.decode_burst <= 1 or self.burst_ok is None or self.waiting:
            self._rest_turn = False
            return set()
        running = [s for s in self.running if s.status is SeqStatus.RUNNING]
        if not all(s.num_uncomputed == 1 and not s.in_prefill for s in running):
            self._rest_turn = False
            return set()
        host = {s for s in running if not s.params.device_greedy}
        if not host or len(host) == len(running):
            self._rest_turn = False
            return set()
        self._rest_turn = not self._rest_turn
        return host if self._rest_turn else set()

    def continue_decode(self, prev: list[Work]) -> list[Work] | None:
        """The decode step or burst after `prev`, a greedy decode launched on the device whose tokens are
        PENDING, for the same sequences, scheduled before those tokens are read (module docstring). None
        when the next step needs the host first: other sequences running or waiting, a work that is not a
        greedy decode, a sequence at its token limit, an exact ring (its steps may stream host pages), a
        re-selection that takes effect at the next step (no prefetch steps), a step that ended on a recurrent
        state boundary (its snapshot is taken when the host reads it, before the state moves on), or room that
        only a preemption would make."""
        seqs = [w.seq for w in prev]
        if self.waiting or self.burst_ok is None or len(seqs) != len(self.running) or set(seqs) != set(self.running):
            return None
        for w in prev:
            seq, params = w.seq, w.seq.params
            if w.num_new != 1 or w.score_only or seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                return None
            if not params.device_greedy or len(seq.output_ids) >= seq.max_tokens:
                return None
            if seq.ring is not None and seq.ring.policy == "exact":
                return None
            if w.score_tokens and (self.ring is None or self.ring.limits.prefetch_steps == 0):
                return None  # its re-selection takes effect at the very next step: the host selects first
            if self.states is not None and self.states.is_boundary(w.start + w.num_steps):
                return None  # the state snapshot at this boundary is taken when the host reads the step
        # the sequences' prefetched pages written in one batch (nothing here preempts or reads a slot)
        with self.ring.batched_writes() if self.ring is not None else nullcontext():
            for seq in seqs:
                try:
                    self._make_room_or_raise(seq, 1, preempt=False)
                except (_NoRoom, PagesLostError, RingExhaustedError) as exc:
                    logger.debug("%s: no continued step (%s); the host schedules the next one", seq.request_id, exc)
                    self._room_keys.pop(seq, None)  # the next schedule plans it again
                    return None
        works = [w._replace(on_device=True) for w in self._burst([self._work(seq, 1) for seq in seqs])]
        assert all(w.device_argmax for w in works), "a continued decode step the decode runner does not accept"
        return self._stamp(works)

    def _stamp(self, works: list[Work]) -> list[Work]:
        """Note the decode clock of each re-selection's scoring step (its prefetch counts from there)."""
        for w in works:
            ring = w.seq.ring
            if w.score_tokens and ring is not None and not w.seq.in_prefill:
                ring.scored_at = ring.decode_steps
        return works

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence's slots and forget it."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release_all(seq)
        seq.status = SeqStatus.FINISHED

    # -- work shapes -----------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, budget: int) -> int:
        limit = self.ring_chunk if seq.ring is not None else budget
        want = min(seq.num_uncomputed, budget, limit)
        if seq.ring is not None and self.ring is not None and seq.in_prefill:
            # end a chunk where the query starts, so the last chunk holds the whole query and the
            # scoring pass reads all of it (a query split across chunks would be scored in part)
            prompt_len = len(seq.prompt_ids)
            query_from = max(seq.ring.query_start, prompt_len - self.ring.limits.max_query)
            end = seq.num_computed + want
            if seq.num_computed < query_from < end < prompt_len and prompt_len - query_from <= limit:
                want = query_from - seq.num_computed
        return self._state_chunk(seq, want)

    def _state_chunk(self, seq: Sequence, want: int) -> int:
        """A prefill chunk of a model with recurrent layers ends at the last snapshot boundary it crosses, so
        that the state there is snapshotted (recurrent_state.py)."""
        if self.states is None or not seq.in_prefill:
            return want
        interval = self.states.interval
        boundary = (seq.num_computed + want) // interval * interval
        return boundary - seq.num_computed if boundary > seq.num_computed else want

    def _work(self, seq: Sequence, want: int) -> Work:
        work = self._shape(seq, want)
        if not work.score_only:  # the step writes these ring rows (a scoring pass writes none)
            seq.local_end = max(seq.local_end, seq.num_computed + want)
        return work

    def _shape(self, seq: Sequence, want: int) -> Work:
        ring = seq.ring
        if ring is None or self.ring is None or not self._over_budget(seq) or ring.policy != "sparse":
            return Work(seq, seq.num_computed, want)
        lim = self.ring.limits
        end = seq.num_computed + want
        if not seq.in_prefill:
            # decode: only the step that re-selects evidence scores (its query token), once every
            # rescore_interval of the sequence's own decode steps (never of the engine's: the answer must not
            # depend on what ran before it)
            ring.decode_steps += 1
            return Work(seq, seq.num_computed, want, score_tokens=1 if self._rescore_at(ring.decode_steps) else 0)
        if end == len(seq.prompt_ids):
            if ring.final_scored or not lim.retrieval:
                return Work(seq, seq.num_computed, want)
            query_from = max(seq.num_computed, ring.query_start, end - lim.max_query)
            if lim.query_pass == "exact":  # the chunk attends every page itself: no scoring pass
                return Work(seq, seq.num_computed, want, score_tokens=end - query_from, exact_query=True)
            return Work(seq, seq.num_computed, want, score_tokens=end - query_from, score_only=True,
                        exact_query=lim.query_pass == "attention")  # fmt: skip
        return Work(seq, seq.num_computed, want, score_tokens=min(want, lim.query_tail))

    def _rescore_at(self, clock: int) -> bool:
        """Decode re-selection steps: every rescore_interval-th decode step of a sequence (its ring's clock)."""
        assert self.ring is not None
        interval = self.ring.limits.rescore_interval
        return interval > 0 and clock % interval == 0

    def _rescores(self, seq: Sequence) -> bool:
        """A decoding sequence whose steps re-select evidence (a sparse ring over its budget)."""
        ring = seq.ring
        return ring is not None and self.ring is not None and ring.policy == "sparse" and self._over_budget(seq)

    def _burst(self, works: list[Work]) -> list[Work]:
        """The step's works as one decode burst of as many steps as every sequence allows (module
        docstring), or unchanged (one step)."""
        if self.decode_burst <= 1 or not works or self.burst_ok is None:
            return works
        size = self.page_size
        steps = self.decode_burst
        for w in works:
            seq, params = w.seq, w.seq.params
            if w.num_new != 1 or not w.samples or not params.device_greedy:
                return works
            steps = min(steps, size - w.start % size, seq.max_tokens - len(seq.output_ids))
            if w.score_tokens:  # a re-selection scores this step's query: a burst of one (tokens on the device)
                steps = 1
        rescoring = [w.seq for w in works if self._rescores(w.seq)]
        assert self.ring is not None or not rescoring
        interval = self.ring.limits.rescore_interval if self.ring is not None else 0
        for seq in rescoring:
            ring = seq.ring  # its decode_steps counts the burst's first step already (never a scoring one here)
            assert ring is not None and self.ring is not None
            if interval > 0:  # end at its next re-selection step at the latest
                steps = min(steps, interval - ring.decode_steps % interval + 1)
            if ring.scored_at is not None:  # and where its last one takes effect (the same steps see the same
                due = ring.scored_at + self.ring.limits.prefetch_steps  # pages whatever the burst size)
                if ring.decode_steps <= due:
                    steps = min(steps, due - ring.decode_steps + 1)
        last = {seq: seq.ring.decode_steps + steps - 1 for seq in rescoring}  # type: ignore[union-attr]
        burst = [
            w._replace(num_steps=steps, score_tokens=int(w.seq in last and self._rescore_at(last[w.seq])),
                       device_argmax=True)
            for w in works
        ]  # fmt: skip
        if not self.burst_ok(burst):
            return works
        for w in burst:
            w.seq.local_end = max(w.seq.local_end, w.start + steps)
            if w.seq.ring is not None and self._rescores(w.seq):
                w.seq.ring.decode_steps += steps - 1
        return burst

    def _over_budget(self, seq: Sequence) -> bool:
        assert self.ring is not None
        return -(-seq.num_tokens // self.page_size) > self.ring.limits.budget_pages

    # -- slots -----------------------------------------------------------------------------------

    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _needed(self, seq: Sequence, want: int, plan: BucketPlan | None = None) -> int:
        """Slots this sequence still lacks for a step of `want` tokens (`plan`: its ring's plan for the step,
        when the caller has it)."""
        end = seq.num_computed + want
        if seq.ring is None or self.ring is None:
            return self._pages_for(end) - len(seq.page_table.slot_ids)
        if plan is None:
            plan = self.ring.plan(seq.ring, end)
        return self.ring.slots_needed(seq.page_table.slot_ids, plan.resident)

    def _fits(self, seq: Sequence, want: int) -> bool:
        return self._needed(seq, want) <= self.slots.num_available()

    def _make_room(self, seq: Sequence, want: int) -> bool:
        """Make the step's pages resident, preempting the youngest running sequences if needed."""
        try:
            return self._make_room_or_raise(seq, want)
        except PagesLostError as exc:
            logger.warning("%s: %s; recomputing it", seq.request_id, exc)
            self.recompute(seq)
            return False
        except RingExhaustedError as exc:
            logger.warning("%s: %s", seq.request_id, exc)
            if seq in self.running:
                self.running.remove(seq)
            self._failures.append((seq, str(exc)))
            return False

    def _make_room_or_raise(self, seq: Sequence, want: int, preempt: bool = True) -> bool:
        end = seq.num_computed + want
        table = seq.page_table
        plan: BucketPlan | None = None
        if seq.ring is not None and self.ring is not None:
            ring = seq.ring
            self.ring.apply_pending(ring)  # a decode re-selection whose step has come
            # a decode step inside an already resident page, with the same evidence and skeleton as the
            # step before: the plan (and so the resident set) is the same; skip walking the page table
            # (compared before a new key is built: the sets are copied only when they changed)
            num_pages = -(-end // self.page_size)
            last = self._room_keys.get(seq)
            if (
                last is not None
                and last[0] is table
                and last[1] == num_pages
                and last[2] == ring.evidence
                and last[3] == ring.skeleton
            ):
                return True
            self._room_keys[seq] = (table, num_pages, frozenset(ring.evidence), frozenset(ring.skeleton))
            # one plan for the whole room-making: it depends on the sequence's length, evidence and skeleton,
            # which neither demote nor preempting another sequence changes (preempting this one returns)
            plan = self.ring.plan(ring, end)
            self.ring.demote(table.slot_ids, table.page_hashes, plan.resident, ring)
            computed_pages = seq.num_computed // self.page_size
            hidden = computed_pages - sum(1 for p in plan.resident if p < computed_pages)
            if ring.policy == "sparse":
                ring.hidden_pages = max(ring.hidden_pages, hidden)
        while self._needed(seq, want, plan) > self.slots.num_available():
            if not preempt:
                raise _NoRoom(f"{self._needed(seq, want, plan)} slot(s) needed, {self.slots.num_available()} free")
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        if plan is not None and seq.ring is not None and self.ring is not None:
            self.ring.materialize(table.slot_ids, table.page_hashes, plan.resident, seq.ring)
            # the invariant, in O(resident pages) (PageTable.resident_exactly), not a walk of every page
            assert table.resident_exactly(plan.resident), (table.resident_pages(), plan)
        else:
            while len(table.slot_ids) < self._pages_for(end):
                table.slot_ids.append(self.slots.allocate())
        return True

    def recompute(self, seq: Sequence) -> None:
        """Drop a running sequence's KV (e.g. its host pages were lost) and queue it to be recomputed."""
        if seq in self.running:
            self._preempt(seq)

    def _preempt(self, seq: Sequence) -> None:
        logger.info("preempting %s (%d tokens) for lack of slots", seq.request_id, seq.num_tokens)
        self.running.remove(seq)
        self._release_all(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_all(self, seq: Sequence, keep_partial: bool = True, park: bool = True) -> None:
        seq.drop_pending()  # a burst's unread tokens never reach the prefix cache or a parked ring
        self._room_keys.pop(seq, None)
        if keep_partial:
            self._keep_partial(seq)
        for slot in seq.page_table.slot_ids:
            if slot != NOT_RESIDENT:
                self.slots.release(slot)
        if seq.ring is not None and self.ring is not None:
            self.ring.release(seq.ring)
        if seq.local_ring >= 0:
            self._park_or_release_local(seq, park)
        if seq.state_slot >= 0 and self.states is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = -1
        seq.page_table = PageTable()
        seq.num_computed = 0
        seq.ring = None

    def _park_or_release_local(self, seq: Sequence, park: bool) -> None:
        """Park the sequence's local ring under its last full page when the ring still holds the window
        before that page's end, possibly with positions written ahead (a decode burst cut short by a stop:
        ParkedRing); a step that wrote so far ahead that the window is overwritten frees it (an overlapped
        burst that ran into the next page after a stop near a page end: the next turn fills a ring afresh)."""
        assert self.pool is not None and self.pool.local is not None
        local, table, size = self.pool.local, seq.page_table, self.page_size
        start = len(table.page_hashes) * size
        computed, ahead = seq.num_computed, seq.local_end - seq.num_computed
        # the next turn takes it over at the last full page (LocalRings.covers at `start`)
        window_kept = seq.local_end - local.span <= max(0, start - local.window + 1)
        if park and table.page_hashes and computed >= start and ahead >= 0 and window_kept:
            tail = tuple(seq.token_ids[start:computed])
            local.park(table.page_hashes[-1], seq.local_ring, computed, tail, seq.local_end)
        else:
            local.release(seq.local_ring)
        seq.local_ring = -1
        seq.local_end = 0

    # -- prefix cache ----------------------------------------------------------------------------

    def _keep_partial(self, seq: Sequence) -> None:
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

    def _admit_prefix(self, seq: Sequence) -> None:
        """Give the sequence its ring state and reuse the longest run of cached full pages
        (at least one token is always recomputed)."""
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
            self._restore_host_prefix(seq, hashes[device_pages:])
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

    def _restore_host_prefix(self, seq: Sequence, chain: list[bytes]) -> None:
        """Without a ring every page is resident: the leading pages of `chain` the host store holds come
        to the device now, in one batched restore, as far as slots allow while the next prefill chunk
        (and one page more) still fits. Pages gone from the store are simply recomputed."""
        assert self.host is not None and self.pool is not None
        size = self.page_size
        count = self.host.leading_present(chain)
        have = len(seq.page_table.slot_ids)
        while count > 0:
            rest = -(-min(self.prefill_chunk, seq.num_tokens - (have + count) * size) // size) + 1
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

    def _unmatch(self, seq: Sequence) -> None:
        """Give back what _admit_prefix took when the sequence could not be admitted after all."""
        self._release_all(seq, keep_partial=False)
        if not seq.admitted_once:
            seq.num_cached = 0
