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
`num_steps` decode steps in a row (up to `decode_burst`), each one's argmax the next one's input on the device, the
host coming back only at the burst's end. A burst stays inside every sequence's current page (no page is filled or
allocated mid-burst) and within its max_tokens. A sequence's decode re-selection scores at every rescore_interval-th
of its own steps and takes effect prefetch_steps steps after that (its new pages fetched from the host meanwhile).
With prefetch steps and `switch_in_burst` (the default) both happen on the device, inside a burst: the re-selection
step's query is kept for the page scores the host computes after the burst (Work.score_pos), and a re-selection
already selected by the host takes effect at its step (Work.switch: the burst's steps before it read the old
resident set, the steps from it the new one, both resident for the burst; the next room-making demotes the pages
that left); one not selected yet (its scoring burst unread) ends the burst before its step, as does a pool without
room for both sets. Otherwise a burst ends at or before the next re-selection step (a re-selection scores the burst's
last query) and at the step where the last re-selection takes effect (its scoring step + prefetch_steps). Either
way the same steps attend the same pages whatever the burst size, so a sparse answer does not depend on it. A stop
token mid-burst ends the sequence there: the tokens after it are dropped, their K/V rows lie past num_computed and
are never read.

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
them. The next step's input tokens are the device's own (Work.on_device). A sequence whose last token the
launched burst chooses, or that a stop read meanwhile finished, leaves the continued batch (its row closes up
on the device) instead of ending the chain.

