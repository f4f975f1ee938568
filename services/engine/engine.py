"""Engine: the step loop (schedule, run the model, post-process) and the thread-safe request API.

Overlapped bursts (`decode_overlap`): when a step chose its tokens on the device (a greedy decode burst),
the next step for the same sequences is scheduled and launched (Scheduler.continue_decode) before the
tokens of the first are read, so the host's work for step k + 1 (scheduling, the ring's restores and
demotions, the graph's inputs) and its reading and streaming of step k's tokens happen while the device
runs step k + 1: the device does not wait for the host between bursts. A launched burst's tokens are
PENDING in their sequence's output (Sequence.add_pending) until read; a stop among them ends the sequence
there and the step after it is dropped (its K/V rows lie past what the sequence computed). The tokens are
the same as without overlap: the scheduler's plan, clock and re-selections do not depend on token values,
and a re-selection's prefetch counts from its scoring step. The chain ends whenever a request arrives or
is aborted, a step needs the host's sampling, or the scheduler declines (continue_decode).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, cast

import torch

from services.common.pagehash import page_hash, root_hash
from services.common.tokenizer import Tokenizer
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.slots import SlotAllocator
from services.engine.kv.transfers import copied, to_host
from services.engine.records import (
    ContextLengthError,
    EngineLimits,
    EngineStats,
    EngineStoppedError,
    OverloadedError,
    RingSnapshot,
)
from services.engine.ring.host_pages import PagesLostError
from services.engine.ring.ring import RingManager
from services.engine.ring.selection import PromptIndex
from services.engine.ring.state import SeqRing
from services.engine.ring.summaries import PageSummaries
from services.engine.step.detokenizer import Detokenizer
from services.engine.step.grammar import GrammarCompiler, GrammarError, GrammarTables
from services.engine.step.model_runner import Launched, ModelRunner
from services.engine.step.sampling import InvalidRequestError, Row, Sampled, SamplingParams, sample_batch
from services.engine.step.scheduler import Scheduler
from services.engine.step.sequence import NOT_RESIDENT, Chunk, Done, Failed, FinishReason, SeqStatus, Sequence
from services.engine.step.work import Work

if TYPE_CHECKING:
    from services.engine.kv.write_through import WriteThrough

logger = logging.getLogger(__name__)


class Engine:
    """Owns the scheduler, the runner and the loop thread. `submit` and `abort` are thread-safe."""

    def __init__(
        self,
        limits: EngineLimits,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        write_through: WriteThrough | None = None,
    ) -> None:
        self.limits = limits
        self.runner = runner
        self.pool: KVPool = runner.pool
        self.tokenizer = tokenizer
        self.write_through = write_through
        self.slots = SlotAllocator(self.pool.num_slots)
        self.ring = RingManager(limits.ring, self.slots, self.pool, runner.host) if limits.ring else None
        self.scheduler = Scheduler(
            self.slots, limits.page_size, limits.prefill_chunk, limits.max_running, limits.model_id,
            limits.kv_format, self.ring, limits.ring_chunk, self._new_ring if self.ring else None, self.pool,
            runner.host, limits.decode_burst, runner.accepts_burst, runner.states, limits.split_bursts,
        )  # fmt: skip
        self.stats = EngineStats()
        self.ring_snapshot = RingSnapshot()
        self._snapshot_running: tuple[int, ...] = ()
        # (slot, page hash) of pages _publish_pages completed whose write-through read is deferred to one batch
        # (_write_pages): at a page end of 32 decoding sequences, one read of the pool, not 32
        self._unwritten: list[tuple[int, bytes]] = []
        self._eos_ids = frozenset(tokenizer.info.eos_token_ids)
        self._lock = threading.Condition()
        self._incoming: deque[Sequence] = deque()
        self._aborts: set[Sequence] = set()
        self._stopped = False
        self._closed = False  # the loop has ended: submit refuses (EngineStoppedError)
        self._thread: threading.Thread | None = None
        # called (engine thread) when the loop ends on an error it could not contain: the process exits (the
        # launcher restarts it) instead of serving requests that no step will ever run (__main__ sets it)
        self.on_loop_death: Callable[[], None] | None = None
        self.grammar_tables = GrammarTables.of(tokenizer, limits.vocab_size)  # built from start() on, off the loop

    # -- API (any thread) ------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: str = "",
        prefill_policy: str = "",
        query_start: int | None = None,
        question: tuple[int, int] | None = None,
        question_alone: bool = False,
    ) -> Sequence:
        """Validate and queue a request; raises InvalidRequestError, ContextLengthError, OverloadedError.
        `query_start`: where the ring's query span starts; `question`: tokens [start, end) the ring reads again
        at the prompt's end to rank its pages (RingLimits.question_replay), `question_alone`: it ranks them alone
        (the query span asks nothing)."""
        lim = self.limits
        params.validate(lim.vocab_size)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < lim.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {lim.vocab_size})")
        room = lim.max_context - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the prompt has {len(prompt_ids)} tokens; the context limit is {lim.max_context} "
                "and at least 1 token must be left for the answer"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthError(
                f"prompt {len(prompt_ids)} + max_tokens {params.max_tokens} = "
                f"{len(prompt_ids) + params.max_tokens} tokens > context limit {lim.max_context}"
            )
        policy = prefill_policy or lim.default_policy
        if policy not in ("sparse", "exact"):
            raise InvalidRequestError(f"prefill_policy must be sparse or exact, got {policy!r}")
        if query_start is not None and not 0 <= query_start < len(prompt_ids):
            raise InvalidRequestError(f"query_start {query_start} is outside the prompt [0, {len(prompt_ids)})")
        if question is not None and not 0 <= question[0] < question[1] <= len(prompt_ids):
            raise InvalidRequestError(f"question {question} is not a span of the prompt [0, {len(prompt_ids)})")
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        matcher = self._grammar_compiler().matcher(params.grammar) if params.grammar is not None else None
        if matcher is not None and params.ignore_eos:
            raise InvalidRequestError("a grammar ends the answer with end-of-sequence: ignore_eos cannot be set")
        if matcher is not None:
            matcher.set_budget(params.max_tokens or room)  # refuses a budget below the shortest document's
        seq = Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=params,
            namespace=namespace,
            max_tokens=params.max_tokens or room,
            stop_token_ids=frozenset(stop_ids),
            detokenizer=Detokenizer(self.tokenizer, params.stop),
            generator=params.make_generator(self.pool.device),
            prefill_policy=policy,
            query_start=query_start if query_start is not None else -1,
            question=question,
            question_alone=question_alone and question is not None,
            matcher=matcher,
        )
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine has stopped: no step will run this request")
            queued = len(self._incoming) + len(self.scheduler.waiting)
            if queued >= lim.max_waiting:
                raise OverloadedError(f"{queued} requests are waiting (max_waiting {lim.max_waiting})")
            self._incoming.append(seq)
            self.stats.requests_total += 1
            self._lock.notify()
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        """The grammar compiler, built on a background thread since `start` (a first constrained request waits
        for what is left of that build, never builds it again)."""
        return self.grammar_tables.compiler()

    def token_bytes(self, token: int) -> bytes:
        """A token's own bytes (logprobs' `bytes`), from the grammar tables' reading of the vocabulary; where
        those cannot be built (xgrammar missing: constrained requests are refused too), its text's UTF-8."""
        try:
            return self.grammar_tables.token_bytes(token)
        except GrammarError:
            return self.tokenizer.decode([token]).encode("utf-8")

    def abort(self, seq: Sequence) -> None:
        """Stop a request (client went away); its slots are released at the next step."""
        with self._lock:
            self._aborts.add(seq)
            self._lock.notify()

    def start(self) -> None:
        self.grammar_tables.start()  # seconds of reading the vocabulary, before any constrained request
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.ring is not None:
            self.ring.close()  # a prefetch in flight reads the host store
        if self.runner.host is not None:
            self.runner.host.close()  # unregisters the host arena mappings before they are unmapped

    # -- the loop (engine thread only) -----------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stopped or self._incoming or self._aborts or self.scheduler.has_work()):
                        self._lock.wait()
                    if self._stopped:
                        break
                self.poll()
                if self.scheduler.has_work():
                    self.step()
        except Exception:
            logger.critical("the engine loop died: failing its requests and stopping the engine", exc_info=True)
            self._fail_all("internal", "the engine failed while running this request", close=True)
            if self.on_loop_death is not None:
                self.on_loop_death()
            return
        self._fail_all("unavailable", "the engine is shutting down", close=True)

    def _fail_all(self, code: str, message: str, close: bool = False) -> None:
        """Fail every sequence the scheduler holds (engine thread); `close`: the loop ends, so the ones not yet
        taken in fail too and submit refuses from now on (nothing is queued after the queue is emptied here)."""
        incoming: deque[Sequence] = deque()
        with self._lock:
            if close:
                self._closed = True
                incoming, self._incoming = self._incoming, deque()
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *incoming]:
            try:
                self._fail(seq, code, message)
            except Exception:  # noqa: BLE001 -- the others must still hear of it
                logger.exception("%s: failing it failed", seq.request_id)

    def poll(self) -> None:
        """Take new requests into the scheduler and finish aborted ones (engine thread)."""
        with self._lock:
            incoming, self._incoming = self._incoming, deque()
            aborts, self._aborts = self._aborts, set()
        for seq in incoming:
            self.scheduler.add(seq)
        for seq in aborts:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)

    def step(self) -> None:
        """One iteration: schedule, run the model, post-process."""
        try:
            works = self.scheduler.schedule()
        except Exception:  # its state may be half-changed: fail what it holds rather than run on it
            logger.exception("scheduling failed; failing the engine's %d sequences", len(self.scheduler.running)
                             + len(self.scheduler.waiting))  # fmt: skip
            self.stats.step_failures_total += 1
            self._fail_all("internal", "the engine failed while scheduling this request")
            return
        for seq, message in self.scheduler.take_failures():
            self._fail(seq, "overloaded", message)
        if not works:
            time.sleep(0.001)  # nothing fits right now (waiting for slots): don't spin hot
            return
        try:
            launched: Launched | None = self._launch(works)
            while launched is not None:  # each continued burst is launched before its predecessor is read
                following = self._continue(launched)
                self._postprocess(launched)
                self.stats.steps_total += 1
                if self.ring is not None and self._snapshot_stale(launched.works):
                    self.ring_snapshot = self._take_ring_snapshot()
                launched = following
                if launched is not None:
                    works = launched.works
        except PagesLostError as exc:  # an exact step streamed host pages that are gone
            logger.warning("%s; recomputing the %d sequence(s) of this step", exc, len(works))
            for w in works:
                self.scheduler.recompute(w.seq)
        except Exception:
            logger.exception("step failed; failing its %d sequences", len(works))
            self.stats.step_failures_total += 1
            for w in works:
                self._fail(w.seq, "internal", "the engine failed while running this request")

    def _launch(self, works: list[Work]) -> Launched:
        """Run the works; a step that chose its tokens on the device leaves them PENDING in each sequence's
        output, its K/V counted as computed, until _postprocess reads them."""
        launched = self.runner.launch(works)
        if launched.tokens is not None:
            for w in works:
                w.seq.add_pending(w.num_steps)
                w.seq.num_computed = w.start + w.num_steps
        return launched

    def _continue(self, launched: Launched) -> Launched | None:
        """The next step of the same sequences, launched before `launched` is read (module docstring), or
        None: overlap off, host sampling, a request or an abort to take in first, the engine stopping, or the
        scheduler declines."""
        if not self.limits.decode_overlap or launched.tokens is None:
            return None
        if self._incoming or self._aborts or self._stopped:  # the loop takes them in (or stops) first
            return None
        works = self.scheduler.continue_decode(launched.works)
        if works is None:
            return None
        self.stats.overlapped_steps_total += 1
        return self._launch(works)

    def _snapshot_stale(self, works: list[Work]) -> bool:
        """The bucket counts change only when the running set, a sequence's page count or its
        evidence changes: a decode step inside a page keeps them (spares a walk of every page table)."""
        running = tuple(id(s) for s in self.scheduler.running)
        size = self.limits.page_size
        stale = running != self._snapshot_running or any(
            w.num_new != 1 or w.score_tokens or w.start % size == 0 or (w.start + w.num_steps) % size == 0
            for w in works
        )
        self._snapshot_running = running
        return stale

    def _take_ring_snapshot(self) -> RingSnapshot:
        assert self.ring is not None
        totals = [0] * 6
        for seq in self.scheduler.running:
            if seq.ring is None:
                continue
            counts = self.ring.counts(seq.ring, max(1, seq.num_computed))
            for i, n in enumerate(counts):
                totals[i] += n
            # host-only: computed pages without a slot (list.count, not a Python walk of every page: with
            # staggered re-selections this runs after nearly every burst, over sessions x pages)
            computed_pages = seq.num_computed // self.limits.page_size
            slots = seq.page_table.slot_ids
            totals[5] += slots[:computed_pages].count(NOT_RESIDENT) + max(0, computed_pages - len(slots))
        return RingSnapshot(*totals)

    def _postprocess(self, launched: Launched) -> None:
        works = launched.works
        tokens: Iterator[list[int | Sampled]]
        if launched.tokens is not None:  # chosen on the device (PENDING in the outputs): read them
            tokens = iter(list[int | Sampled](t) for t in self.runner.tokens(launched))
        else:
            sampling = [w.seq for w in works if w.samples]
            rows = [
                Row(s.params, s.generator, s.prompt_ids, s.output_ids, s.matcher, self._tokens_left(s))
                for s in sampling
            ]
            sampled = sample_batch(launched.logits, rows)
            tokens = iter([t] for t in sampled)  # one token per sampling work
        try:
            self._take_step(launched, tokens)
        finally:
            self._write_pages()

    def _take_step(self, launched: Launched, tokens: Iterator[list[int | Sampled]]) -> None:
        """_postprocess of each work: its ring upkeep, its tokens, its completed pages."""
        for w, page_scores in zip(launched.works, launched.scores, strict=True):
            seq = w.seq
            chosen = next(tokens) if w.samples or launched.tokens is not None else []
            if seq.is_finished:
                continue  # stopped in the step before this continued one (or aborted, failed): dropped
            if seq.ring is not None and self.ring is not None:
                self._ring_after_step(w, page_scores, seq.ring, chosen)
            if w.score_only:
                continue
            if not chosen:
                seq.num_computed = w.start + w.num_new
                self._publish_pages(seq, seq.num_computed)
                continue
            if launched.tokens is not None and len(chosen) > 1 and self._whole_runs(seq):
                self._append_run(seq, w.start + w.num_new, cast(list[int], chosen))  # device tokens: ints
                continue
            for i, token in enumerate(chosen):  # one token per step of a burst, as steps one by one
                computed = w.start + w.num_new + i
                if launched.tokens is None:
                    seq.num_computed = computed
                self._publish_pages(seq, computed)
                self._append(seq, token if isinstance(token, int) else token.token, token)
                if seq.is_finished:
                    break  # a stop mid-burst: the tokens after it are dropped

    def _ring_after_step(
        self, w: Work, scores: torch.Tensor | None, ring: SeqRing, chosen: list[int | Sampled] | None = None
    ) -> None:
        """Fold the step's page scores in and re-select evidence when the schedule says so (`chosen`: the step's
        tokens, a burst's in order, not taken into the sequence yet)."""
        assert self.ring is not None
        if w.replay_from >= 0:  # a question replay: its scores wait for the query span's (the final selection)
            self.ring.keep_replay_scores(ring, scores)
            return
        if scores is not None:
            self.ring.add_scores(ring, scores, w.score_tokens)
        candidates = w.start // self.limits.page_size
        # the scoring step's index in a burst (any of its steps with switch_in_burst, else its last)
        at = (w.score_pos if w.score_pos >= 0 else w.start + w.num_steps - 1) - w.start
        end = w.start + at + w.num_new  # what the recent window covers once this selection is in use
        if w.score_only or w.exact_query or (w.score_tokens and w.seq.in_prefill):  # a prompt's selection
            if w.score_only or w.exact_query:  # its final one (the next chunk's evidence otherwise)
                ring.final_scored = True
            self.ring.select(ring, candidates, w.seq.request_id, self.stats.steps_total, end)
            self.ring.prefetch_selection(ring, w.seq.page_table.slot_ids, w.seq.page_table.page_hashes, end)
        elif w.score_tokens:  # decode: the scheduler scores only the steps that re-select
            seq, table = w.seq, w.seq.page_table
            prompt, recent = None, list[int]()
            if ring.prompt_tokens is not None:  # follow_copy: the answer's tokens up to the scoring step's own (a
                n = self.ring.limits.follow_copy  # burst's scoring step may be any of its steps: the burst's tokens
                prompt = ring.prompt_tokens  # before it count, as single steps would have read them), the prompt's
                known = seq.known_outputs  # before the first ones
                ahead = [t if isinstance(t, int) else t.token for t in (chosen or [])[:at]]
                recent = (seq.prompt_ids[-n:] + seq.output_ids[max(0, known - n) : known] + ahead)[-n:]
            self.ring.select_deferred(
                ring, candidates, seq.request_id, self.stats.steps_total, table.slot_ids, table.page_hashes, end,
                prompt, recent,
            )  # fmt: skip

    def _new_ring(self, seq: Sequence) -> None:
        """Ring state for a sequence being admitted (summaries sized to its longest possible context)."""
        assert self.ring is not None
        cfg = self.runner.model.config
        size = self.limits.page_size
        max_pages = -(-min(self.limits.max_context, len(seq.prompt_ids) + seq.max_tokens) // size)
        summaries = PageSummaries(
            self.pool.num_layers, max_pages, cfg.num_kv_heads, cfg.head_dim, self.pool.device, self.pool.paged_layers
        )
        query_start = seq.query_start
        if query_start < 0:
            query_start = max(0, len(seq.prompt_ids) - self.ring.limits.query_tail)
        seq.ring = SeqRing(summaries=summaries, policy=seq.prefill_policy, query_start=query_start,
                           question_alone=seq.question_alone)  # fmt: skip
        if self.ring.limits.follow_copy:  # what copy following searches, made once here, not in a decode step
            seq.ring.prompt_tokens = PromptIndex(seq.prompt_ids)
        self.ring.set_query(seq.ring, len(seq.prompt_ids))

    def _tokens_left(self, seq: Sequence) -> int:
        """The tokens the answer may still take, the next one included (max_tokens, the context limit)."""
        known = seq.known_outputs
        return min(seq.max_tokens - known, self.limits.max_context - len(seq.prompt_ids) - known)

    def _take(self, seq: Sequence, token: int) -> None:
        """The next output token into the sequence (the first PENDING one when a burst is being read), counted."""
        if seq.num_pending:
            seq.fill_pending(token)
        else:
            seq.output_ids.append(token)
        if seq.known_outputs == 1:
            self.stats.prompt_tokens_total += len(seq.prompt_ids)
            self.stats.cached_tokens_total += seq.num_cached
        self.stats.generated_tokens_total += 1

    def _append(self, seq: Sequence, token: int, sampled: Sampled | int | None = None) -> None:
        """The next output token: stream it, stop on it; a grammar advances by it."""
        if seq.matcher is not None and not seq.matcher.accept(token):  # the mask allowed it: never expected
            logger.error("%s: token %d is outside its grammar", seq.request_id, token)
            self._fail(seq, "internal", "the answer left its grammar")
            return
        self._take(seq, token)
        known = seq.known_outputs
        reason: FinishReason | None = None
        if token in seq.stop_token_ids:  # a document the budget closed ends "length", as it was cut there
            closed = seq.matcher is not None and seq.matcher.closed_by_budget
            reason = FinishReason.LENGTH if closed else FinishReason.STOP
            text = seq.detokenizer.update(seq.output_ids, known - 1) + seq.detokenizer.flush()
        else:
            text = seq.detokenizer.update(seq.output_ids, known)
            if seq.detokenizer.matched_stop is not None:
                reason = FinishReason.STOP
        if reason is None and self._tokens_left(seq) <= 0:
            reason = FinishReason.LENGTH
            text += seq.detokenizer.flush()
        logprobs = (sampled,) if isinstance(sampled, Sampled) and sampled.logprob is not None else ()
        seq.events.put(Chunk([token], text, logprobs))
        if reason is not None:
            self._finish(seq, reason)

    def _whole_runs(self, seq: Sequence) -> bool:
        """A burst's tokens may be taken as one run (_append_run): no stop string to find between them, no
        grammar to advance, no recurrent-state boundary to publish at."""
        return not seq.detokenizer.has_stops and seq.matcher is None and self.runner.states is None

    def _append_run(self, seq: Sequence, first_computed: int, tokens: list[int]) -> None:
        """A burst's device-chosen tokens, as _append of each in turn after _publish_pages of its step (the
        tokens up to the first stop token or the length limit), with one page publication, one detokenizer
        update and one event for the run: per token that was ~30 us of the engine thread at batch 32."""
        reason: FinishReason | None = None
        taken = 0
        for token in tokens:
            self._take(seq, token)
            taken += 1
            if token in seq.stop_token_ids:
                reason = FinishReason.STOP
                break
            if self._tokens_left(seq) <= 0:
                reason = FinishReason.LENGTH
                break
        self._publish_pages(seq, first_computed + taken - 1)  # the last token's step: every page before it
        known = seq.known_outputs
        text = seq.detokenizer.update(seq.output_ids, known - 1 if reason is FinishReason.STOP else known)
        if reason is not None:
            text += seq.detokenizer.flush()
        seq.events.put(Chunk(tokens[:taken], text))
        if reason is not None:
            self._finish(seq, reason)

    def _publish_pages(self, seq: Sequence, computed: int) -> None:
        """Hash every page completed within the first `computed` tokens (whose values are known), offer it
        to the prefix cache and write it through."""
        table = seq.page_table
        size = self.limits.page_size
        written: list[int] = []  # pages to write through, read out of the pool in one batch (one copy)
        while len(table.page_hashes) < computed // size:
            i = len(table.page_hashes)
            parent = table.page_hashes[-1] if table.page_hashes else root_hash(seq.namespace)
            h = page_hash(parent, seq.token_ids[i * size : (i + 1) * size], self.limits.model_id, self.limits.kv_format)
            table.page_hashes.append(h)
            self.slots.register(table.slot_ids[i], h)
            if self.write_through is not None and self.write_through.wants(h):
                written.append(i)
        if written and self.pool.local is not None:  # local rings: the pages' local rows are this sequence's
            self._read_through([table.slot_ids[i] for i in written], [table.page_hashes[i] for i in written],
                               (seq.local_ring, written))  # fmt: skip
        else:
            self._unwritten.extend((table.slot_ids[i], table.page_hashes[i]) for i in written)
        states = self.runner.states
        if states is not None and states.is_boundary(computed) and len(table.page_hashes) * size == computed:
            self._write_pages()  # the pages before the state
            states.publish(seq.state_slot, table.page_hashes[-1], self.write_through)  # the state after `computed`

    def _write_pages(self) -> None:
        """Write through the pages _publish_pages deferred, read out of the pool in one batch, at the end of a
        step's post-processing (and before a failure's). Until then the pages' slots hold them: post-processing
        allocates no slot (a ring's selections move slots in the scheduler), so a slot a finished sequence
        released in it is not yet another page's."""
        if not self._unwritten:
            return
        pages: dict[bytes, int] = {}  # hash -> slot, in completion order; a page two sequences share: once
        for slot, h in self._unwritten:
            pages.setdefault(h, slot)
        self._unwritten = []
        self._read_through(list(pages.values()), list(pages), None)

    def _read_through(self, slots: list[int], hashes: list[bytes], local: tuple[int, list[int]] | None) -> None:
        """One read of these pages out of the pool, copied to host memory behind the step and queued for the
        write-through thread (which waits for the copy, not the engine: a burst may be in flight)."""
        assert self.write_through is not None
        pages = to_host(self.pool.read_pages(slots, local))
        ready = copied(self.pool.device)
        for h, page in zip(hashes, pages, strict=True):
            self.write_through.submit(h, page, self.limits.page_size, ready=ready)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        matched = seq.detokenizer.matched_stop or ""
        ring = seq.ring
        policy = ring.policy if ring is not None and ring.outgrew_device else "resident"
        unverified = ring is not None and ring.unverified
        if unverified:
            logger.warning(
                "%s: prompt of %d tokens exceeded the ring budget under the sparse policy; %d page(s) were not "
                "attended: the answer is flagged unverified (use prefill_policy=exact for an exact answer)",
                seq.request_id, len(seq.prompt_ids), ring.hidden_pages if ring else 0,
            )  # fmt: skip
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        done = Done(reason, len(seq.prompt_ids), len(seq.output_ids), seq.num_cached, matched, policy, unverified)
        seq.events.put(done)

    def _fail(self, seq: Sequence, code: str, message: str) -> None:
        try:
            self._write_pages()  # before its slots are released
        except Exception:  # noqa: BLE001 -- a failing read of the pool must not keep the sequence from failing
            logger.exception("writing through completed pages failed; they stay device-only")
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq)
        seq.finish_reason = FinishReason.ERROR
        seq.events.put(Failed(code, message))
