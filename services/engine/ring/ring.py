"""The KVMem ring: a sequence whose KV outgrows its share of the device pool keeps only the pages
that matter resident (buckets.py) and pulls the rest back from the host copy on demand.

RingManager is called by the scheduler (what must be resident before a step) and by the engine
(after a step: select evidence from the scores the step accumulated). It owns no slots: it asks the
SlotAllocator, reads the KVPool, and restores pages through a HostPages reader.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from itertools import chain, compress
from pathlib import Path

import numpy as np
import torch

from services.engine.kv.kv_pool import KVPool
from services.engine.kv.slots import SlotAllocator
from services.engine.kv.transfers import device_index
from services.engine.ring.buckets import BucketCounts, BucketPlan, plan_buckets
from services.engine.ring.host_pages import HostPages
from services.engine.ring.selection import PromptIndex, copy_source, page_ranking, pick_pages, taking_turns
from services.engine.ring.state import PendingEvidence, RingLimits, SeqRing
from services.engine.step.sequence import NOT_RESIDENT

logger = logging.getLogger(__name__)


class RingExhaustedError(RuntimeError):
    """Room cannot be made for a sequence's resident pages; maps to RESOURCE_EXHAUSTED (429)."""


def _on_host(scores: torch.Tensor) -> torch.Tensor:
    """Page scores as float32 in host memory, without a dispatch when they are already."""
    if scores.requires_grad or scores.dtype != torch.float32 or scores.device.type != "cpu":
        return scores.detach().float().cpu()
    return scores


def restore_pages(host: HostPages, pool: KVPool, slots: SlotAllocator, page_hashes: list[bytes]) -> list[int]:
    """Bring finished pages back from the host store into fresh slots, registered in the prefix cache:
    one batched transfer (of the bytes slots keep) and one pool write. Returns the slots in page order;
    PagesLostError when any page is gone (nothing is allocated then)."""
    data = host.fetch_to(page_hashes, pool.device, pool.slot_parts)
    new = [slots.allocate() for _ in page_hashes]
    pool.write_pages(new, data)
    for slot, page_hash in zip(new, page_hashes, strict=True):
        slots.register(slot, page_hash)
    return new