Recurrent layers (qwen3_5's Gated DeltaNet, RecurrentStates): a running sequence holds a state slot; a prefix
is reused only up to a page whose state snapshot exists (on the device or in the kvstore), restored into the
slot at admission, never with a tail page; prefill chunks end at the snapshot boundaries they cross, so that
the state there is snapshotted (recurrent_state.py).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from contextlib import nullcontext

from services.engine.kv.kv_pool import KVPool
from services.engine.kv.recurrent_state import RecurrentStates
from services.engine.kv.slots import SlotAllocator
from services.engine.ring.buckets import BucketPlan
from services.engine.ring.host_pages import HostPages, PagesLostError
from services.engine.ring.ring import RingExhaustedError, RingManager
from services.engine.ring.state import SeqRing
from services.engine.step.prefix_cache import PrefixCache
from services.engine.step.sequence import NOT_RESIDENT, PageTable, SeqStatus, Sequence
from services.engine.step.work import Switch, Work

logger = logging.getLogger(__name__)


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
        self.decode_burst = decode_burst  # most decode steps one step may run (1: no bursts)
        self.burst_ok = burst_ok  # can the runner run these works as a burst (the decode runner accepts them)
        self.pool = pool  # its local rings (a released sequence parks its ring)
        self.slots = slots
        self.page_size = page_size
        self.prefill_chunk = prefill_chunk
        self.max_running = max_running
        self.ring = ring
        self.ring_chunk = ring_chunk or prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self.num_preemptions = 0
        # what ended each decode burst that ran (its shortest limit): "cap" (decode_burst), "page" (a sequence's
        # page end), "tokens" (one's token limit), "scoring" (a step that scores), "rescore" (one's next
        # re-selection step), "due" (where one's last re-selection takes effect, or with switch_in_burst where one
        # not selected yet would), "room" (no room for both read sets of a switch): where burst length goes
        self.burst_cuts: Counter[str] = Counter()
        # why continue_decode left the next step to the host's schedule(), whose room-making the device waits for
        self.continue_declines: Counter[str] = Counter()
        self.continue_leaves = 0  # rows that left a continued batch (a token limit, a stop) instead of ending it
        # ring sequence -> (page table, pages, evidence, skeleton) of its last room-making
        self._room_keys: dict[Sequence, tuple[object, ...]] = {}
        self._failures: list[tuple[Sequence, str]] = []
        self._rest_turn = False  # split steps: this step leaves the host-sampled decodes out (_resting)
        self.prefixes = PrefixCache(
            slots, page_size, model_id, kv_format, self._release_all, new_ring, ring, pool, host, states
        )  # admission through cached prefixes (prefix_cache.py)

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
        # the running sequences' prefetched pages written in one batch (a preemption writes them first: _preempt);
        # one write a sequence kept the device idle between them (32 sessions of 32K at the 8B shape: ~85 ms of a
        # 1.26 s decode window, bench/RESULTS.md round 16)
        with self.ring.batched_writes() if self.ring is not None else nullcontext():
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
            self.prefixes.admit(seq, self.prefill_chunk)
            want = self._chunk(seq, budget)
            if want <= 0 or not self._fits(seq, want):
                self.prefixes.unmatch(seq)
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
        PENDING, scheduled before those tokens are read (module docstring), for the same sequences less those
        that leave the batch: one whose last token `prev` chooses (its token limit) and one that finished while
        `prev` was in flight (a stop read from the step before it). The decode runner takes the staying rows'
        tokens from the device (DecodeGraphs._fill), so a finish does not stop the chain: at batch, sequences
        finish every few steps, and each stop used to leave the device idle while schedule() ran. None when the
        next step needs the host first: a sequence running that `prev` does not hold, one waiting, a work that
        is not a greedy decode, every sequence at its token limit, an exact ring (its steps may stream host
        pages), a re-selection that takes effect at the next step (no prefetch steps), a step that ended on a
        recurrent state boundary (its snapshot is taken when the host reads it, before the state moves on), or
        room that only a preemption would make."""
        running = set(self.running)
        if self.waiting or self.burst_ok is None or not running <= {w.seq for w in prev}:
            return self._decline("others")
        seqs = []
        for w in prev:
            seq, params = w.seq, w.seq.params
            if seq not in running:
                continue  # finished (a stop) while `prev` ran: its row leaves the batch
            if w.num_new != 1 or w.score_only or seq.status is not SeqStatus.RUNNING or seq.num_uncomputed != 1:
                return self._decline("not a decode")
            if not params.device_greedy:
                return self._decline("host-sampled")
            if len(seq.output_ids) >= seq.max_tokens:
                continue  # `prev` chooses its last token: it leaves the batch
            if seq.ring is not None and seq.ring.policy == "exact":
                return self._decline("exact")
            if w.score_tokens and (self.ring is None or self.ring.limits.prefetch_steps == 0):
                return self._decline("scoring, no prefetch")  # its re-selection takes effect at the next step
            if seq.ring is not None and self.ring is not None and self._unselected_due(seq.ring):
                return self._decline("selection due")  # a re-selection not selected yet takes effect at the next step
            if self.states is not None and self.states.is_boundary(w.start + w.num_steps):
                return self._decline("state boundary")  # its state snapshot is taken when the host reads the step
            seqs.append(seq)
        if not seqs:
            return self._decline("token limit")
        self.continue_leaves += len(prev) - len(seqs)
        # the sequences' prefetched pages written in one batch (nothing here preempts or reads a slot)
        with self.ring.batched_writes() if self.ring is not None else nullcontext():
            for seq in seqs:
                try:
                    self._make_room_or_raise(seq, 1, preempt=False)
                except (_NoRoom, PagesLostError, RingExhaustedError) as exc:
                    logger.debug("%s: no continued step (%s); the host schedules the next one", seq.request_id, exc)
                    self._room_keys.pop(seq, None)  # the next schedule plans it again
                    return self._decline(f"room ({type(exc).__name__})")
        works = [w._replace(on_device=True) for w in self._burst([self._work(seq, 1) for seq in seqs])]
        assert all(w.device_argmax for w in works), "a continued decode step the decode runner does not accept"
        return self._stamp(works)

    def _decline(self, why: str) -> list[Work] | None:
        """continue_decode's None, counted by why (continue_declines)."""
        self.continue_declines[why] += 1
        return None

    def _unselected_due(self, ring: SeqRing) -> bool:
        """A re-selection whose scoring step the host has not read yet takes effect at the sequence's next step."""
        assert self.ring is not None
        after = ring.decode_steps + 1 - self.ring.limits.prefetch_steps  # a scoring step at or before it is due
        return any(scored < after for scored in ring.unselected)

    def _stamp(self, works: list[Work]) -> list[Work]:
        """Note the decode clock of each re-selection's scoring step (its prefetch counts from there)."""
        for w in works:
            ring = w.seq.ring
            if w.score_tokens and ring is not None and not w.seq.in_prefill:
                last = w.start + w.num_steps - 1  # the burst's last step has the clock decode_steps
                ring.scored_at = ring.decode_steps - (last - w.score_pos if w.score_pos >= 0 else 0)
                if self.ring is not None and self.ring.limits.prefetch_steps > 0:  # select_deferred takes it
                    ring.unselected.append(ring.scored_at)
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
        if seq.ring is not None and want < min(seq.num_uncomputed, self.prefill_chunk, limit):
            # a ring prompt's chunks are the ones it gets alone, or it waits a step: under `sparse` each chunk
            # attends the pages selected before it, so a chunk cut short by other sequences' share of the step would
            # make the answer depend on what runs beside it
            return 0
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
            replay = self._replay(seq)
            if replay is not None:
                return replay
            query_from = max(seq.num_computed, ring.query_start, end - lim.max_query)
            if lim.query_pass == "exact":  # the chunk attends every page itself: no scoring pass
                return Work(seq, seq.num_computed, want, score_tokens=end - query_from, exact_query=True)
            return Work(seq, seq.num_computed, want, score_tokens=end - query_from, score_only=True,
                        exact_query=lim.query_pass == "attention")  # fmt: skip
        return Work(seq, seq.num_computed, want, score_tokens=min(want, lim.query_tail))

    def _replay(self, seq: Sequence) -> Work | None:
        """The question replay before a prompt's final selection (once): the question span's tokens again, at the
        positions after those computed, in a scoring pass over every earlier page that keeps nothing; None when
        there is none to run (switched off, no question, or the question not before the last chunk)."""
        ring, question = seq.ring, seq.question
        assert ring is not None and self.ring is not None
        lim = self.ring.limits
        if not lim.question_replay or question is None or ring.replayed or question[1] > seq.num_computed:
            return None
        ring.replayed = True
        num = min(question[1] - question[0], lim.max_query)
        return Work(seq, seq.num_computed, num, score_tokens=num, score_only=True,
                    exact_query=lim.query_pass != "bound", replay_from=question[0])  # fmt: skip

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
        steps, cut = self.decode_burst, "cap"

        def limit(most: int, why: str) -> None:
            nonlocal steps, cut
            if most < steps:
                steps, cut = most, why

        lim = self.ring.limits if self.ring is not None else None
        in_burst = lim is not None and lim.switch_in_burst and lim.prefetch_steps > 0
        for w in works:
            seq, params = w.seq, w.seq.params
            if w.num_new != 1 or not w.samples or not params.device_greedy:
                return works
            limit(size - w.start % size, "page")
            limit(seq.max_tokens - len(seq.output_ids), "tokens")
            if w.score_tokens and not in_burst:  # a re-selection scores this step's query: a burst of one
                steps, cut = 1, "scoring"
        rescoring = [w for w in works if self._rescores(w.seq)]
        assert lim is not None or not rescoring
        interval = lim.rescore_interval if lim is not None else 0
        # per rescoring sequence, the index of its re-selection step in the burst (maybe past its end)
        scoring_at: dict[Sequence, int] = {}
        switches: list[tuple[int, Work]] = []  # (the index of the first step with the new evidence, its work)
        for w in rescoring:
            ring = w.seq.ring
            assert ring is not None and lim is not None
            clock = ring.decode_steps  # at the burst's first step (decode_steps counts that step already)
            if interval > 0:
                scoring_at[w.seq] = (-clock) % interval
            if not in_burst:
                if interval > 0:  # end at its next re-selection step at the latest
                    limit(interval - clock % interval + 1, "rescore")
                if ring.scored_at is not None:  # and where its last one takes effect (the same steps see the same
                    due = ring.scored_at + lim.prefetch_steps  # pages whatever the burst size)
                    if clock <= due:
                        limit(due - clock + 1, "due")
                continue
            # on the device: a re-selection scores at any step of the burst (one a burst), and the one before takes
            # effect at any step once it is selected (the host read its scoring step); one not selected yet ends the
            # burst before its step (one scored in this very burst, or in a burst still unread)
            if interval > 0:
                limit(scoring_at[w.seq] + interval, "rescore")
                limit(scoring_at[w.seq] + lim.prefetch_steps + 1, "due")
            for scored in ring.unselected:  # continue_decode declines a burst that would start at one
                limit(scored + lim.prefetch_steps + 1 - clock, "due")
            pending = ring.pending
            if pending is not None and clock <= pending.apply_at:
                switches.append((pending.apply_at + 1 - clock, w))  # its new evidence's first step, > 0
        if not self.burst_ok([w._replace(num_steps=steps, device_argmax=True) for w in works]):
            return works
        placed: dict[Sequence, Switch] = {}
        with self.ring.batched_writes() if switches and self.ring is not None else nullcontext():  # one write
            for at, w in sorted(switches, key=lambda item: item[0]):
                if at >= steps:
                    break
                switch = self._stage_switch(w, at)
                if switch is None:  # no room for both read sets: the burst ends before the switch, the host's then
                    limit(at, "room")
                    break
                placed[w.seq] = switch
        burst = []
        for w in works:
            index = scoring_at.get(w.seq, steps)
            score_pos = w.start + index if index < steps else -1
            burst.append(w._replace(num_steps=steps, score_tokens=int(score_pos >= 0),
                                    score_pos=score_pos if in_burst else -1, device_argmax=True,
                                    switch=placed.get(w.seq)))  # fmt: skip
        self.burst_cuts[cut] += 1
        for w in burst:
            w.seq.local_end = max(w.seq.local_end, w.start + steps)
            if w.seq.ring is not None and self._rescores(w.seq):
                w.seq.ring.decode_steps += steps - 1
        return burst

    def _stage_switch(self, w: Work, at: int) -> Switch | None:
        """Both read sets of a sequence whose pending re-selection takes effect at step `at` of the burst
        resident (its new pages restored beside the ones in use, from the fetched bytes), or None when the pool
        has no room for them (nothing staged). The next room-making applies the re-selection and demotes the
        pages that left (apply_pending, demote)."""
        seq, ring = w.seq, w.seq.ring
        assert ring is not None and ring.pending is not None and self.ring is not None
        table = seq.page_table
        end = w.start + 1  # the burst stays in this page: every step's plan has this page count
        before = self.ring.plan(ring, end).resident
        after = self.ring.plan(ring, end, ring.pending.evidence).resident
        union = before | after
        if self.ring.slots_needed(table.slot_ids, union) > self.slots.num_available():
            return None
        self.ring.stage_pending(ring)
        self.ring.materialize(table.slot_ids, table.page_hashes, union, ring)
        self._room_keys.pop(seq, None)  # the next room-making plans it afresh (and demotes what left)
        return Switch(w.start + at, frozenset(before - after), frozenset(after - before))

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
        if self.ring is not None:
            self.ring.flush_writes()  # restores deferred in this block land before any of their slots is reused
        self.running.remove(seq)
        self._release_all(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release_all(self, seq: Sequence, keep_partial: bool = True, park: bool = True) -> None:
        seq.drop_pending()  # a burst's unread tokens never reach the prefix cache or a parked ring
        self._room_keys.pop(seq, None)
        if keep_partial:
            self.prefixes.keep_partial(seq)
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
