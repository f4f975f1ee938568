"""Page summaries and page scoring: what the ring reads to decide which pages matter for a query.

For every page of a sequence, resident or not, and every KV-bearing layer and KV head, we keep the
element-wise min and max of the page's keys (Quest's bound) and their mean. Keys are summarised in
the frame attention uses (after RoPE): `q . k <= sum_d max(q_d * kmin_d, q_d * kmax_d)` then bounds
the real attention logit of every key in the page, whatever its position. bench/summary_frame.py
measures the frames (bench/RESULTS.md): post-RoPE Quest ranks the needle page like the real attention
mass does (recall@8 1.00); the post-RoPE mean key loses content to the rotation (recall@8 0.53); the
pre-RoPE bound ranks a little better still but would put the rotary tables into scoring. The mean key
is kept for that comparison; scoring uses the bound.

Scoring turns the per-(layer, query token, query head) bounds into a distribution over pages
(softmax of bound * scale), so every query token spreads one unit of mass over the pages; summed
over layers, heads and tokens this is the page score (Σ scores == query tokens x heads x layers
before normalisation, a built-in check).

Both run on the active kernel tier (services.engine.kernels.active_tier): Triton
(kernels/pages/summaries_triton.py) or CuPy RawKernels (kernels/pages/summaries_cupy.py) on CUDA, these torch
functions otherwise. `summary_update_reference` and `page_scores_reference` are the references the
kernels are tested against (tests/engine/test_kernels_summaries.py); bench/kernel_table.py times them.
`PageSummaries.update_rows` summarises straight from a pool layer's rows (no [P, page, Hkv, D]
copy in fp32) where the pool stores a plain float dtype.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from services.engine.kernels import active_tier
from services.engine.kv.transfers import device_index

if TYPE_CHECKING:
    from services.engine.kv.kv_pool import KVPool

logger = logging.getLogger(__name__)

_KERNEL_MODULES = {
    "triton": "services.engine.kernels.pages.summaries_triton",
    "cupy": "services.engine.kernels.pages.summaries_cupy",
}


def _kernels(device: torch.device) -> ModuleType | None:
    """The kernel module of the active tier for tensors on `device`; None: the torch reference.

    CUDA tensors take the tier's backend; CPU tensors take Triton only under the interpreter (tests)."""
    tier = active_tier()
    if tier.backend == "torch" or (device.type != "cuda" and not tier.interpreted):
        return None
    return importlib.import_module(_KERNEL_MODULES[tier.backend])