class RingManager:
    def __init__(self, limits: RingLimits, slots: SlotAllocator, pool: KVPool, host: HostPages | None) -> None:
        self.limits = limits
        self.slots = slots
        self.pool = pool
        self.host = host
        self.num_restores = 0
        self.restored_bytes = 0
        self.num_demotions = 0
        self.num_prefetched = 0  # restored pages whose bytes were fetched ahead of their step
        # one thread fetches re-selected pages off the step's path, on its own CUDA stream
        prefetching = limits.prefetch_steps > 0 and host is not None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="kvmem-prefetch") if prefetching else None
        self._stream = torch.cuda.Stream(pool.device) if prefetching and pool.device.type == "cuda" else None
        self._audit = Path(limits.audit_dir) if limits.audit_dir else None
        if self._audit is not None:
            self._audit.mkdir(parents=True, exist_ok=True)
        self._deferred: list[tuple[list[int], torch.Tensor]] | None = None  # prefetched writes (batched_writes)

    @contextmanager
    def batched_writes(self) -> Iterator[None]:
        """Restores of prefetched pages inside this block are written to the pool in one batch as it ends (also
        when it raises), not one write per sequence: the scheduler makes room for every decoding sequence in turn,
        and nothing reads a slot before the step runs. A sequence that releases its slots inside the block (a
        preemption) calls `flush_writes` first, so that no slot restored in the block is released and reused
        before its bytes are written."""
        assert self._deferred is None, "batched_writes does not nest"
        self._deferred = []
        try:
            yield
        finally:
            deferred, self._deferred = self._deferred, None
            self._write_deferred(deferred)

    def flush_writes(self) -> None:
        """Write the restores deferred so far in a batched_writes block now (the block goes on deferring)."""
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            self._write_deferred(deferred)

    def _write_deferred(self, deferred: list[tuple[list[int], torch.Tensor]]) -> None:
        if len(deferred) == 1:
            self.pool.write_pages(*deferred[0])
        elif deferred:
            slots = [slot for new, _ in deferred for slot in new]
            self.pool.write_pages(slots, torch.cat([data for _, data in deferred]))

    # -- planning ---------------------------------------------------------------------------------

    def plan(self, ring: SeqRing, num_tokens: int, evidence: set[int] | None = None) -> BucketPlan:
        """The resident set once the sequence holds `num_tokens` tokens' worth of pages (with `evidence`: the
        set it will hold once a pending re-selection is in effect, else its own)."""
        lim = self.limits
        num_pages = -(-num_tokens // lim.page_size)
        evidence = (ring.evidence if evidence is None else evidence) if lim.retrieval else set()
        # plan_buckets is a function of these and of the (frozen) limits only: the same inputs, the same plan
        cached = ring.plans.get(num_pages)
        if cached is not None and cached[0] == evidence and cached[1] == ring.skeleton:
            return cached[2]
        plan = plan_buckets(num_pages, lim.budget_pages, lim.protect_pages, lim.recent_pages, ring.skeleton, evidence)
        if len(ring.plans) >= 4:  # a sequence asks about its current and next page (and a scoring pass's)
            ring.plans.clear()
        ring.plans[num_pages] = (frozenset(evidence), frozenset(ring.skeleton), plan)
        return plan

    def counts(self, ring: SeqRing, num_tokens: int) -> BucketCounts:
        return self.plan(ring, num_tokens).counts(self.limits.budget_pages)

    def set_query(self, ring: SeqRing, prompt_len: int) -> None:
        """Skeleton = the pages holding the query span (capped at skeleton_pages, the last ones)."""
        size = self.limits.page_size
        first, last = ring.query_start // size, (prompt_len - 1) // size
        ring.skeleton = set(range(max(first, last - self.limits.skeleton_pages + 1), last + 1))
        ring.summaries.vote_top = self.limits.vote_top
        ring.summaries.score_from = self.limits.score_from

    def summarize(self, ring: SeqRing, slot_ids: list[int], pages: range | list[int]) -> None:
        """Summaries of resident full pages from the pool (pages reused from the prefix cache)."""
        pages = [p for p in pages if slot_ids[p] != NOT_RESIDENT]
        if not pages:
            return
        size = self.limits.page_size
        page_t = device_index(pages, self.pool.device)
        rows = self.pool.rows(device_index([slot_ids[p] for p in pages], self.pool.device))
        valid = torch.ones(len(pages), size, dtype=torch.bool, device=self.pool.device)
        for layer in self.pool.paged_layers:
            ring.summaries.update_from_pool(layer, page_t, self.pool, rows, valid)

    def adopt_host_prefix(
        self, ring: SeqRing, page_table: list[int], page_hashes: list[bytes], chain: list[bytes]
    ) -> int:
        """Extend a sequence's cached prefix with the pages of `chain` the host store holds (after the
        ones found on the device): they join the page table as not resident (materialised lazily, when
        the plan wants them) and their summaries are computed from the host bytes. Returns pages adopted."""
        if self.host is None or not chain:
            return 0
        count = self.host.leading_present(chain)
        if count == 0:
            return 0
        adopted = chain[:count]
        first = len(page_hashes)
        device = ring.summaries.kmin.device
        # summaries need the keys; no slot keeps the pages (a long prefix's stay in the store, read a layer at a time)
        held = None if self.pool.host_pages_fit(count) else self.host.hold(adopted, device)
        pages = self.host.fetch_to(adopted, device) if held is None else None
        size = self.limits.page_size
        ids = torch.arange(first, first + count, device=device)
        valid = torch.ones(count, size, dtype=torch.bool, device=device)
        try:
            for layer in self.pool.paged_layers:
                if held is not None:
                    data = held.read(list(range(count)), self.pool.layer_part(layer), device)
                else:
                    assert pages is not None
                    data = self.pool.pages_layer_bytes(list(pages), layer, device)
                keys, _ = self.pool.layer_kv(data, layer, torch.float32)
                ring.summaries.update(layer, ids, keys.view(count, size, *keys.shape[1:]), valid)
        finally:
            if held is not None:
                held.release()
        page_table.extend([NOT_RESIDENT] * count)
        page_hashes.extend(adopted)
        self.host.pin(adopted)
        ring.pinned.extend(adopted)
        ring.pinned_set.update(adopted)
        ring.num_adopted += count
        return count

    # -- residency (scheduler, before a step) ----------------------------------------------------

    def demote(self, slot_ids: list[int], page_hashes: list[bytes], keep: frozenset[int], ring: SeqRing) -> None:
        """Release the slots of finished pages outside `keep`; their host copy (written, or on its way) is
        authoritative."""
        # the pages with a slot, found in C (a long context's table has hundreds of pages, a few dozen resident)
        resident = compress(range(len(slot_ids)), map(NOT_RESIDENT.__lt__, slot_ids))
        victims = [i for i in resident if i not in keep and i < len(page_hashes)]
        if not victims:
            return
        if self.host is None:
            raise RingExhaustedError("no host KV store: pages cannot leave the device")
        hashes = [page_hashes[i] for i in victims]
        # a page whose bytes are on their way to the store (read out of the pool, queued for the write-through) may
        # leave: its slot's next writer runs after that read on the stream, and its reads and pin wait for the write.
        # Waiting here for the store's copy kept the device idle ~60 ms a 8K chunk of the 8B shape (bench/RESULTS.md)
        if not self.host.wait(hashes, timeout_s=30.0, queued_ok=True):
            raise RingExhaustedError(f"{len(hashes)} page(s) have no host copy, nor one on its way; cannot demote them")
        fresh = [h for h in hashes if h not in ring.pinned_set]
        self.host.pin(fresh)
        ring.pinned.extend(fresh)
        ring.pinned_set.update(fresh)
        for i in victims:
            self.slots.release(slot_ids[i])
            slot_ids[i] = NOT_RESIDENT
        ring.num_demotions += len(victims)
        self.num_demotions += len(victims)

    def release(self, ring: SeqRing) -> None:
        """The sequence is done with its host pages (a pending re-selection and its fetch are dropped)."""
        ring.pending = None
        ring.fetch_ahead = None
        ring.prefetched = {}
        ring.prefetched_data = None
        if self.host is not None and ring.pinned:
            self.host.unpin(ring.pinned)
            ring.pinned = []
            ring.pinned_set = set()

    def slots_needed(self, slot_ids: list[int], keep: frozenset[int]) -> int:
        """Pages of `keep` without a slot (new pages and pages to restore)."""
        return sum(1 for p in keep if p >= len(slot_ids) or slot_ids[p] < 0)

    def materialize(self, slot_ids: list[int], page_hashes: list[bytes], keep: frozenset[int], ring: SeqRing) -> None:
        """Give every page of `keep` a slot: new pages get empty ones, finished pages are restored
        from the device prefix cache when still there, else from the host in one batch."""
        while len(slot_ids) < (max(keep) + 1 if keep else 0):
            slot_ids.append(-1)
        if ring.fetch_ahead is not None:  # a prompt selection's pages, fetched ahead (prefetch_selection)
            fetch, ring.fetch_ahead = ring.fetch_ahead, None
            self._take_fetch(ring, fetch)
        to_fetch: list[int] = []
        for p in sorted(keep):
            if slot_ids[p] >= 0:
                continue
            cached = self.slots.lookup(page_hashes[p]) if p < len(page_hashes) else None
            if cached is not None:
                self.slots.acquire(cached)
                slot_ids[p] = cached
            elif p < len(page_hashes):
                to_fetch.append(p)
            else:
                slot_ids[p] = self.slots.allocate()
        if to_fetch:
            self._restore(slot_ids, page_hashes, to_fetch, ring)
        ring.prefetched = {}
        ring.prefetched_data = None

    def _restore(self, slot_ids: list[int], page_hashes: list[bytes], pages: list[int], ring: SeqRing) -> None:
        """Pages fetched ahead (prefetched) are written from the device; the rest come from the host now."""
        assert self.host is not None
        ahead = [p for p in pages if page_hashes[p] in ring.prefetched]
        now = [p for p in pages if page_hashes[p] not in ring.prefetched]
        if ahead:
            new = [self.slots.allocate() for _ in ahead]
            data = ring.prefetched_data
            assert data is not None
            rows = [ring.prefetched[page_hashes[p]] for p in ahead]
            if rows != list(range(data.shape[0])):  # else every fetched page, in the fetch's (page) order
                data = data.index_select(0, device_index(rows, data.device))
            if self._deferred is not None:
                self._deferred.append((new, data))
            else:
                self.pool.write_pages(new, data)
            for p, slot in zip(ahead, new, strict=True):
                self.slots.register(slot, page_hashes[p])
                slot_ids[p] = slot
            self.num_prefetched += len(ahead)
        if now:
            slots = restore_pages(self.host, self.pool, self.slots, [page_hashes[p] for p in now])
            for p, slot in zip(now, slots, strict=True):
                slot_ids[p] = slot
        nbytes = len(pages) * self.pool.slot_nbytes  # what moved: the bytes slots keep
        ring.num_restores += len(pages)
        ring.restored_bytes += nbytes
        self.num_restores += len(pages)
        self.restored_bytes += nbytes

    # -- selection (engine, after a scoring step) ------------------------------------------------

    def add_scores(self, ring: SeqRing, scores: torch.Tensor, num_query_tokens: int) -> None:
        """Accumulate one step's page scores ([pages], unit mass per query token and head)."""
        scores = _on_host(scores)
        if scores.dim() == 2:  # per-head masses [heads, pages] of an attention query pass (fused in select)
            ring.scores = scores
            ring.scored_tokens += num_query_tokens
            return
        if ring.scores is None:  # the first (a decode re-selection's only) scoring step: a copy, later ones add to it
            ring.scores = scores.add(0.0)  # the values zeros + scores held (-0.0 made 0.0 too), in one op
            ring.scored_tokens += num_query_tokens
            return
        if ring.scores.shape[0] < scores.shape[0]:
            grown = torch.zeros(scores.shape[0])
            grown[: ring.scores.shape[0]] = ring.scores
            ring.scores = grown
        ring.scores[: scores.shape[0]] += scores
        ring.scored_tokens += num_query_tokens

    def keep_replay_scores(self, ring: SeqRing, scores: torch.Tensor | None) -> None:
        """A question replay's page scores, kept apart for the prompt's final selection (select ranks them)."""
        ring.replay_scores = None if scores is None else _on_host(scores)

    def select_deferred(
        self,
        ring: SeqRing,
        num_candidate_pages: int,
        request_id: str,
        step: int,
        slot_ids: list[int],
        page_hashes: list[bytes],
        end_tokens: int = 0,
        prompt: PromptIndex | None = None,
        recent: Sequence[int] = (),
    ) -> None:
        """A decode re-selection: with prefetch_steps, `select` now, in effect prefetch_steps decode steps
        later (apply_pending); meanwhile the chosen pages that are only on the host are fetched to the
        device in the background, so the step that takes them in does not wait for the store."""
        if self.limits.prefetch_steps <= 0:
            self.select(ring, num_candidate_pages, request_id, step, end_tokens, prompt, recent)
            return
        self.apply_pending(ring, force=True)  # an earlier re-selection takes effect first
        current = ring.evidence
        self.select(ring, num_candidate_pages, request_id, step, end_tokens, prompt, recent)
        chosen, ring.evidence = ring.evidence, current
        wanted = self._to_prefetch(ring, chosen, slot_ids, page_hashes, end_tokens)
        fetch = self._prefetch(wanted) if wanted and self._prefetcher is not None else None
        # from the scoring step's clock, not this call's: an overlapped burst may already be scheduled after it
        assert ring.unselected, "a decode re-selection without its scoring step"
        ring.pending = PendingEvidence(chosen, ring.unselected.popleft() + self.limits.prefetch_steps, fetch)

    def _to_prefetch(
        self, ring: SeqRing, chosen: set[int], slot_ids: list[int], page_hashes: list[bytes], end_tokens: int
    ) -> list[bytes]:
        """The hashes of the chosen pages the step that takes the re-selection in may have to restore: every
        one without a slot of this sequence (also those still in the device prefix cache: by then its slot
        may hold another page), and the resident ones only the recent window keeps that will have left it
        by then. Prefetching a page that turns out resident costs a background read, never a different
        result; missing one costs a restore on the step's path (a wait for the host store, and on CUDA for
        the stream, the burst in flight included: host_pages.fetch_to)."""
        lim = self.limits
        # the step that takes it in writes position end_tokens - 1 + prefetch_steps + 1 (its clock is the
        # scoring step's + prefetch_steps + 1); the recent window then starts here
        num_pages = -(-(end_tokens + lim.prefetch_steps + 1) // lim.page_size)
        first_recent = num_pages - lim.recent_pages
        kept = ring.evidence | ring.skeleton  # resident until the re-selection takes effect (the plan keeps them)
        wanted = []
        for p in sorted(chosen):
            if p >= len(page_hashes):
                continue
            if slot_ids[p] == NOT_RESIDENT:
                wanted.append(page_hashes[p])
            elif p not in kept and lim.protect_pages <= p < first_recent and self._written(page_hashes[p]):
                wanted.append(page_hashes[p])  # a page still being written through is left to the step
        return wanted

    def _written(self, page_hash: bytes) -> bool:
        """Whether the page has a host copy already (a read of one that has not would count as lost)."""
        return self.host is not None and self.host.has(page_hash)

    def apply_pending(self, ring: SeqRing, force: bool = False) -> None:
        """Put a pending re-selection in effect once its step has come (or now, `force`); its fetched pages
        wait in `ring.prefetched` for the next materialize. A failed fetch is left to the step's own restore
        (which recomputes what is really lost)."""
        pending = ring.pending
        if pending is None or (not force and ring.decode_steps < pending.apply_at):
            return
        ring.pending = None
        ring.evidence = pending.evidence
        fetch, pending.fetch = pending.fetch, None
        self._take_fetch(ring, fetch)

    def stage_pending(self, ring: SeqRing) -> None:
        """A pending re-selection that takes effect inside the next decode burst (scheduler._burst): its fetched
        pages wait in `ring.prefetched` for the materialize that makes them resident beside the pages in use; its
        evidence stays pending until apply_pending, after the burst."""
        assert ring.pending is not None, "nothing to stage"
        fetch, ring.pending.fetch = ring.pending.fetch, None
        self._take_fetch(ring, fetch)

    def prefetch_selection(self, ring: SeqRing, slot_ids: list[int], page_hashes: list[bytes], end_tokens: int) -> None:
        """A prompt's selection (after a chunk, or its final one), in effect at once: its pages that are only on the
        host are fetched to the device in the background, as a decode re-selection's are (with prefetch_steps), and
        the next materialize (the next chunk's, or the first decode step's) takes them in. Restored on that step's
        path instead, they were one fetch_to each sequence, which on CUDA waits for the whole stream (other
        sequences' bursts in flight included): the H100 profile of 32 sessions had up to 40 ms idle gaps there."""
        if self._prefetcher is None:
            return
        # the next step's resident set: protect, skeleton, evidence and the recent window (a page the window drops by
        # then is one background read too many, never a different result)
        resident = set(self.plan(ring, end_tokens).resident)
        wanted = self._to_prefetch(ring, resident, slot_ids, page_hashes, end_tokens)
        if wanted:
            ring.fetch_ahead = self._prefetch(wanted)

    def _take_fetch(self, ring: SeqRing, fetch: Future[tuple[list[bytes], torch.Tensor]] | None) -> None:
        """A background fetch (a pending re-selection's, or the prompt selection's) into `ring.prefetched`."""
        if fetch is None:
            return
        try:
            hashes, data = fetch.result()
        except Exception as exc:  # noqa: BLE001 - any failure: the restore path fetches (or finds them lost)
            logger.warning("prefetch of a selection's host pages failed (%s); restoring them in the step", exc)
            return
        if data.device.type == "cuda":
            data.record_stream(torch.cuda.current_stream(data.device))  # filled on the prefetcher's stream
        assert len(hashes) == data.shape[0], (len(hashes), data.shape)
        ring.prefetched = {h: i for i, h in enumerate(hashes)}
        ring.prefetched_data = data

    def _prefetch(self, page_hashes: list[bytes]) -> Future[tuple[list[bytes], torch.Tensor]]:
        assert self.host is not None and self._prefetcher is not None
        host, device, parts = self.host, self.pool.device, self.pool.slot_parts

        def fetch() -> tuple[list[bytes], torch.Tensor]:
            if self._stream is None:
                return page_hashes, host.fetch_to(page_hashes, device, parts)
            with torch.cuda.stream(self._stream):  # fetch_to returns once this stream's copies are done
                return page_hashes, host.fetch_to(page_hashes, device, parts)

        return self._prefetcher.submit(fetch)

    def close(self) -> None:
        """Wait for a fetch in flight (engine stop, before the host store closes)."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)

    def select(
        self,
        ring: SeqRing,
        num_candidate_pages: int,
        request_id: str,
        step: int,
        end_tokens: int = 0,
        prompt: PromptIndex | None = None,
        recent: Sequence[int] = (),
    ) -> None:
        """Top-scored candidate pages plus their neighbours become the evidence set; scores reset.

        `end_tokens`: the sequence's length once the step this selection serves is written; with
        exclude_recent the pages the recent window will hold then are not candidates (they are resident
        anyway, and a selection that picks them leaves the budget unused). A decode re-selection (the
        prompt's final selection made: ring.final_scored) starts from the prompt's best anchor_pages, and with
        follow_copy from the pages the answer is copying (`prompt`'s token ids, the answer's `recent` ones)."""
        lim = self.limits
        if not lim.retrieval or ring.scores is None:
            ring.evidence = set()
            return
        excluded = set(range(lim.protect_pages)) | ring.skeleton
        if lim.exclude_recent and end_tokens:
            first_recent = -(-end_tokens // lim.page_size) - lim.recent_pages
            excluded |= set(range(max(0, first_recent), num_candidate_pages))
        scores = page_ranking(ring.scores, num_candidate_pages, excluded, lim.head_fusion)
        ranked: list[int] = torch.argsort(scores, descending=True, stable=True).tolist()
        if ring.replay_scores is not None:  # the question replay's best pages first, then turns with the span's
            replayed = page_ranking(ring.replay_scores, num_candidate_pages, excluded, lim.head_fusion)
            turns = [p for p in torch.argsort(replayed, descending=True, stable=True).tolist() if p not in excluded]
            ranked = turns if ring.question_alone else taking_turns(turns, [p for p in ranked if p not in excluded])
            ring.replay_scores = None
        decoding = ring.final_scored and bool(ring.anchor)
        kept = [p for p in ring.anchor[: lim.anchor_pages] if p not in excluded] if decoding else []
        if decoding and lim.follow_copy and prompt is not None:
            kept = self._copy_lead(ring, num_candidate_pages, excluded, prompt, recent) + kept
        # lazily: pick_pages stops once the room is filled, long before the end of a long context's ranking
        order: Iterable[int] = chain(kept, (p for p in ranked if p not in excluded and p not in kept))
        ahead = lim.read_ahead if decoding else 0
        if lim.read_ahead and not decoding and ring.final_scored:  # where the answer starts, and what follows it
            first = next((p for p in ranked if p not in excluded), None)
            if first is not None:
                order = chain([first], range(first + 1, first + 1 + lim.read_ahead), order)
        chosen = pick_pages(order, num_candidate_pages, excluded, lim.evidence_pages, lim.neighbor_pages, kept, ahead)
        ring.evidence = set(chosen)
        if not decoding and ring.final_scored:
            ring.anchor = chosen  # the prompt's final selection, best first
            ring.follow_at = chosen[0] * lim.page_size if chosen else -1  # a copy most likely starts there
        if self._audit is not None:
            self._write_audit(ring, scores, chosen, request_id, step)
        ring.scores = None
        ring.scored_tokens = 0

    def _copy_lead(
        self, ring: SeqRing, num_pages: int, excluded: set[int], prompt: PromptIndex, recent: Sequence[int]
    ) -> list[int]:
        """follow_copy: the pages from where the answer copies the prompt now to where it will be once the next
        re-selection is in effect (prefetch_steps + rescore_interval tokens on, one page beyond), not excluded;
        none when its last tokens occur nowhere in the candidate pages."""
        lim = self.limits
        allowed = np.ones(num_pages, dtype=bool)
        allowed[[p for p in excluded if p < num_pages]] = False
        at = copy_source(prompt, recent, lim.follow_copy, ring.follow_at, allowed, lim.page_size)
        if at < 0:
            return []
        ring.follow_at = at
        last = (at + lim.prefetch_steps + lim.rescore_interval) // lim.page_size + 1
        return [p for p in range(at // lim.page_size, min(num_pages, last + 1)) if p not in excluded]

    def _write_audit(self, ring: SeqRing, scores: torch.Tensor, chosen: list[int], request_id: str, step: int) -> None:
        assert self._audit is not None
        top = torch.argsort(scores, descending=True)[:32].tolist()
        record = {
            "time": time.time(), "request_id": request_id, "step": step, "scored_tokens": ring.scored_tokens,
            "candidates": int(scores.shape[0]), "top": [[p, round(float(scores[p]), 5)] for p in top],
            "evidence": sorted(chosen), "skeleton": sorted(ring.skeleton),
        }  # fmt: skip
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in request_id) or "request"
        with open(self._audit / f"{safe}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
