"""Triton kernels for page summaries (min/max/mean of a page's keys) and page scoring (Quest bound,
softmax over pages per (query token, head), summed). The torch references are in
services/engine/ring/summaries.py (`summary_update_reference`, `page_scores_reference`).

Summary update: one program per (page, KV head, block of head_dim) reads the page's rows straight
from a token-major source ([R, Hkv, D]: a pool layer, or the gathered keys viewed flat), keeps the
masked min/max/sum in registers and writes the three tables of one layer at the page's id. With
row indices it gathers from the pool itself, so no [P, page, Hkv, D] copy is made.

Scoring: rows are (query token, query head) pairs grouped by KV head, so one tile of `BLOCK_M`
rows shares the kmin/kmax loads of its KV head (GQA: query head h reads KV head h // group). Pass 1
(grid rows x KV heads x page blocks) computes the scaled bound of a tile and keeps, per row and page
block, the block's max and sum of exponentials; pass 2 (same grid) merges a row's block statistics
into the softmax normaliser, recomputes the tile, normalises and sums it over its rows into
`partial[row block, page]`, which torch sums over row blocks. [T, Hq, Np] is never stored; the
statistics are [Hkv, rows, page blocks] and the partial sums [Hkv * row blocks, Np].

Dots run in IEEE fp32 (`input_precision="ieee"`, no TF32) so the result stays within fp32 rounding
of the torch reference.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # tokens of a page per iteration (summary update)
BLOCK_ROWS = 16  # (token, head) rows per scoring tile (tl.dot needs >= 16)
BLOCK_PAGES = 32  # pages per scoring tile


def _block_d(head_dim: int) -> int:
    return max(16, min(64, triton.next_power_of_2(head_dim)))


@triton.jit
def _summary_update_kernel(
    src_ptr,  # [R, Hkv, D] keys, any float dtype
    rows_ptr,  # [P * page_size] int64 rows of src (HAS_ROWS) or unused
    valid_ptr,  # [P, page_size] uint8
    page_ids_ptr,  # [P] int64
    kmin_ptr,  # [max_pages, Hkv, D] fp32 (one layer)
    kmax_ptr,
    kmean_ptr,
    stride_src_row,
    stride_src_head,
    stride_tab_page,
    stride_tab_head,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    page = tl.program_id(0)
    head = tl.program_id(1)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_D], tl.float32)
    count = tl.zeros([BLOCK_T], tl.int32)
    for t0 in tl.static_range(0, PAGE_SIZE, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < PAGE_SIZE
        flat = page.to(tl.int64) * PAGE_SIZE + t
        if HAS_ROWS:
            row = tl.load(rows_ptr + flat, mask=t_ok, other=0)
        else:
            row = flat
        ok = (tl.load(valid_ptr + flat, mask=t_ok, other=0) != 0) & t_ok
        m2 = ok[:, None] & d_ok[None, :]
        ptrs = src_ptr + row[:, None] * stride_src_row + head * stride_src_head + offs_d[None, :]
        x = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
        lo = tl.minimum(lo, tl.min(tl.where(m2, x, float("inf")), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(m2, x, float("-inf")), axis=0))
        total += tl.sum(tl.where(m2, x, 0.0), axis=0)
        count += ok.to(tl.int32)
    num_valid = tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32)
    page_id = tl.load(page_ids_ptr + page)
    dst = page_id * stride_tab_page + head * stride_tab_head + offs_d
    tl.store(kmin_ptr + dst, lo, mask=d_ok)
    tl.store(kmax_ptr + dst, hi, mask=d_ok)
    tl.store(kmean_ptr + dst, total / num_valid, mask=d_ok)


def summary_update(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    page_ids: torch.Tensor,
    src: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Write min/max/mean of pages into one layer's tables.

    kmin, kmax, kmean: [max_pages, Hkv, D] fp32 (contiguous in D); page_ids: [P] int64;
    valid: [P, page_size] bool; src: [R, Hkv, D] keys (any float dtype, contiguous in D) read at
    `rows` [P * page_size] (page-major, token order), or at rows 0..P*page_size-1 when rows is None.
    """
    num_pages, page_size = valid.shape
    if num_pages == 0:
        return
    _, num_kv_heads, head_dim = src.shape
    assert src.stride(2) == 1 and kmin.stride(2) == 1 and kmin.stride() == kmax.stride() == kmean.stride()
    assert kmin.shape[1:] == (num_kv_heads, head_dim), (kmin.shape, src.shape)
    if rows is not None:
        assert rows.numel() == num_pages * page_size, (rows.shape, valid.shape)
        rows = rows.reshape(-1).to(torch.int64).contiguous()
    else:
        assert src.shape[0] >= num_pages * page_size, (src.shape, valid.shape)
    block_d = _block_d(head_dim)
    grid = (num_pages, num_kv_heads, triton.cdiv(head_dim, block_d))
    _summary_update_kernel[grid](
        src,
        rows if rows is not None else page_ids,
        valid.contiguous().view(torch.uint8),
        page_ids.to(torch.int64).contiguous(),
        kmin,
        kmax,
        kmean,
        src.stride(0),
        src.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        HAS_ROWS=rows is not None,
        BLOCK_T=min(BLOCK_TOKENS, triton.next_power_of_2(page_size)),
        BLOCK_D=block_d,
    )


