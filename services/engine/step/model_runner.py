"""ModelRunner: turns a step's work into tensors, runs the forward pass, returns the logits to sample."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.engine.kv.kv_pool import KVPool
from services.engine.kv.paged_attention import SeqSpan, StepAttention
from services.engine.kv.recurrent_state import RecurrentStates
from services.engine.kv.transfers import copied, device_index, to_host
from services.engine.models.loader import CausalLM
from services.engine.ring.host_pages import HostPages
from services.engine.step.decode_graph import DecodeGraphs
from services.engine.step.sequence import NOT_RESIDENT
from services.engine.step.work import Work

logger = logging.getLogger(__name__)


@dataclass
class Launched:
    """A step on its way. Steps sampled on the host keep their logits (on the device); steps that chose their
    tokens on the device (decode bursts, continued steps) have those tokens and their page scores copied to
    host memory behind them, and `ready` is recorded after the copies (CUDA): reading them waits for this
    step only, not for a step launched after it."""

    works: list[Work]
    logits: torch.Tensor  # [sampling works, V] float32: the last step's
    scores: list[torch.Tensor | None]  # per work: its page scores ([pages]; host memory when `tokens` is set)
    tokens: torch.Tensor | None = None  # [works, steps] the tokens each step chose, in host memory
    ready: torch.cuda.Event | None = None


class ModelRunner:
    """Decode steps that qualify (DecodeGraphs.accepts) go through the decode runner (CUDA graphs when
    `cuda_graphs` and the device is CUDA); every other step through StepAttention."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        device: torch.device,
        host: HostPages | None = None,
        decode_runner: bool = True,
        cuda_graphs: bool = True,
        max_batch: int = 16,
        states: RecurrentStates | None = None,
        prefill_attention: str = "auto",
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.host = host
        self.states = states  # the linear-attention layers' per-sequence states (qwen3_5), else None
        self.prefill_attention = prefill_attention  # StepAttention's mode (EngineConfig.prefill_attention)
        self.decode = DecodeGraphs(model, pool, device, max_batch, cuda_graphs, states) if decode_runner else None

    def accepts_burst(self, works: list[Work]) -> bool:
        """Can these works run as a decode burst (only the decode runner runs bursts)."""
        return self.decode is not None and self.decode.accepts(works)

    @staticmethod
    def chooses_on_device(works: list[Work]) -> bool:
        """The step's tokens are its argmax on the device (a greedy decode burst, of one step or more), not
        sampled on the host."""
        return works[0].device_argmax

    def launch(self, works: list[Work]) -> Launched:
        """run(), then for steps that chose their tokens on the device, those tokens and the page scores on
        their way to host memory (Launched): the host may schedule and launch the next step before reading them."""
        logits, scores = self.run(works)
        if not self.chooses_on_device(works):
            return Launched(works, logits, scores)
        assert self.decode is not None
        tokens = self.decode.tokens_to_host(len(works), works[0].num_steps)
        host_scores = [None if s is None else to_host(s) for s in scores]
        return Launched(works, logits, host_scores, tokens, copied(self.device))

    def tokens(self, launched: Launched) -> list[list[int]]:
        """Per work, the tokens its steps chose (waits for that step's copies only)."""
        assert launched.tokens is not None, "tokens of a step that samples on the host"
        if launched.ready is not None:
            launched.ready.synchronize()
        return launched.tokens.tolist()  # type: ignore[no-any-return]

    @torch.inference_mode()
    def run(self, works: list[Work]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Forward every work item; (logits [num_sampling_works, V] float32 in work order, per work the
        page scores of its scoring tokens, [pages] summed over layers, or None when it scored nothing).
        A decode burst (num_steps > 1) runs all its steps; the logits are its last step's."""
        self.pool.local_stage.clear()  # the last step's pages have been written through
        if self.decode is not None and self.decode.accepts(works):
            logits = self.decode.run(works)
            return logits, self.decode.page_scores(works)
        assert not self.chooses_on_device(works), "a decode burst or continued step the decode runner does not accept"
        token_ids: list[int] = []
        positions: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[int] = []
        try:
            for w in works:
                first = w.replay_from if w.replay_from >= 0 else w.start  # a question replay reads the question again
                token_ids.extend(w.seq.token_ids[first : first + w.num_new])
                positions.extend(range(w.start, w.start + w.num_new))
                spans.append(self._span(w))
                if w.samples:
                    sample_rows.append(len(token_ids) - 1)
            hidden = self._forward(works, spans, token_ids, positions)
        finally:  # host pages held for the exact policy go back to the store once their reads are done
            for span in spans:
                if span.host_held is not None:
                    span.host_held.release()
        scores = [span.scores for span in spans]
        if not sample_rows:
            return torch.empty(0, device=self.device), scores
        rows_t = device_index(sample_rows, self.device)
        return self.model.logits(hidden.index_select(0, rows_t)), scores  # [M, V]

    def _forward(
        self, works: list[Work], spans: list[SeqSpan], token_ids: list[int], positions: list[int]
    ) -> torch.Tensor:
        """The model over the works' tokens -> hidden [N, hidden]."""
        # every index through pinned memory (kv/transfers.py): a pageable copy would make the host wait for the
        # step before this one, a prompt chunk that samples nothing included, and the device then waits for the host
        ids = device_index(token_ids, self.device)
        pos = device_index(positions, self.device)
        cfg = self.model.config
        attn = StepAttention(
            self.pool, spans, cfg.num_heads // cfg.num_kv_heads, self.model.embed_tokens.weight.dtype,
            mode=self.prefill_attention,
        )  # fmt: skip
        if self.states is not None:  # each sequence's slot; a scoring pass reads its state, keeps nothing
            batch = self.states.batch(
                [w.seq.state_slot for w in works], [w.num_new for w in works], [w.start == 0 for w in works],
                [not w.score_only for w in works],
            )  # fmt: skip
            return self.model(ids, pos, attn, batch)  # type: ignore[call-arg,no-any-return]
        return self.model(ids, pos, attn)  # type: ignore[no-any-return]

    def _local_span(self, span: SeqSpan, w: Work, end: int) -> None:
        """Sliding-window layers: the ring rows of the window before the new tokens (they attend those and
        their own new rows), the ring rows their last min(n, span) tokens are kept in, and the pages the
        step finishes, staged for the write-through with the ring rows they start in. A scoring pass keeps
        and stages nothing: the real pass of the same chunk reads the window before it from the ring next,
        and the chunk's own rows would overwrite it (a ring holds one window and a page less one token)."""
        local, ring_id, size = self.pool.local, w.seq.local_ring, self.pool.page_size
        assert local is not None and ring_id >= 0, f"{w.seq.request_id} runs without a local ring"
        first = w.start
        lo = max(0, first - local.window + 1)
        dev = self.device
        span.local_ring = ring_id
        span.local_key_pos = torch.arange(lo, end, device=dev)
        span.local_read_rows = local.rows(ring_id, torch.arange(lo, first, device=dev))
        kept = 0 if w.score_only else min(end - first, local.span)
        span.local_write_rows = local.rows(ring_id, torch.arange(end - kept, end, device=dev))
        span.local_stage = []
        if w.score_only:
            return
        for page in range(first // size, end // size):
            begin = max(page * size, first)  # the page's tokens before `begin` are in the ring already
            before = local.rows(ring_id, torch.arange(page * size, begin, device=dev))
            span.local_stage.append((page, before, begin - first, (page + 1) * size - first))

    def _span(self, w: Work) -> SeqSpan:
        """Rows to write and read for one sequence; summaries, scoring and host pages when it has a ring."""
        if w.replay_from >= 0:
            return self._replay_span(w)
        size = self.pool.page_size
        table = w.seq.page_table
        end = w.start + w.num_new
        slots = device_index(table.slot_ids, self.device)
        new_pos = torch.arange(w.start, end, device=self.device)
        write_rows = slots[new_pos // size] * size + new_pos % size
        last_page = (end - 1) // size
        resident = [p for p in range(last_page + 1) if table.slot_ids[p] != NOT_RESIDENT]
        res_t = device_index(resident, self.device)
        read_rows = self.pool.rows(slots[res_t])
        if len(resident) == last_page + 1:
            read_rows, key_pos = read_rows[:end], None
        else:  # the last page (resident: it takes the new rows) is the only one cut at `end` (a slice, not a mask)
            key_pos = (res_t[:, None] * size + torch.arange(size, device=self.device)[None, :]).reshape(-1)
            kept = len(resident) * size - ((last_page + 1) * size - end)
            read_rows, key_pos = read_rows[:kept], key_pos[:kept]
        span = SeqSpan(w.start, w.num_new, write_rows, read_rows, key_pos)
        if self.pool.local is not None:
            self._local_span(span, w, end)
        ring = w.seq.ring
        if ring is None:
            return span
        first_page = w.start // size
        touched = torch.arange(first_page, last_page + 1, device=self.device)
        span.summaries = ring.summaries
        span.touched_pages = touched
        span.touched_rows = self.pool.rows(slots[touched])
        span.touched_valid = (touched[:, None] * size + torch.arange(size, device=self.device)[None, :]) < end
        span.score_tokens = w.score_tokens
        span.score_pages = first_page if w.score_tokens else 0
        span.score_by_attention = w.exact_query
        if ring.policy == "exact" or w.exact_query:
            self._host_pages(span, w, first_page)
        return span

    def _host_pages(self, span: SeqSpan, w: Work, num_pages: int) -> None:
        """The host-only pages among the sequence's first `num_pages`, fetched for the span to attend exactly."""
        table = w.seq.page_table
        hidden = [p for p in range(num_pages) if table.slot_ids[p] == NOT_RESIDENT]
        if hidden:
            assert self.host is not None, "exact attention over host pages needs a host store"
            hashes = [table.page_hashes[p] for p in hidden]
            if self.pool.host_pages_fit(len(hidden)):  # attention reads each layer's bytes per batch
                span.host_pages = list(self.host.fetch_to(hashes, self.device))
            else:  # a long context's: held in the store, read a layer at a time
                span.host_held = self.host.hold(hashes, self.device)
            span.host_page_ids = hidden

    def _replay_span(self, w: Work) -> SeqSpan:
        """A question replay (Work.replay_from): its tokens at positions [start, start + n) past those computed
        attend the resident rows before `start`, every host-only page when it scores by attention, and
        themselves (own_kv: their K/V straight from the step, never written). It keeps nothing: no row, no
        summary, no local-ring row; the pages before `start`'s page are scored."""
        size = self.pool.page_size
        table = w.seq.page_table
        ring = w.seq.ring
        assert ring is not None, "a question replay needs the sequence's ring"
        start, end = w.start, w.start + w.num_new
        dev = self.device
        slots = device_index(table.slot_ids, dev)
        resident = [p for p in range(-(-start // size)) if table.slot_ids[p] != NOT_RESIDENT]
        res_t = device_index(resident, dev)
        key_pos = (res_t[:, None] * size + torch.arange(size, device=dev)[None, :]).reshape(-1)
        read_rows = self.pool.rows(slots[res_t])
        before = key_pos < start
        key_pos = torch.cat((key_pos[before], torch.arange(start, end, device=dev)))
        empty = torch.empty(0, dtype=torch.long, device=dev)
        span = SeqSpan(start, w.num_new, empty, read_rows[before], key_pos, own_kv=True)
        if self.pool.local is not None:
            self._local_span(span, w, end)
        first_page = start // size
        span.summaries = ring.summaries
        span.score_tokens = w.score_tokens
        span.score_pages = first_page
        span.score_by_attention = w.exact_query
        if w.exact_query:
            self._host_pages(span, w, first_page)
        return span