class PageSummaries:
    """kmin, kmax, kmean: [L, max_pages, num_kv_heads, head_dim] per sequence (pool device), one row per
    summarised layer: every layer, or only `layers` (the paged ones: local-ring layers are never scored).
    Methods take model layer indices."""

    def __init__(
        self,
        num_layers: int,
        max_pages: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.layers = tuple(range(num_layers)) if layers is None else tuple(layers)
        self._row = {layer: i for i, layer in enumerate(self.layers)}
        shape = (len(self.layers), max_pages, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=torch.float32, device=device)
        self.kmax = torch.zeros(shape, dtype=torch.float32, device=device)
        self.kmean = torch.zeros(shape, dtype=torch.float32, device=device)
        self.num_pages = 0  # pages summarised so far (0..num_pages-1 valid)
        self.vote_top = 0  # page scoring: 0 sums every head's mass (page_scores); k > 0 counts each head's top k
        self.num_layers = num_layers
        self.score_from = 0.0  # layers below this fraction of the model's depth score no pages (RingLimits)
        # update_all_from_pool's tables viewed flat [L * max_pages, Hkv, D]: layer row j's page 0 is flat page base[j]
        self._flat_base = (torch.arange(len(self.layers), device=device) * max_pages)[:, None]

    def scores_layer(self, layer_idx: int) -> bool:
        """Whether a (summarised) layer's queries score pages: the early layers' attention is mostly positional
        and local, and adds noise to the ranking (bench/longeval/fusion_sim.py measured it)."""
        return layer_idx >= self.score_from * self.num_layers

    def scored_rows(self) -> list[int]:
        """The rows (indices into `layers`) of the layers that score pages."""
        return [i for i, layer in enumerate(self.layers) if self.scores_layer(layer)]

    def score(self, q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
        """This sequence's page scores [Np] of queries q [T, Hq, D] against bounds [Np, Hkv, D] (one layer's,
        or stacked_bounds with the same layers' query heads side by side): page_scores, or page_votes."""
        if self.vote_top > 0:
            return page_votes(q, kmin, kmax, scale, self.vote_top)
        return page_scores(q, kmin, kmax, scale)

    def bounds(self, layer_idx: int, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kmin, kmax [num_pages, Hkv, D] of a layer's first pages (what page scoring reads)."""
        row = self._row[layer_idx]
        return self.kmin[row, :num_pages], self.kmax[row, :num_pages]

    def stacked_bounds(self, num_pages: int, rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """kmin, kmax [num_pages, L * Hkv, D]: every summarised layer's KV heads side by side (in
        `layers` order), so that one page_scores call over queries [T, L * Hq, D] (the same layers' heads
        side by side) scores all of them: its sum over heads is the sum of the per-layer scores."""
        flat = (num_pages, -1, self.kmin.shape[-1])
        kmin, kmax = self.kmin[:, :num_pages], self.kmax[:, :num_pages]
        if rows is not None and len(rows) < len(self.layers):  # only these layers (scored_rows)
            take = row_index(rows, kmin.device)
            kmin, kmax = kmin[take], kmax[take]
        return kmin.transpose(0, 1).reshape(flat), kmax.transpose(0, 1).reshape(flat)

    def _tables(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row = self._row[layer_idx]
        return self.kmin[row], self.kmax[row], self.kmean[row]

    def update(self, layer_idx: int, page_ids: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> None:
        """keys: [P, page_size, Hkv, D] of pages `page_ids` [P]; valid: [P, page_size] bool (real tokens)."""
        tables = self._tables(layer_idx)
        kernels = _kernels(keys.device)
        if kernels is None:
            summary_update_reference(*tables, page_ids, keys, valid)
        else:
            kernels.summary_update(*tables, page_ids, keys.reshape(-1, *keys.shape[2:]), valid)

    def update_from_pool(
        self, layer_idx: int, page_ids: torch.Tensor, pool: KVPool, rows: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """Summaries of pages `page_ids` [P] whose pool rows are `rows` [P * page_size] (valid
        [P, page_size]): read in place for a plain layer, dequantised through the pool otherwise."""
        src = pool.plain_keys(layer_idx)
        if src is not None:
            self.update_rows(layer_idx, page_ids, src, rows, valid)
            return
        keys = pool.gather_keys(layer_idx, rows)
        self.update(layer_idx, page_ids, keys.view(*valid.shape, *keys.shape[1:]), valid)

    def update_all_from_pool(
        self, page_ids: torch.Tensor, pool: KVPool, rows: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """`update_from_pool` of every paged layer of the pool. Where those are the summarised layers and lie in
        one stack (KVPool.paged_keys), in one summary pass over G x P pages of the tables viewed flat ([G *
        max_pages, Hkv, D]: page p of layer row j is flat page j * max_pages + p): a decode step that fills the
        pages of 32 sessions of a 32-layer model launched 2,048 small kernels from Python one layer at a time, the
        device idle between them (bench/RESULTS.md round 16); else layer by layer."""
        got = pool.paged_keys(rows) if self.layers == pool.paged_layers else None
        if got is None:
            for layer in pool.paged_layers:
                self.update_from_pool(layer, page_ids, pool, rows, valid)
            return
        src, src_rows = got
        flat_ids = self._flat_base + page_ids[None, :]
        flat_valid = valid.repeat(len(self.layers), 1)
        kmin, kmax, kmean = (t.view(-1, *t.shape[2:]) for t in (self.kmin, self.kmax, self.kmean))
        kernels = _kernels(src.device)
        if kernels is not None:
            kernels.summary_update(kmin, kmax, kmean, flat_ids.reshape(-1), src, flat_valid, rows=src_rows)
            return
        keys = src if src_rows is None else src.index_select(0, src_rows)
        keys = keys.view(*flat_valid.shape, *keys.shape[1:])
        summary_update_reference(kmin, kmax, kmean, flat_ids.reshape(-1), keys, flat_valid)

    def update_rows(
        self, layer_idx: int, page_ids: torch.Tensor, src: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor
    ) -> None:
        """The same from token rows without a gathered copy: src [R, Hkv, D] (a pool layer's keys in a
        plain float dtype), rows [P * page_size] the pages' rows in token order; valid [P, page_size]."""
        tables = self._tables(layer_idx)
        kernels = _kernels(src.device)
        if kernels is None:
            keys = src.index_select(0, rows.reshape(-1)).view(*valid.shape, *src.shape[1:])
            summary_update_reference(*tables, page_ids, keys, valid)
        else:
            kernels.summary_update(*tables, page_ids, src, valid, rows=rows)

    def nbytes(self) -> int:
        return 3 * self.kmin.numel() * 4


def warm_page_scores(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_pages: int,
    dtypes: Sequence[torch.dtype],
) -> int:
    """Run page scoring once per compiled variant a sequence of up to `max_pages` pages can meet (the Triton
    tier compiles one per power of two of page blocks past MIN_PAGE_BLOCKS x BLOCK_PAGES pages), for queries of
    each dtype; returns the calls made. Without it the first decode re-selection compiles the kernels (~1 s
    each on a cold cache) while every running sequence waits. A no-op off CUDA (the interpreter's tests
    compile nothing)."""
    kernels = _kernels(device)
    if device.type != "cuda" or kernels is None or max_pages <= 0:
        return 0
    n = getattr(kernels, "MIN_PAGE_BLOCKS", 1) * getattr(kernels, "BLOCK_PAGES", max_pages)  # one variant below
    counts = []
    while True:
        counts.append(min(n, max_pages))
        if n >= max_pages:
            break
        n *= 2
    calls = 0
    for dtype in dict.fromkeys(dtypes):
        q = torch.randn(1, num_heads, head_dim, device=device).to(dtype)
        for count in counts:
            bounds = torch.randn(count, num_kv_heads, head_dim, device=device)
            page_scores(q, bounds - 1, bounds + 1, head_dim**-0.5)
            calls += 1
    return calls


def row_index(rows: Sequence[int], device: torch.device) -> slice | torch.Tensor:
    """An index of these rows of a tensor's first dimension: a slice when they are consecutive (scored_rows
    always are: the layers past a depth), else int64 on `device` through pinned memory. A Python list as an
    index would be copied from pageable memory: the host would wait for every step queued before it."""
    if list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return device_index(list(rows), device)


def summary_update_reference(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    page_ids: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
) -> None:
    """Torch reference of the summary update for one layer.

    kmin, kmax, kmean: [max_pages, Hkv, D] fp32; page_ids: [P]; keys: [P, page_size, Hkv, D];
    valid: [P, page_size] bool. A page without a valid token gets kmin +inf, kmax -inf, kmean 0.
    """
    k = keys.float()
    v = valid[:, :, None, None]
    count = valid.sum(dim=1).clamp(min=1)[:, None, None]
    kmin.index_copy_(0, page_ids, torch.where(v, k, torch.inf).amin(dim=1))
    kmax.index_copy_(0, page_ids, torch.where(v, k, -torch.inf).amax(dim=1))
    kmean.index_copy_(0, page_ids, torch.where(v, k, 0.0).sum(dim=1) / count)


def page_bounds(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest upper bound of q . k over each page.

    q: [T, Hq, D] (query tokens, after RoPE); kmin, kmax: [Np, Hkv, D] -> [T, Hq, Np].
    Query head h reads KV head h // (Hq / Hkv).
    """
    num_heads, num_kv_heads = q.shape[1], kmin.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float()
    q_pos, q_neg = qf.clamp(min=0), qf.clamp(max=0)
    kmax_h = kmax.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, Np, D]
    kmin_h = kmin.repeat_interleave(group, dim=1).transpose(0, 1)
    # bound: [Hq, T, Np]
    bound = torch.bmm(q_pos.transpose(0, 1), kmax_h.transpose(1, 2)) + torch.bmm(
        q_neg.transpose(0, 1), kmin_h.transpose(1, 2)
    )
    return bound.transpose(0, 1)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Unit mass per (query token, head) spread over pages: [T, Hq, D] x [Np, Hkv, D] -> [Np] fp32
    (sums to T*Hq), on the active kernel tier."""
    kernels = _kernels(q.device)
    if kernels is None:
        return page_scores_reference(q, kmin, kmax, scale)
    return kernels.page_scores(q, kmin, kmax, scale)


def page_scores_reference(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch reference of page_scores: materialises the [T, Hq, Np] bounds."""
    bound = page_bounds(q, kmin, kmax) * scale  # [T, Hq, Np]
    return torch.softmax(bound, dim=-1).sum(dim=(0, 1))


def page_votes(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float, top: int) -> torch.Tensor:
    """Each query head's vote for the pages its queries need: [T, Hq, D] x [Np, Hkv, D] -> [Np] fp32.

    A head's distribution over pages is the softmax of the Quest bound averaged over its query tokens (the
    observation window votes per head, as in SnapKV); the head gives its `top` best pages their mass and
    nothing to the rest. A head whose queries do not single a page out spreads its mass thin and adds
    little to any page; a head that finds the needle gives it most of a unit. Summing mass over every
    page instead (page_scores) lets the long tail of many uninformative heads outweigh the few that
    know where to look. Plain torch on any device (the [T, Hq, Np] bounds are small at the T of a
    question or a decode step)."""
    num_pages = kmin.shape[0]
    if num_pages == 0:
        return torch.zeros(0, dtype=torch.float32, device=q.device)
    probs = torch.softmax(page_bounds(q, kmin, kmax) * scale, dim=-1).mean(dim=0)  # [Hq, Np]
    k = min(top, num_pages)
    mass, pages = probs.topk(k, dim=-1)
    return torch.zeros(num_pages, dtype=torch.float32, device=q.device).index_add_(
        0, pages.reshape(-1), mass.reshape(-1)
    )


def mean_key_scores(q: torch.Tensor, kmean: torch.Tensor, scale: float) -> torch.Tensor:
    """The same unit-mass aggregation over q . mean(k) logits (the content-frame alternative)."""
    num_heads, num_kv_heads = q.shape[1], kmean.shape[1]
    k = kmean.repeat_interleave(num_heads // num_kv_heads, dim=1).transpose(0, 1)  # [Hq, Np, D]
    logits = torch.bmm(q.float().transpose(0, 1), k.transpose(1, 2)) * scale  # [Hq, T, Np]
    return torch.softmax(logits, dim=-1).sum(dim=(0, 1))


HEAD_FUSIONS = ("sum", "norm", "rrf", "max", "peak")  # fuse_heads' rules ("rrf:K" sets rrf's constant, default 1)


def fuse_heads(mass: torch.Tensor, candidate: torch.Tensor, rule: str) -> torch.Tensor:
    """Page scores [Np] from every head's attention mass over pages, [H, Np], counting candidate pages only
    (`candidate` [Np] bool; the rest score 0): `sum` adds the raw masses (heads that look at many pages
    outweigh the few that single one out), `norm` first rescales each head's mass over the candidates to
    one (every head one vote, spread as it attends), `rrf:K` reciprocal-rank fusion: a page gets
    1 / (K + rank) from every head that ranks it (rank 1 = the head's most attended candidate), so a page
    that many heads put first wins however little mass those heads give it in absolute terms; `max` a page's
    largest share of any one head's candidate mass (a page that one head singles out wins, the retrieval heads of
    DuoAttention and RazorAttention: on Gemma 3 one head of twelve ranks the needle first where the sum buries it);
    `peak` the `norm` shares weighted by each head's own largest share (concentrated heads count, diffuse ones
    hardly)."""
    name, _, arg = rule.partition(":")
    out = torch.zeros(mass.shape[-1], dtype=torch.float32, device=mass.device)
    if not bool(candidate.any()):
        return out
    m = mass[:, candidate].float()
    share = m / m.sum(dim=1, keepdim=True).clamp(min=1e-30)  # each head's candidate mass, summing to one
    if name == "sum":
        fused = m.sum(dim=0)
    elif name == "norm":
        fused = share.sum(dim=0)
    elif name == "max":
        fused = share.amax(dim=0)
    elif name == "peak":
        fused = (share * share.amax(dim=1, keepdim=True)).sum(dim=0)
    elif name == "rrf":
        k = float(arg) if arg else 1.0
        ranks = m.argsort(dim=1, descending=True).argsort(dim=1).float()  # 0 = the head's first
        fused = (1.0 / (k + 1.0 + ranks)).sum(dim=0)
    else:
        raise ValueError(f"head fusion {rule!r} is not one of {', '.join(HEAD_FUSIONS)}")
    out[candidate] = fused
    return out