@triton.jit
def _bound_tile(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    offs_r,  # [BLOCK_M] rows of this KV head: r = t * group + g
    r_ok,
    offs_p,  # [BLOCK_P] pages
    p_ok,
    kv_head,
    group,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Quest bound q+ . kmax + q- . kmin of a tile: [BLOCK_M, BLOCK_P] fp32 (unscaled)."""
    token = offs_r // group
    q_head = kv_head * group + offs_r % group
    q_rows = q_ptr + token.to(tl.int64) * stride_qt + q_head * stride_qh
    k_cols = offs_p.to(tl.int64) * stride_kp + kv_head * stride_kh
    acc = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    for d0 in tl.static_range(0, HEAD_DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_rows[:, None] + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        k_mask = d_ok[:, None] & p_ok[None, :]
        k_hi = tl.load(kmax_ptr + k_cols[None, :] + d[:, None], mask=k_mask, other=0.0)  # [BLOCK_D, BLOCK_P]
        k_lo = tl.load(kmin_ptr + k_cols[None, :] + d[:, None], mask=k_mask, other=0.0)
        acc = tl.dot(tl.maximum(q, 0.0), k_hi, acc, input_precision="ieee")
        acc = tl.dot(tl.minimum(q, 0.0), k_lo, acc, input_precision="ieee")
    return acc


# The page and row counts change from step to step (a decode step adds a page every 64 tokens): Triton
# would specialise on them (== 1, % 16 == 0) and compile a new variant mid-request, so they are not.
_COUNTS = ["num_rows", "num_pages", "num_page_blocks", "group"]
MIN_PAGE_BLOCKS = 16  # the mass kernel's statistics width: one compiled variant up to 16 x BLOCK_PAGES pages


@triton.jit(do_not_specialize=_COUNTS)
def _score_stats_kernel(
    q_ptr,  # [T, Hq, D]
    kmin_ptr,  # [Np, Hkv, D] fp32
    kmax_ptr,
    m_ptr,  # [Hkv, rows_padded, page_blocks] fp32: block max of the scaled bound
    l_ptr,  # same: sum of exp(scaled bound - block max)
    num_rows,  # T * group
    num_pages,
    num_page_blocks,
    group,
    scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    pid_p = tl.program_id(2)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    r_ok = offs_r < num_rows
    p_ok = offs_p < num_pages
    s = _bound_tile(
        q_ptr, kmin_ptr, kmax_ptr, offs_r, r_ok, offs_p, p_ok, kv_head, group,
        stride_qt, stride_qh, stride_kp, stride_kh, HEAD_DIM, BLOCK_M, BLOCK_P, BLOCK_D,
    )  # fmt: skip
    s = tl.where(p_ok[None, :], s * scale, float("-inf"))
    m = tl.max(s, axis=1)
    sums = tl.sum(tl.exp(s - m[:, None]), axis=1)
    at = (kv_head * tl.num_programs(0) * BLOCK_M + offs_r) * num_page_blocks + pid_p
    tl.store(m_ptr + at, m)
    tl.store(l_ptr + at, sums)


@triton.jit(do_not_specialize=_COUNTS)
def _score_mass_kernel(
    q_ptr,
    kmin_ptr,
    kmax_ptr,
    m_ptr,
    l_ptr,
    partial_ptr,  # [Hkv * row_blocks, Np] fp32: per row block, the summed probability of each page
    num_rows,
    num_pages,
    num_page_blocks,
    group,
    scale,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_BLOCKS: tl.constexpr,  # next power of two >= num_page_blocks
):
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    pid_p = tl.program_id(2)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    r_ok = offs_r < num_rows
    p_ok = offs_p < num_pages
    # the row's softmax normaliser from every page block's statistics
    base = (kv_head * tl.num_programs(0) * BLOCK_M + offs_r) * num_page_blocks
    blocks = tl.arange(0, PAGE_BLOCKS)
    at = base[:, None] + blocks[None, :]
    b_ok = (blocks < num_page_blocks)[None, :]
    block_max = tl.load(m_ptr + at, mask=b_ok, other=float("-inf"))  # [BLOCK_M, PAGE_BLOCKS]
    block_sum = tl.load(l_ptr + at, mask=b_ok, other=0.0)
    row_max = tl.max(block_max, axis=1)
    row_sum = tl.sum(tl.where(b_ok, block_sum * tl.exp(block_max - row_max[:, None]), 0.0), axis=1)
    s = _bound_tile(
        q_ptr, kmin_ptr, kmax_ptr, offs_r, r_ok, offs_p, p_ok, kv_head, group,
        stride_qt, stride_qh, stride_kp, stride_kh, HEAD_DIM, BLOCK_M, BLOCK_P, BLOCK_D,
    )  # fmt: skip
    prob = tl.exp(s * scale - row_max[:, None]) / row_sum[:, None]
    prob = tl.where(r_ok[:, None] & p_ok[None, :], prob, 0.0)
    out_row = kv_head * tl.num_programs(0) + pid_m
    tl.store(partial_ptr + out_row.to(tl.int64) * num_pages + offs_p, tl.sum(prob, axis=0), mask=p_ok)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Unit mass per (query token, head) spread over pages and summed.

    q: [T, Hq, D] (any float dtype); kmin, kmax: [Np, Hkv, D] fp32 -> [Np] fp32 (sums to T * Hq).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, num_kv_heads = kmin.shape[0], kmin.shape[1]
    assert num_heads % num_kv_heads == 0 and kmin.shape == kmax.shape and kmin.shape[2] == head_dim
    if num_pages == 0 or num_tokens == 0:
        return torch.zeros(num_pages, dtype=torch.float32, device=q.device)
    if q.stride(2) != 1:
        q = q.contiguous()
    kmin, kmax = kmin.float().contiguous(), kmax.float().contiguous()
    group = num_heads // num_kv_heads
    num_rows = num_tokens * group
    row_blocks = triton.cdiv(num_rows, BLOCK_ROWS)
    page_blocks = triton.cdiv(num_pages, BLOCK_PAGES)
    grid = (row_blocks, num_kv_heads, page_blocks)
    stats = torch.empty((2, num_kv_heads, row_blocks * BLOCK_ROWS, page_blocks), dtype=torch.float32, device=q.device)
    partial = torch.empty((num_kv_heads * row_blocks, num_pages), dtype=torch.float32, device=q.device)
    common = (
        num_rows,
        num_pages,
        page_blocks,
        group,
        float(scale),
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
    )
    meta = dict(HEAD_DIM=head_dim, BLOCK_M=BLOCK_ROWS, BLOCK_P=BLOCK_PAGES, BLOCK_D=_block_d(head_dim))
    _score_stats_kernel[grid](q, kmin, kmax, stats[0], stats[1], *common, **meta)
    page_blocks_width = max(MIN_PAGE_BLOCKS, triton.next_power_of_2(page_blocks))
    _score_mass_kernel[grid](q, kmin, kmax, stats[0], stats[1], partial, *common, **meta, PAGE_BLOCKS=page_blocks_width)
    return partial.sum(dim=0) if partial.shape[0] > 1 else partial[0]
