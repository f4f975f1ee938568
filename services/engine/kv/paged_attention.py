"""StepAttention: the AttentionBackend over the KV pool for one forward step of several sequences.

Each sequence attends exactly its device-resident pages (a page that is not resident is never read;
sliding-window layers with local rings attend the window before the new tokens, from the ring);
with the `exact` policy the pages that only live on the host stream in through a staging buffer and
are merged with log-sum-exp. The same pass keeps page summaries current and, for sequences that
asked for it, scores every earlier page against this step's queries (the ring's retrieval signal).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from services.engine.kernels import triton_module
from services.engine.kv.attention import (
    PAD_POS,
    PROMPT_BUCKET,
    causal_sdpa,
    flash_attn4,
    grouped_sdpa,
    position_mask,
    prompt_sdpa,
    prompt_sdpa_fits,
    prompt_sdpa_refused,
)
from services.engine.kv.kv_pool import KVPool
from services.engine.kv.transfers import device_index
from services.engine.ring.exact_attention import grouped_attention_lse, merge_partials, page_mass, rows_to_heads
from services.engine.ring.summaries import PageSummaries

if TYPE_CHECKING:
    from services.engine.ring.host_pages import HeldPages

logger = logging.getLogger(__name__)


PREFILL_MODES = ("auto", "cudnn", "fa4", "triton", "flash", "masked")


def resolve_prefill_mode(mode: str, device: torch.device) -> str:
    """How a span of several new tokens over a gap-free read set (all its pages resident, a global layer, no host
    pages) attends (EngineConfig.prefill_attention): `auto` is `fa4` on a CUDA device FlashAttention-4 runs on
    (fa4_usable), else `cudnn` on CUDA, and `masked` elsewhere (the CPU's speed); any other mode is taken as given
    on either device (tests run the kernels interpreted on the CPU). `fa4` over `cudnn` at the 8B shape on an H100:
    TTFT at 32K 1.167-1.172 s against 1.226-1.234 in one process, the attention alone 652-681 TFLOP/s against
    543-591 (bench/RESULTS.md rounds 12 and 14).
    `cudnn` a chunk of >= PROMPT_BUCKET tokens after a past of whole buckets (none, or earlier chunks) through
    attention.prompt_sdpa (cuDNN's fused kernel: 600 vs 420 TFLOP/s on a whole 32K prompt at the 8B shape, 545
    vs 416 on 8K after 24K), every other span as `triton`; `triton` kernels/attention/prefill_attention_triton.py
    over the pool in place (plain-format layers on the Triton tier; else flash: 412 vs 343 TFLOP/s on the H200 at
    the 8B shape, bench/RESULTS.md); `flash` causal_sdpa over the gathered rows (torch's FlashAttention-2, no mask
    tensor, the masked tiles skipped); `masked` grouped_sdpa over a [G * n, T] additive mask (the
    memory-efficient kernel: the path before); `fa4` as `cudnn` with FlashAttention-4 in cuDNN's place where the
    flash-attn-4 wheel is installed (attention.flash_attn4; a shape it refuses goes to cuDNN)."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill attention {mode!r} not in {', '.join(PREFILL_MODES)}")
    if mode == "auto":
        return "fa4" if fa4_usable(device) else "cudnn" if device.type == "cuda" else "masked"
    return mode


@functools.cache
def fa4_usable(device: torch.device) -> bool:
    """Whether FlashAttention-4 runs on this device: a Hopper or datacenter Blackwell GPU (its SM90 and SM100
    kernels) with the flash-attn-4 wheel importable (requirements-cuda.txt; attention.flash_attn4). Once a device."""
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major in (9, 10) and flash_attn4() is not None


def warm_prompt_attention(
    mode: str, device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    """Compile, at engine build, what the `fa4` prefill mode compiles at first use (FlashAttention-4's CuTe DSL
    kernels, seconds each, for the configurations a fresh chunk and a chunk after a past select), so that no
    request pays it; nothing in the other modes or off CUDA."""
    fa4 = resolve_prefill_mode(mode, device) == "fa4"
    if device.type != "cuda" or not fa4 or dtype not in (torch.bfloat16, torch.float16):
        return
    t0 = time.perf_counter()
    for n, past in ((PROMPT_BUCKET, 0), (8 * PROMPT_BUCKET, 8 * PROMPT_BUCKET)):
        q = torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device)
        k = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
        kv_past = (torch.zeros(past, num_kv_heads, head_dim, dtype=dtype, device=device),) * 2 if past else None
        prompt_sdpa(q, k, k, head_dim**-0.5, kv_past, "fa4")  # type: ignore[arg-type]
    torch.cuda.synchronize(device)
    logger.info("prompt attention (fa4) warmed in %.1f s", time.perf_counter() - t0)


