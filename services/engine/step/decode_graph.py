"""DecodeGraphs: the decode step (one new token per sequence) on static buffers, captured in CUDA graphs.

A decode step whose sequences each add one token and need neither host pages (`exact`) nor page
scoring runs here instead of StepAttention. The step's inputs live in static buffers keyed by
(batch bucket B, window bucket W):

    ids, positions, write_rows      [B]     the new tokens and their pool rows
    rows, key_pos                   [B, W]  every resident row of the sequence up to its last page,
                                            padded with row 0 at position PAD_POS (always masked)
    rows_next, key_pos_next,        [B, W], the read set from position switch_pos on (a re-selection taking
    switch_pos                      [B]     effect inside a burst, work.Switch; PAD_POS: none)
    keep_pos                        [B]     the position whose query the row keeps for page scoring (< 0:
                                            every step's, the last one's surviving)
    local_rows, local_pos (per      [B, L]  the rows of the last ceil((window - 1) / page) + 1 pages only:
    sliding window, paged)                  a sliding layer reads L rows, not W (pools without local rings)

    ring_base                       [B]     with local rings (local_ring.py): the first row of each
                                            sequence's ring; a sliding layer's rows and positions
                                            (the window before the token) are computed in the step

Masks (causal, gaps, padding, sliding window) are computed inside the step from these positions, once
per read set and window, and only for layers that take the SDPA path.
Each layer writes its new K/V with `KVPool.write`, or, on the Triton tier with a plain-format layer,
the model writes them in its q/k norm + RoPE launch (`kv_sink`, Gemma 3 and q/k-normed Llamas); with the
Triton tier and a plain-format layer,
one flash-decoding kernel (kernels/attention/decode_attention_triton.py) reads the rows in place; otherwise the
padded window is read with `KVPool.gather` and one batched masked SDPA runs for all B sequences (query
heads grouped onto their KV head, K/V never repeated). The logits [B, V] are computed in the step;
sampling stays outside.

Each step ends by advancing its own inputs on the device: the argmax of its logits becomes the next
ids (and is recorded in `burst_tokens` at the step's index), positions and write rows move one on. A
decode burst (scheduler.py) is the step run `num_steps` times in a row with no host work between
them, the host reading all the burst's tokens at its end in one copy; a single step ignores the advance
(the next step's inputs are filled from the host). Two things may change inside a burst, both decided
by the host before it: the step whose query scores the pages (Work.score_pos) is the only one that keeps
its queries (keep_pos: the attention of each paged layer stores q where the position matches), and a
sequence whose read set switches (Work.switch: pages leave, others join) reads the set before the switch
until the advance that brings its position to switch_pos copies rows_next / key_pos_next over its rows
(both sets built on the host, whole pages in order, padded to the larger one's bucket).

On CUDA with `capture`, the first step of a bucket runs eagerly (the warm-up, and this step's
result) and is then captured; later steps of that bucket replay the graph. All graphs share one
memory pool. Without capture (CPU, `--no-cuda-graphs`) the very same function runs eagerly.

Batch rows beyond the real sequences repeat sequence 0 (same token, position, rows): they write
the same K/V into the same row, so padding never touches another page.

Recurrent models (qwen3_5, `states`): each batch row's state slot is one more static input
(`state_slots` [B], copied a step like the others), and the step's RecurrentBatch is built on the
buffers (one token a row, fresh where the position is 0, every state kept): the linear layers read and
write their slots in place, so replays and the steps of a burst carry the state on. Padding rows repeat
sequence 0's slot and write the same state into it. A state snapshot is taken when the host reads the
step that ends on a snapshot boundary; the scheduler never continues past such a step on the device
(scheduler.continue_decode), and a burst ends at a page end at the latest. Capturing these steps is off
unless KVMEM_RECURRENT_GRAPHS=1 (not yet run on a GPU): the same step then runs eagerly.

Per-step host work: a sequence's padded rows are rebuilt only when its page table (up to its last
page) changed, and copied into a bucket's buffers only when that batch row held something else;
otherwise a step copies 7 x B integers to the device, in one copy (a row whose read set switched inside a
burst is rewritten by the next step that uses it). A continued step (Work.on_device: the
step after a burst whose tokens the host has not read, engine.py) keeps the ids the last step left on the
device (gathered by row when sequences left the batch: scheduler.continue_decode) and copies the other
inputs; the staging buffer alternates between two halves so that filling one never races the copy of the
other still queued, and the rows come from pinned memory: nothing here waits for the burst in flight. The
page summary of a ring sequence's page is brought up to date once, eagerly, on the step that fills the page
(only full pages are ever scored or demoted), instead of per step inside the graph.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from services.engine.kernels import triton_module
from services.engine.kv.attention import PAD_POS
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.recurrent_state import RecurrentBatch, RecurrentStates
from services.engine.kv.transfers import device_index, to_host
from services.engine.models.loader import CausalLM
from services.engine.ring.summaries import row_index
from services.engine.step.graph_attention import GraphAttention, GraphBuffers
from services.engine.step.sequence import NOT_RESIDENT, Sequence
from services.engine.step.work import Work

logger = logging.getLogger(__name__)

MIN_WINDOW = 256


def advance_inputs(
    token: torch.Tensor,
    burst_tokens: torch.Tensor,
    inputs: torch.Tensor,
    reads: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """The end of a step: its token [B] into burst_tokens [P, B] at the step index and into the input ids,
    positions and write rows one on, the step index (every column) on modulo P (replays past a page wrap);
    then each batch row whose new position is its switch_pos takes its next read set (reads: rows, key_pos,
    rows_next, key_pos_next [B, W]). inputs [7, B]: ids, positions, write_rows, ring_base, step, keep_pos,
    switch_pos. kernels/layer/step_triton.py does it in one launch."""
    step = inputs[4]
    burst_tokens.index_copy_(0, step[:1], token[None])
    inputs[0].copy_(token)
    inputs[1:3] += 1  # positions, write_rows: the burst stays inside the page
    torch.remainder(step + 1, burst_tokens.shape[0], out=step)
    rows, key_pos, rows_next, key_pos_next = reads
    switch = (inputs[1] == inputs[6])[:, None]  # [B, 1]
    torch.where(switch, rows_next, rows, out=rows)
    torch.where(switch, key_pos_next, key_pos, out=key_pos)


def batch_bucket(n: int) -> int:
    """Smallest power of two >= n: 1, 2, 4, 8, 16, ..."""
    b = 1
    while b < n:
        b *= 2
    return b


def window_bucket(num_rows: int) -> int:
    """Smallest power of two >= num_rows, at least MIN_WINDOW."""
    w = MIN_WINDOW
    while w < num_rows:
        w *= 2
    return w


@dataclass
class _SeqRows:
    """One sequence's read set, rebuilt only when its page table up to `last_page` (or its switch) changes
    (CPU tensors)."""

    key: tuple[object, ...]  # (last_page, slot of every page up to it[, the switch, whether it is mid-burst])
    rows: torch.Tensor  # [R] pool rows of the resident pages 0..last_page, in order (before a switch: not joining)
    pos: torch.Tensor  # [R] their token positions
    local: dict[int, tuple[torch.Tensor, torch.Tensor]]  # window -> (rows [L], positions [L]), padded
    padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # W -> rows, pos [W]
    switch_pos: int = PAD_POS  # a switch inside the burst: the first position that reads `after`
    after: tuple[torch.Tensor, torch.Tensor] | None = None  # its rows, positions (the pages not leaving)
    padded_after: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        """Rows of the larger read set: the window bucket holds both."""
        return max(int(self.rows.shape[0]), int(self.after[0].shape[0]) if self.after is not None else 0)


class DecodeGraphs:
    """Runs eligible decode steps on static buffers; captures one CUDA graph per (B, W) bucket when `capture`."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device,
        max_batch: int,
        capture: bool,
        states: RecurrentStates | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.max_batch = batch_bucket(max_batch)
        self.states = states  # the linear layers' state slots (qwen3_5), else None
        recurrent_ok = states is None or os.environ.get("KVMEM_RECURRENT_GRAPHS", "0") == "1"
        self.capture = capture and device.type == "cuda" and recurrent_ok
        self.dtype = model.embed_tokens.weight.dtype
        size = pool.page_size
        # the largest read set: every slot of the pool (a ring sequence holds at most its budget)
        self.max_window = window_bucket(pool.num_slots * size)
        windows = sorted({w for w in model.config.layer_windows if w is not None})
        # window -> pages a sliding layer can reach from a token in the last page: ceil((w - 1) / size) + 1
        self.local_pages = {w: -(-(w - 1) // size) + 1 for w in windows}
        self.local_pages = {w: n for w, n in self.local_pages.items() if n * size < self.max_window}
        if pool.local is not None:
            self.local_pages = {}  # sliding layers read their sequence's local ring instead
        self._seq_rows: dict[Sequence, _SeqRows] = {}
        self._buffers: dict[tuple[int, int], GraphBuffers] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_replays = 0
        self.num_captures = 0
        self.capture_s = 0.0  # host time in _capture (its eager step, the synchronize, the capture itself)
        self.num_eager = 0
        self._last: GraphBuffers | None = None  # the buffers of the last step (page_scores reads its queries)
        # the model writes a step's K/V rows in its q/k norm + RoPE launch (KVMEM_KV_SINK=0: KVPool.write
        # launches them, for A/B runs)
        self.kv_sinks = os.environ.get("KVMEM_KV_SINK", "1") != "0"
        # page scoring: every paged layer in one call, each layer's queries scaled by its attention scale over
        # the first one's (the bound is linear in q), the heads of all layers side by side
        kv_layers = model.config.kv_layers  # pool layer i is model layer kv_layers[i] (qwen3_5: attention layers)
        scales = [float(model.layers[kv_layers[layer]].self_attn.scale) for layer in pool.paged_layers]  # type: ignore[union-attr, arg-type]
        self._score_scale = scales[0] if scales else 1.0
        self._paged_index = torch.tensor(pool.paged_layers, dtype=torch.long, device=device)
        rel = [s / self._score_scale for s in scales]
        self._query_scales = torch.tensor(rel, dtype=torch.float32, device=device)[:, None, None]  # [L, 1, 1]

    # -- eligibility -------------------------------------------------------------------------------

    def accepts(self, works: list[Work]) -> bool:
        """Every item adds one token, samples, and needs no host page (a decode step that re-selects
        scores its pages after the step from the queries the step kept: page_scores)."""
        if not works or len(works) > self.max_batch:
            return False
        size = self.pool.page_size
        for w in works:
            if w.num_new != 1 or w.score_only or w.exact_query or w.score_tokens > 1 or not w.samples:
                return False
            ring = w.seq.ring
            if ring is not None and ring.policy == "exact":
                slots = w.seq.page_table.slot_ids
                if NOT_RESIDENT in slots[: w.start // size + 1]:
                    return False  # exact attention streams the host pages: StepAttention
        return True

    def warm_up(self, batches: list[int], widths: list[int]) -> int:
        """Capture the graphs of these buckets ahead of time; returns how many were captured.

        Only while the pool holds no live sequence: the dummy step writes row 0 of slot 0.
        """
        if not self.capture:
            return 0
        before = self.num_captures
        with torch.inference_mode():
            for batch in sorted({batch_bucket(b) for b in batches}):
                for width in sorted({window_bucket(w) for w in widths}):
                    bufs = self._bufs(batch, width)
                    if bufs.graph is not None:
                        continue
                    bufs.key_pos[:, 0] = 0  # one visible key (row 0 at position 0): no empty softmax
                    for lpos in bufs.local_pos.values():
                        lpos[:, 0] = 0
                    self._capture(bufs)
                    bufs.owners = [None] * batch  # the next real step refills every row
        torch.cuda.synchronize(self.device)
        return self.num_captures - before

    # -- the step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, works: list[Work]) -> torch.Tensor:
        """Forward one decode step, or every step of a decode burst; logits [len(works), V] float32 in work
        order (a burst's last step's)."""
        n = len(works)
        num_steps = works[0].num_steps
        assert all(w.num_steps == num_steps for w in works) and num_steps <= self.pool.page_size
        entries = [self._rows_of(w) for w in works]
        batch = batch_bucket(n)
        width = window_bucket(max(e.num_rows for e in entries))
        bufs = self._bufs(batch, width)
        self._fill(bufs, works, entries)
        self._seq_rows = {w.seq: e for w, e in zip(works, entries, strict=True)}  # forget finished sequences
        for _ in range(num_steps):
            if not self.capture:
                logits = self._step(bufs)[:n]
                self.num_eager += 1
            elif bufs.graph is None:
                logits = self._capture(bufs)[:n]
            else:
                bufs.graph.replay()
                self.num_replays += 1
                assert bufs.out is not None
                logits = bufs.out[:n]
        self._summarize_filled_pages(works)
        self._last = bufs
        return logits

    def tokens_to_host(self, num_works: int, num_steps: int) -> torch.Tensor:
        """After run() of steps that chose their tokens on the device: per work, the argmax of each step
        [num_works, num_steps], copied to host memory behind them (transfers.to_host: valid once an event
        recorded after this call completes; the next run overwrites the device buffer)."""
        assert self._last is not None, "tokens_to_host before run"
        tokens = self._last.burst_tokens[:num_steps, :num_works].t()
        return to_host(tokens.contiguous()) if self.device.type == "cuda" else tokens.clone()

    def page_scores(self, works: list[Work]) -> list[torch.Tensor | None]:
        """After run(works): per work, the page scores of its token's query over pages [0, its page)
        (summed over layers, as StepAttention._score does per layer), or None when it does not score."""
        out: list[torch.Tensor | None] = []
        size = self.pool.page_size
        queries: torch.Tensor | None = None  # [L, B, Hq, D] fp32, scaled: taken once for every scoring work
        for i, w in enumerate(works):
            ring = w.seq.ring
            num_pages = w.start // size
            if not w.score_tokens or ring is None or num_pages == 0:
                out.append(None)
                continue
            assert self._last is not None, "page_scores before run"
            assert ring.summaries.layers == self.pool.paged_layers, (ring.summaries.layers, self.pool.paged_layers)
            if queries is None:
                kept = self._last.queries.index_select(0, self._paged_index)[:, : len(works)]
                queries = kept.float() * self._query_scales[:, None]
            q = queries[:, i]  # [L, Hq, D]
            rows = ring.summaries.scored_rows()  # the layers that score (RingLimits.score_from)
            if len(rows) < q.shape[0]:
                q = q[row_index(rows, q.device)]  # a slice: the burst on the device is not waited for
            bounds = ring.summaries.stacked_bounds(num_pages, rows)
            out.append(ring.summaries.score(q.reshape(1, -1, q.shape[-1]), *bounds, self._score_scale))
        return out

    def _forward(self, bufs: GraphBuffers) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the static buffers: the B tokens -> (logits [B, V] float32, their argmax [B])."""
        attn = GraphAttention(self.pool, bufs, self.dtype, self.kv_sinks)
        if self.states is not None:
            rows = [True] * bufs.batch
            batch = RecurrentBatch(self.states, bufs.state_slots, [1] * bufs.batch, bufs.positions == 0, rows)
            hidden = self.model(bufs.ids, bufs.positions, attn, batch)  # type: ignore[call-arg]
        else:
            hidden = self.model(bufs.ids, bufs.positions, attn)  # [B, hidden]
        logits, token = self.model.head(hidden, argmax=True)
        assert token is not None
        return logits, token

    def _step(self, bufs: GraphBuffers) -> torch.Tensor:
        """The step, then its inputs advanced to the next step of a burst (the module docstring)."""
        logits, token = self._forward(bufs)
        kernels = triton_module("layer.step_triton", self.device)
        (kernels.advance if kernels is not None else advance_inputs)(token, bufs.burst_tokens, bufs.inputs, bufs.reads)
        return logits

    def _capture(self, bufs: GraphBuffers) -> torch.Tensor:
        """Warm up eagerly on a side stream (this step's real result), then capture the same step."""
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            logits = self._step(bufs)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the write-through thread may copy pages off the device meanwhile
        with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
            bufs.out = self._step(bufs)
        bufs.graph = graph
        self.num_captures += 1
        elapsed = time.perf_counter() - t0
        self.capture_s += elapsed
        logger.info("captured the decode graph of batch %d, window %d in %.2f s", bufs.batch, bufs.window, elapsed)
        return logits

    # -- buffers -----------------------------------------------------------------------------------

    def _bufs(self, batch: int, width: int) -> GraphBuffers:
        key = (batch, width)
        bufs = self._buffers.get(key)
        if bufs is None:
            dev, size, cfg = self.device, self.pool.page_size, self.model.config
            local = {w: pages * size for w, pages in self.local_pages.items()}

            def long(*shape: int, fill: int = 0) -> torch.Tensor:
                return torch.full(shape, fill, dtype=torch.long, device=dev)

            # one copy from `staging` a step: ids, positions, write_rows, ring_base, step, keep_pos, switch_pos
            inputs = long(7, batch)
            inputs[5] = -1  # keep every step's queries
            inputs[6] = PAD_POS  # no switch
            bufs = GraphBuffers(
                batch=batch, window=width, ids=inputs[0], positions=inputs[1],
                write_rows=inputs[2], rows=long(batch, width), key_pos=long(batch, width, fill=PAD_POS),
                rows_next=long(batch, width), key_pos_next=long(batch, width, fill=PAD_POS),
                local_rows={w: long(batch, n) for w, n in local.items()},
                local_pos={w: long(batch, n, fill=PAD_POS) for w, n in local.items()},
                ring_base=inputs[3], step=inputs[4, :1], keep_pos=inputs[5], switch_pos=inputs[6], inputs=inputs,
                staging=torch.zeros(2, 7, batch, dtype=torch.long, pin_memory=dev.type == "cuda"),
                state_slots=long(batch),
                slot_staging=torch.zeros(2, batch, dtype=torch.long, pin_memory=dev.type == "cuda"),
                burst_tokens=long(size, batch),
                queries=torch.zeros(cfg.num_layers, batch, cfg.num_heads, cfg.head_dim, dtype=self.dtype, device=dev),
                owners=[None] * batch,
            )  # fmt: skip
            self._buffers[key] = bufs
        return bufs

    def _fill(self, bufs: GraphBuffers, works: list[Work], entries: list[_SeqRows]) -> None:
        size = self.pool.page_size
        span = self.pool.local.span if self.pool.local is not None else 0
        on_device = works[0].on_device
        assert all(w.on_device == on_device for w in works), "continued and new steps in one batch"
        half, slot_half = bufs.staging[bufs.turn], bufs.slot_staging[bufs.turn]
        bufs.turn ^= 1
        staging = half.numpy()
        for i in range(bufs.batch):
            j = i if i < len(works) else 0  # padding repeats sequence 0
            w, e = works[j], entries[j]
            pos = w.start
            slot = w.seq.page_table.slot_ids[pos // size]
            token = 0 if on_device else w.seq.token_at(pos)  # continued: the device's own (PENDING here)
            keep = -1  # every step keeps its queries (the last one's survive)
            if w.score_tokens:  # only the scoring step's
                keep = w.score_pos if w.score_pos >= 0 else w.start + w.num_steps - 1
            ring_base = max(0, w.seq.local_ring) * span
            staging[:, i] = (token, pos, slot * size + pos % size, ring_base, 0, keep, e.switch_pos)
            slot_half[i] = max(0, w.seq.state_slot)
            if bufs.owners[i] != e.key:  # the rows depend on the key only
                rows, kpos = self._padded(e.padded, e.rows, e.pos, bufs.window)
                bufs.rows[i].copy_(rows, non_blocking=True)
                bufs.key_pos[i].copy_(kpos, non_blocking=True)
                if e.after is not None:
                    rows, kpos = self._padded(e.padded_after, *e.after, bufs.window)
                    bufs.rows_next[i].copy_(rows, non_blocking=True)
                    bufs.key_pos_next[i].copy_(kpos, non_blocking=True)
                for win, (lrows, lpos) in e.local.items():
                    bufs.local_rows[win][i].copy_(lrows, non_blocking=True)
                    bufs.local_pos[win][i].copy_(lpos, non_blocking=True)
                # a row that switches inside the burst ends it holding the other set: the next step rewrites it
                bufs.owners[i] = e.key if e.after is None else None
        if self.states is not None:
            bufs.state_slots.copy_(slot_half, non_blocking=True)
        if not on_device:
            bufs.inputs.copy_(half, non_blocking=True)
            return
        last = self._last
        assert last is not None, "a continued step without the step before it"
        # each row's token is the argmax its sequence's row of the last step left on the device (_seq_rows is still
        # the last step's, in its batch order); rows that left (scheduler.continue_decode) close up, padding
        # repeats row 0's
        last_rows = {seq: i for i, seq in enumerate(self._seq_rows)}
        src = [last_rows[w.seq] for w in works]
        if src != list(range(len(works))) or last.batch != bufs.batch:
            src += [src[0]] * (bufs.batch - len(src))
            bufs.ids.copy_(last.ids.index_select(0, device_index(src, self.device)))
        elif last is not bufs:  # another window bucket: the last step's argmax is in its buffers
            bufs.ids.copy_(last.ids)
        bufs.inputs[1:].copy_(half[1:], non_blocking=True)

    def _padded(
        self, cache: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor, pos: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A read set (rows, positions [R]) padded to `width` (row 0 at PAD_POS), pinned; cached per width."""
        got = cache.get(width)
        if got is None:
            padded_rows = torch.zeros(width, dtype=torch.long)
            padded_pos = torch.full((width,), PAD_POS, dtype=torch.long)
            padded_rows[: rows.shape[0]] = rows
            padded_pos[: pos.shape[0]] = pos
            got = cache[width] = (self._pinned(padded_rows), self._pinned(padded_pos))
        return got

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor the step copies from without a synchronisation (never changed after): pinned on CUDA."""
        return t.pin_memory() if self.device.type == "cuda" else t

    def _rows_of(self, w: Work) -> _SeqRows:
        """The sequence's read set (cached while its page table up to the new token's page, and its switch, are
        unchanged): every resident page up to the token's, or with a switch (work.Switch) inside the burst
        those without the joining pages, then (`after`) those without the leaving ones; a switch at or before
        the burst's first step gives the latter only."""
        size = self.pool.page_size
        last_page = w.start // size
        slots = w.seq.page_table.slot_ids
        switch = w.switch
        mid_burst = switch is not None and switch.pos > w.start
        key: tuple[object, ...] = (last_page, *slots[: last_page + 1])
        if switch is not None:
            key = (*key, switch, mid_burst)
        cached = self._seq_rows.get(w.seq)
        if cached is not None and cached.key == key:
            return cached
        resident = [p for p in range(last_page + 1) if slots[p] != NOT_RESIDENT]
        pages = resident
        if switch is not None:
            assert set(resident).issuperset(switch.leaving | switch.joining), (switch, resident)
            pages = [p for p in resident if p not in switch.leaving]  # from the switch on
        rows, pos = self._page_rows(pages, slots)
        local = {}
        for win, num_pages in self.local_pages.items():
            first = max(0, last_page + 1 - num_pages)
            if switch is not None:  # the scheduler switches pages out of a sliding layer's reach only
                assert all(p < first for p in switch.leaving | switch.joining), (switch, win, first)
            near = [p for p in pages if p >= first]
            n = len(near) * size
            lrows = torch.zeros(num_pages * size, dtype=torch.long)
            lpos = torch.full((num_pages * size,), PAD_POS, dtype=torch.long)
            lrows[:n], lpos[:n] = self._page_rows(near, slots)
            local[win] = (self._pinned(lrows), self._pinned(lpos))
        if not mid_burst:
            return _SeqRows(key=key, rows=rows, pos=pos, local=local)
        assert switch is not None
        before = self._page_rows([p for p in resident if p not in switch.joining], slots)
        return _SeqRows(key=key, rows=before[0], pos=before[1], local=local, switch_pos=switch.pos, after=(rows, pos))

    def _page_rows(self, pages: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pool rows and token positions [len(pages) * page_size] of these pages (each resident), in order."""
        size = self.pool.page_size
        offsets = torch.arange(size)
        page_t = torch.tensor(pages, dtype=torch.long)
        slot_t = torch.tensor([slots[p] for p in pages], dtype=torch.long)
        return (slot_t[:, None] * size + offsets).reshape(-1), (page_t[:, None] * size + offsets).reshape(-1)

    # -- page summaries ------------------------------------------------------------------------------

    def _summarize_filled_pages(self, works: list[Work]) -> None:
        """Summaries of the pages this step filled (ring sequences): what StepAttention does per step,
        done once per page, when the page becomes scorable and demotable."""
        size = self.pool.page_size
        for w in works:
            ring = w.seq.ring
            if ring is None or (w.start + w.num_steps) % size:
                continue
            page = w.start // size
            slot = w.seq.page_table.slot_ids[page]
            rows = torch.arange(slot * size, (slot + 1) * size, device=self.device)
            page_t = torch.full((1,), page, dtype=torch.long, device=self.device)  # a fill, not a host copy
            valid = torch.ones(1, size, dtype=torch.bool, device=self.device)
            ring.summaries.update_all_from_pool(page_t, self.pool, rows, valid)