@dataclass
class SeqSpan:
    """One sequence's part of a step: `num_new` tokens at positions [num_past, num_past + num_new)."""

    num_past: int
    num_new: int
    write_rows: torch.Tensor  # [num_new] pool rows of the new tokens
    read_rows: torch.Tensor  # [T] pool rows of every resident token up to the last new one, in order
    key_pos: torch.Tensor | None  # [T] positions of read_rows; None when they are 0..T-1 (no gaps)
    # a question replay (model_runner): no write_rows; its new tokens attend their own K/V from the step, after
    # the read rows (key_pos then ends with their positions)
    own_kv: bool = False
    summaries: PageSummaries | None = None
    touched_pages: torch.Tensor | None = None  # [P] logical pages written this step (summaries)
    touched_rows: torch.Tensor | None = None  # [P * page_size] their pool rows
    touched_valid: torch.Tensor | None = None  # [P, page_size] real tokens
    score_tokens: int = 0  # trailing new tokens whose queries score pages
    score_pages: int = 0  # pages [0, score_pages) are scored
    # score by the real attention mass of the scoring tokens over every page (needs host_pages: the step attends
    # all of them) instead of the Quest bound over the summaries
    score_by_attention: bool = False
    # exact: the host-only pages the span attends (their logical page indices in host_page_ids): uint8
    # [page_nbytes] each on the device while they fit (model_runner), else held in the store (host_held), each
    # layer's staging batches reading just that layer's bytes straight to the device
    host_pages: list[torch.Tensor] = field(default_factory=list)
    host_held: HeldPages | None = None
    host_page_ids: list[int] = field(default_factory=list)
    # local rings (sliding-window layers): the window before the new tokens comes from the ring, the new
    # tokens' own K/V straight from the step; the ring keeps the last min(num_new, span) of them
    local_ring: int = -1
    local_read_rows: torch.Tensor | None = None  # [R] ring rows of positions [num_past - R, num_past)
    local_key_pos: torch.Tensor | None = None  # [R + num_new] positions of those rows, then of the new tokens
    local_write_rows: torch.Tensor | None = None  # [K] ring rows of the last K new tokens (K = min(num_new, span))
    # pages the step finishes: (page, ring rows of its tokens before the step, new-token range [lo, hi))
    local_stage: list[tuple[int, torch.Tensor, int, int]] = field(default_factory=list)
    # after the forward: [score_pages] summed over layers (the bound), or with score_by_attention each layer's heads'
    # mass [L * Hq, score_pages] (ring.fuse_heads ranks pages from it)
    scores: torch.Tensor | None = None

    @property
    def has_host_pages(self) -> bool:
        return bool(self.host_page_ids)

    @property
    def causal_rows(self) -> bool:
        """Whether the read rows are causal by index: the new tokens' rows are the last num_new, in order, after
        rows that are all earlier than the first of them (a ring's gapped read set is: its resident pages hold
        positions before num_past, then the chunk's own), so new token i sees rows [0, T - num_new + i] whatever
        the gaps, the rule the paged kernels and the lower-right causal paths apply. Not a question replay's
        (own_kv: its own K/V are not among the read rows)."""
        return not self.own_kv


class StepAttention:
    """Writes the step's new K/V into their rows, then attends each sequence over its own pages.

    Per-step work shared by all layers (write rows, masks) is built once in the constructor.
    """

    def __init__(
        self,
        pool: KVPool,
        spans: list[SeqSpan],
        group: int,
        dtype: torch.dtype,
        staging_pages: int = 32,
        kernel_staging_pages: int = 128,
        mode: str = "auto",
    ) -> None:
        self.pool = pool
        self.spans = spans
        self.group = group
        self.dtype = dtype
        # host pages a staging batch of the exact policy: the torch path's [Hkv, G * n, T] float32 scores bound it; the
        # kernel's bound is only the batch's bytes (a layer of 128 fp8 pages of the 8B shape: 19 MB), and each batch
        # reads and writes its float32 output state once (128 MB for 8K rows of 32 heads)
        self.staging_pages = staging_pages
        self.kernel_staging_pages = kernel_staging_pages
        self.write_rows = torch.cat([s.write_rows for s in spans])  # [N], the step's flattened order
        # the step's rows that are written (all but a question replay's), when some are not
        self.written: torch.Tensor | None = None
        if any(s.own_kv for s in spans):
            starts = itertools.accumulate((s.num_new for s in spans), initial=0)
            kept = [i for a, s in zip(starts, spans, strict=False) if not s.own_kv for i in range(a, a + s.num_new)]
            self.written = device_index(kept, pool.device)
        self.mode = resolve_prefill_mode(mode, pool.device)  # EngineConfig.prefill_attention
        paged = self.mode in ("cudnn", "fa4", "triton")
        self.kernel = triton_module("attention.prefill_attention_triton", pool.device) if paged else None
        # chunks over a bucketed past through cuDNN (or FlashAttention-4: prompt_sdpa's impl), the rest as `triton`
        self.prompt_kernel = self.mode in ("cudnn", "fa4")
        self.prompt_impl = "fa4" if self.mode == "fa4" else "cudnn"
        if paged and self.kernel is None:
            self.mode = "flash"  # not the Triton tier (prompt chunks still through prompt_impl)
        self._masks: dict[tuple[int, int | None, bool], torch.Tensor | None] = {}  # (span, window, local) -> mask
        self._staged: dict[int, torch.Tensor] = {}  # a staging batch's K rows by its page count (_staged_rows)
        # the step's single-token spans (decode rows beside prompt chunks) in one launch of the flash-decoding
        # kernel reading the pool in place, instead of a gather and an SDPA call each, a layer (every mode but
        # the masked reference)
        batch_decode = self.mode != "masked" and os.environ.get("KVMEM_DECODE_ROWS", "1") != "0"  # 0: off (bench)
        self.decode_kernel = triton_module("attention.decode_attention_triton", pool.device) if batch_decode else None
        self._decode_set: tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def kv_sink(self, layer_idx: int) -> None:
        return None  # attend writes (and, for local layers, stages) the rows itself

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        stored: bool = False,
        partial: bool = False,
    ) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]; `window`: sliding-window layer (keys > pos - window);
        the output, `partial` or not."""
        assert not stored, "StepAttention has no sink"
        if self.pool.is_local(layer_idx):
            return self._attend_local(layer_idx, q, k, v, scale, window)
        if self.written is None:
            self.pool.write(layer_idx, self.write_rows, k, v)
        elif self.written.numel():
            kept = self.written
            self.pool.write(layer_idx, self.write_rows, k.index_select(0, kept), v.index_select(0, kept))
        decoded = self._decode_rows(layer_idx, q, scale) if window is None else {}
        outs = []
        start = 0
        for i, span in enumerate(self.spans):
            q_s = q[start : start + span.num_new]
            if span.summaries is not None:
                if not span.own_kv:  # a replay writes no page
                    self._summarize(layer_idx, span)
                if span.score_tokens and not span.score_by_attention and span.summaries.scores_layer(layer_idx):
                    self._score(layer_idx, span, q_s, scale)
            if i in decoded:
                outs.append(decoded[i])
                start += span.num_new
                continue
            plain = span.causal_rows and window is None and not span.has_host_pages and not span.score_by_attention
            if self.prompt_kernel and plain and prompt_sdpa_fits(q_s, span.read_rows.shape[0] - span.num_new):
                k_s, v_s = k[start : start + span.num_new], v[start : start + span.num_new]
                out = self._attend_prompt(layer_idx, span, q_s, k_s, v_s, scale)
                if out is not None:
                    outs.append(out)
                    start += span.num_new
                    continue
            own = (k[start : start + span.num_new], v[start : start + span.num_new]) if span.own_kv else None
            outs.append(self._attend_span(i, layer_idx, span, q_s, scale, window, own))
            start += span.num_new
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _decode_rows(self, layer_idx: int, q: torch.Tensor, scale: float) -> dict[int, torch.Tensor]:
        """The single-token spans' outputs {span index: [1, Hq, D]} from one flash-decoding launch over their
        read rows in place (a plain layer, or an fp8 one read in place); {} where the kernel does not apply."""
        kernel = self.decode_kernel
        if kernel is None:
            return {}
        plain, fp8 = self.pool.plain_kv(layer_idx), self.pool.fp8_kv(layer_idx)
        stores, is_fp8 = (plain, False) if plain is not None else (fp8, True)
        if stores is None or not kernel.supported(stores[0], is_fp8):
            return {}
        if self._decode_set is None:
            self._decode_set = self._decode_read_set(kernel.PAGE_ROWS)
        members, q_rows, rows, key_pos, q_pos = self._decode_set
        if not members:
            return {}
        out = kernel.decode_attention(
            q.index_select(0, q_rows), *stores, rows, key_pos, q_pos, scale, sorted_keys=True, fp8=is_fp8
        )
        return {i: out[j : j + 1] for j, i in enumerate(members)}

    def _decode_read_set(
        self, page_rows: int
    ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the single-token spans, their rows of q, read rows [B, W] and key positions [B, W] padded at the end
        with PAD_POS to a multiple of page_rows, their query positions [B]), once a step (every layer's)."""
        dev = self.pool.device
        members, q_rows, starts = [], [], 0
        for i, span in enumerate(self.spans):
            if span.num_new == 1 and not span.has_host_pages and not span.score_by_attention and not span.own_kv:
                members.append(i)
                q_rows.append(starts)
            starts += span.num_new
        if not members:
            empty = torch.empty(0, dtype=torch.long, device=dev)
            return [], empty, empty, empty, empty
        spans = [self.spans[i] for i in members]
        width = -(-max(int(s.read_rows.shape[0]) for s in spans) // page_rows) * page_rows
        rows = torch.zeros(len(spans), width, dtype=torch.long, device=dev)
        key_pos = torch.full((len(spans), width), PAD_POS, dtype=torch.long, device=dev)
        for j, s in enumerate(spans):
            n = s.read_rows.shape[0]
            rows[j, :n] = s.read_rows
            key_pos[j, :n] = s.key_pos if s.key_pos is not None else torch.arange(n, device=dev)
        q_pos = device_index([s.num_past for s in spans], dev)
        return members, device_index(q_rows, dev), rows, key_pos, q_pos

    def _attend_prompt(
        self, layer_idx: int, span: SeqSpan, q_s: torch.Tensor, k_s: torch.Tensor, v_s: torch.Tensor, scale: float
    ) -> torch.Tensor | None:
        """A prompt chunk over its past rows (whole buckets of them: gap-free, or a ring's resident pages) through
        cuDNN's fused attention: its own K/V rows as the step computed them (an fp8 layer's chunk attends its
        unquantised rows) and the past gathered from the pool; None where cuDNN refuses the shape (then never
        asked again). FlashAttention-4 over a plain layer's past reads the past and the chunk in one gather of the
        read rows (the chunk's are written before it attends), not a gather of the past and a concatenation: ~21 of
        the ~26 ms those took in a 32K prompt's prefill in chunks of 8K (bench/RESULTS.md, round 14)."""
        past = None
        num_past_rows = span.read_rows.shape[0] - span.num_new
        joined = bool(num_past_rows) and self.prompt_impl == "fa4" and self.pool.plain_kv(layer_idx) is not None
        if joined:
            k_s, v_s = self.pool.gather(layer_idx, span.read_rows, q_s.dtype)
        elif num_past_rows:
            past = self.pool.gather(layer_idx, span.read_rows[:num_past_rows], q_s.dtype)
        try:
            return prompt_sdpa(q_s, k_s, v_s, scale, past, self.prompt_impl, joined)
        except RuntimeError as exc:
            prompt_sdpa_refused(q_s, exc)
            return None

    def _attend_span(
        self,
        i: int,
        layer_idx: int,
        span: SeqSpan,
        q_s: torch.Tensor,
        scale: float,
        window: int | None,
        own: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One sequence's attention over its read rows -> [n, Hq, D] (the `resolve_prefill_mode` paths for a causal
        span: its new rows last, every earlier row seen by all of them, gaps or not; the masked path for windows,
        question replays and single tokens; `exact` host pages); `own`: an own_kv span's K/V, [n, Hkv, D] each,
        attended after the read rows."""
        causal = span.num_new > 1 and span.causal_rows and window is None and not span.has_host_pages
        if causal and self.kernel is not None:  # the kernel reads a plain or an fp8 layer in place
            plain, fp8 = self.pool.plain_kv(layer_idx), self.pool.fp8_kv(layer_idx)
            stores, is_fp8 = (plain, False) if plain is not None else (fp8, True)
            if stores is not None and self.kernel.supported(q_s, stores[0], is_fp8):
                return self.kernel.prefill_attention(q_s, *stores, span.read_rows, scale, fp8=is_fp8)  # type: ignore[no-any-return]
        if span.has_host_pages and own is None and window is None:
            out = self._exact_kernel(layer_idx, span, q_s, scale)
            if out is not None:
                return out
        k_s, v_s = self.pool.gather(layer_idx, span.read_rows, q_s.dtype)
        if own is not None:
            k_s, v_s = torch.cat((k_s, own[0].to(k_s.dtype))), torch.cat((v_s, own[1].to(v_s.dtype)))
        k_s, v_s = k_s.transpose(0, 1), v_s.transpose(0, 1)  # [Hkv, T, D]
        if span.has_host_pages:
            mask = self._mask(i, span, window)
            return self._exact(layer_idx, span, q_s, k_s, v_s, mask, scale, window).to(q_s.dtype)
        if causal and self.mode != "masked":
            return causal_sdpa(q_s, k_s, v_s, scale)  # keys 0..T-1, the new tokens last
        return grouped_sdpa(q_s, k_s, v_s, self._mask(i, span, window), scale)  # [n, Hq, D]

    def _attend_local(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
    ) -> torch.Tensor:
        """A layer in the local rings: each sequence attends the ring's window before its new tokens and the
        new tokens' own rows (as the ring would return them), then stages the pages it finishes and keeps
        its last rows in the ring (never scored or summarised: only the paged layers' pages are selected)."""
        pool = self.pool
        outs = []
        start = 0
        for i, span in enumerate(self.spans):
            assert span.local_read_rows is not None and span.local_key_pos is not None
            assert span.local_write_rows is not None
            n = span.num_new
            key = (i, window, True)
            if key not in self._masks:
                self._masks[key] = _row_mask(span, self.group, self.dtype, pool.device, window, span.local_key_pos)
            k_new, v_new = pool.encode(layer_idx, k[start : start + n], v[start : start + n])  # stored rows
            k_past, v_past = pool.gather(layer_idx, span.local_read_rows, q.dtype)
            k_now, v_now = pool.decode(layer_idx, k_new, v_new, q.dtype)
            k_s = torch.cat((k_past, k_now)).transpose(0, 1)  # [Hkv, R + n, D]
            v_s = torch.cat((v_past, v_now)).transpose(0, 1)
            outs.append(grouped_sdpa(q[start : start + n], k_s, v_s, self._masks[key], scale))
            if span.local_stage:  # the finished pages in one piece: the first page's earlier rows from the ring
                page, before, lo, _ = span.local_stage[0]
                hi = span.local_stage[-1][3]
                pool.local_stage[(span.local_ring, layer_idx)] = (
                    page * pool.page_size,
                    torch.cat((pool.k[layer_idx][before], k_new[lo:hi])),
                    torch.cat((pool.v[layer_idx][before], v_new[lo:hi])),
                )
            kept = span.local_write_rows.shape[0]  # 0 in a scoring pass
            if kept:
                pool.write_stored(layer_idx, span.local_write_rows, k_new[n - kept :], v_new[n - kept :])
            start += n
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _mask(self, i: int, span: SeqSpan, window: int | None) -> torch.Tensor | None:
        key = (i, window, False)
        if key not in self._masks:
            self._masks[key] = _row_mask(span, self.group, self.dtype, self.pool.device, window)
        return self._masks[key]

    def _summarize(self, layer_idx: int, span: SeqSpan) -> None:
        assert span.summaries is not None and span.touched_rows is not None
        assert span.touched_pages is not None and span.touched_valid is not None
        span.summaries.update_from_pool(layer_idx, span.touched_pages, self.pool, span.touched_rows, span.touched_valid)

    def _score(self, layer_idx: int, span: SeqSpan, q_s: torch.Tensor, scale: float) -> None:
        assert span.summaries is not None
        if span.score_pages == 0:
            return
        q_sel = q_s[-span.score_tokens :]  # [Tq, Hq, D]
        kmin, kmax = span.summaries.bounds(layer_idx, span.score_pages)
        scores = span.summaries.score(q_sel, kmin, kmax, scale)  # the sequence's scoring rule
        span.scores = scores if span.scores is None else span.scores + scores

    def _exact(
        self,
        layer_idx: int,
        span: SeqSpan,
        q_s: torch.Tensor,
        k_s: torch.Tensor,
        v_s: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        """Resident keys, then the host-only pages (all earlier than the new tokens) in staging batches."""
        out, lse = grouped_attention_lse(q_s, k_s, v_s, mask, scale)
        size = self.pool.page_size
        ids = span.host_page_ids
        order = list(range(len(ids)))
        if window is not None:  # a sliding layer sees only the pages that reach into its window
            order = [j for j in order if ids[j] * size + size - 1 > span.num_past - window]
        q_pos = span.num_past + torch.arange(span.num_new, device=self.pool.device)
        offsets = torch.arange(size, device=self.pool.device)
        scoring = _scores_by_attention(span, layer_idx)
        mass_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if scoring:
            mass_parts.append((k_s, *self._resident_scoring(span, k_s.shape[1], window)))
        for i in range(0, len(order), self.staging_pages):
            batch = order[i : i + self.staging_pages]
            # staging: [Hkv, B * page, D] of this layer, moved to the pool's device
            k_b, v_b = self._host_kv(span, batch, layer_idx, q_s.dtype)
            k_h, v_h = k_b.transpose(0, 1), v_b.transpose(0, 1)
            host_mask = None
            if window is not None:
                key_pos = torch.cat([ids[j] * size + offsets for j in batch])
                allowed = position_mask(q_pos, key_pos, window).repeat(self.group, 1)
                host_mask = torch.zeros(allowed.shape, device=self.pool.device).masked_fill_(~allowed, float("-inf"))
            out_h, lse_h = grouped_attention_lse(q_s, k_h, v_h, host_mask, scale)
            out, lse = merge_partials(out, lse, out_h, lse_h)
            if scoring:
                key_pos = torch.cat([ids[j] * size + offsets for j in batch])
                score_mask = None if host_mask is None else host_mask.view(self.group, span.num_new, -1)[
                    :, -span.score_tokens :].reshape(self.group * span.score_tokens, -1)  # fmt: skip
                mass_parts.append((k_h, key_pos, score_mask))
        if scoring:
            self._page_mass(span, q_s, mass_parts, scale)
        return rows_to_heads(out, q_s.shape[0], q_s.shape[1])

    def _resident_scoring(
        self, span: SeqSpan, num_rows: int, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The resident rows' key positions and the scoring tokens' additive mask over them [G * Tq, T]."""
        dev = self.pool.device
        key_pos = span.key_pos if span.key_pos is not None else torch.arange(num_rows, device=dev)
        q_pos = span.num_past + torch.arange(span.num_new - span.score_tokens, span.num_new, device=dev)
        allowed = position_mask(q_pos, key_pos, window).repeat(self.group, 1)
        return key_pos, torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, float("-inf"))

    def _page_mass(
        self,
        span: SeqSpan,
        q_s: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        scale: float,
    ) -> None:
        """The scoring tokens' attention mass on each page, per head [Hq, Np] (their mean), stacked over layers in
        span.scores (RingManager fuses the heads)."""
        mass = page_mass(q_s[-span.score_tokens :], parts, scale, span.score_pages, self.pool.page_size).mean(dim=0)
        span.scores = mass if span.scores is None else torch.cat((span.scores, mass))

    def _exact_kernel(self, layer_idx: int, span: SeqSpan, q_s: torch.Tensor, scale: float) -> torch.Tensor | None:
        """`_exact` through the paged prefill kernel (a global layer): the resident rows read in place (causal by
        index), then each staging batch of host pages read where its bytes landed, as stored (every key seen), each
        merged into the kernel's output and log-sum-exp as it comes: no [Hkv, G * n, T] float32 scores and no
        merge passes (torch's elementwise and reduction kernels were 0.92 s of the 2.63 s of kernels of a 4 x 12K ring
        prefill at the 8B shape: bench/RESULTS.md round 11). The scoring
        tokens' page mass as `_exact`. None where the kernel does not take the layer (the torch path then)."""
        if self.kernel is None or not span.causal_rows:
            return None
        plain, fp8 = self.pool.plain_kv(layer_idx), self.pool.fp8_kv(layer_idx)
        stores, is_fp8 = (plain, False) if plain is not None else (fp8, True)
        if stores is None or not self.kernel.supported(q_s, stores[0], is_fp8):
            return None
        out = torch.empty(q_s.shape, dtype=torch.float32, device=q_s.device)
        lse = torch.empty(q_s.shape[:2], dtype=torch.float32, device=q_s.device)
        self.kernel.prefill_attention(q_s, *stores, span.read_rows, scale, fp8=is_fp8, state=(out, lse))
        size = self.pool.page_size
        ids = span.host_page_ids
        scoring = _scores_by_attention(span, layer_idx)
        mass_parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        if scoring:
            k_s = self.pool.gather_keys(layer_idx, span.read_rows, q_s.dtype).transpose(0, 1)
            mass_parts.append((k_s, *self._resident_scoring(span, k_s.shape[1])))
        offsets = torch.arange(size, device=self.pool.device)
        for i in range(0, len(ids), self.kernel_staging_pages):
            batch = list(range(i, min(i + self.kernel_staging_pages, len(ids))))
            data = self._host_bytes(span, batch, layer_idx)
            rows = self.pool.layer_rows(data, layer_idx)  # each page's K rows, then its V rows
            k_rows, v_rows = rows[:-size], rows[size:]  # V row r of the batch = K row r + page_size
            self.kernel.prefill_attention(q_s, k_rows, v_rows, self._staged_rows(len(batch)), scale, fp8=is_fp8,
                                          causal=False, state=(out, lse), accumulate=True)  # fmt: skip
            if scoring:
                k_h = self.pool.layer_kv(data, layer_idx, q_s.dtype)[0].transpose(0, 1)
                mass_parts.append((k_h, torch.cat([ids[j] * size + offsets for j in batch]), None))
        if scoring:
            self._page_mass(span, q_s, mass_parts, scale)
        return out.to(q_s.dtype)

    def _staged_rows(self, num_pages: int) -> torch.Tensor:
        """The K rows of a staging batch of pages in `layer_rows`'s order: b * 2 * page_size + t, in page order."""
        rows = self._staged.get(num_pages)
        if rows is None:  # made on the device (a pageable copy there would wait for the stream)
            size, dev = self.pool.page_size, self.pool.device
            rows = torch.arange(num_pages, device=dev)[:, None] * (2 * size) + torch.arange(size, device=dev)
            rows = self._staged[num_pages] = rows.reshape(-1)
        return rows

    def _host_bytes(self, span: SeqSpan, batch: list[int], layer_idx: int) -> torch.Tensor:
        """One layer's bytes of these host pages (indices into span.host_page_ids) on the pool's device: uint8
        [B, layer bytes]."""
        if span.host_held is not None:
            return span.host_held.read(batch, self.pool.layer_part(layer_idx), self.pool.device)
        return self.pool.pages_layer_bytes([span.host_pages[j] for j in batch], layer_idx, self.pool.device)

    def _host_kv(
        self, span: SeqSpan, batch: list[int], layer_idx: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K and V of these host pages (indices into span.host_page_ids) on the pool's device:
        [B * page_size, Hkv, D] each."""
        return self.pool.layer_kv(self._host_bytes(span, batch, layer_idx), layer_idx, dtype)


def _row_mask(
    span: SeqSpan,
    group: int,
    dtype: torch.dtype,
    device: torch.device,
    window: int | None = None,
    key_pos: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Additive [G * n, T] causal (and window) mask over the span's read rows (or over keys at `key_pos`);
    None when not needed."""
    k_pos = key_pos if key_pos is not None else span.key_pos
    if k_pos is None:
        k_pos = torch.arange(span.read_rows.shape[0], device=device)
    if span.num_new == 1 and (window is None or int(k_pos[0]) > span.num_past - window):
        return None  # one new token sees every read row
    q_pos = span.num_past + torch.arange(span.num_new, device=device)
    allowed = position_mask(q_pos, k_pos, window).repeat(group, 1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def _scores_by_attention(span: SeqSpan, layer_idx: int) -> bool:
    """Whether this layer of an exact span scores pages by its scoring tokens' real attention mass (page_mass)."""
    scoring = span.score_by_attention and span.score_tokens > 0 and span.score_pages > 0
    return scoring and span.summaries is not None and span.summaries.scores_layer(layer_idx)
