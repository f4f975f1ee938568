"""Flash-decoding attention over pool rows (Triton): one new token per sequence attends its rows in place.

A decode step reads, for sequence b, the W pool rows `rows[b]` (its resident pages, padded) holding
the tokens at `key_pos[b]`; a key is visible iff key_pos <= q_pos[b] and, on a sliding layer,
key_pos > q_pos[b] - window (padding rows sit at a huge position, so they are never visible). The
torch path (decode_graph) gathers the rows (two index_select), builds an additive mask and runs SDPA;
here two launches read K/V straight from the pool tensors:

    split kernel   grid (B, Hkv, S): program (b, kv, s) walks rows [s * R, (s + 1) * R) of sequence b
                   in blocks of BLOCK_N (block_rows), once for all G = Hq / Hkv query heads of KV head kv (the G
                   rows padded to 16 for tl.dot), keeps an online softmax in fp32 (base 2) and writes
                   its partial (max, sum, acc) to scratch. Rows that are not visible are not loaded.
    merge kernel   grid (B, Hq): the S partials of one query head -> the normalised output.

With one split (S == 1) the split kernel normalises and writes the output itself: one launch. With
`partial=True` and several splits the merge is left to the caller: the partials come back as `Partials`
(the block kernel's first phase merges them, kernels/layer/block_triton.py).
S and R depend on the shapes only (`split_rows`), so the launch has no host sync and no data-dependent
branch and a CUDA graph captures it; W, R, S and the window are runtime ints (`do_not_specialize`),
so a new window bucket compiles nothing.
`decode_attention_ring` reads a sliding layer's local ring (local_ring.py): the W positions ending at
the token, position p in row base + p % span, addressed by arithmetic (no index tensors).

The torch references are `decode_attention_reference` and `decode_attention_ring_reference`. Shapes: q [B, Hq, D];
k_store, v_store [R, Hkv, D] (one layer of the pool, a plain float dtype); rows, key_pos [B, W] int64;
q_pos [B] int64. bf16/fp16 dots run on tensor cores with fp32 accumulation (the probabilities are
rounded to the V dtype for the second dot, as flash attention does); fp32 dots run in IEEE fp32.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels import pdl
from services.engine.kernels.attention import attention_tiles as tiles
from services.engine.ring.local_ring import ring_read_set

logger = logging.getLogger(__name__)

PAGE_ROWS = 64  # W is a whole number of pages
MIN_BLOCK_G = 16  # tl.dot needs M >= 16: the G query heads of a KV head are padded to this
MAX_SPLIT_ROWS = 512  # rows of one split program at most
# fp8 rows past SHORT_WIDTH: 128-row loop steps in splits of up to 1,024 rows (the default since 2026-12-07;
# KVMEM_FP8_BLOCK_ROWS=64: the 64-row steps of 512-row splits, as plain rows). The split loop is bound by its steps'
# latency, not by their bytes (an fp8 step moves half a bf16 one's): on an H100 at the 8B shape, 32 x 4K rows 143.3
# us against 184.5 in 64-row steps (bf16 rows 195.2), 1 x 32K 41.7 against 65.0 (bf16 55.9) (bench/scale_kernels.py
# --only fp8 --sweep); the ring's 32 x 8K fp8 sessions decode 2,352.8-2,364.9 tok/s against 2,281.3-2,292.3 with 64-row
# steps (one H100, both orders; its GPU tests pass: bench/RESULTS.md round 13)
FP8_BLOCK_ROWS = 128
FP8_MAX_SPLIT_ROWS = 1024
TARGET_PROGRAMS = 256  # split until B * Hkv * S reaches this (about two programs per SM of an H200)
MERGE_BLOCK_S = 16  # partials per iteration of the merge kernel
SHORT_WIDTH = 1024  # windows up to this many rows are read in blocks of 32 rows, longer ones of 64
LOG2E = 1.4426950408889634
NUM_WARPS = 4  # of a split program (bf16 / fp16 dots)
NUM_STAGES = 2  # its software pipeline depth
# registers a thread at most (Triton's maxnreg; None: the compiler's choice, 153 for the fp16-dot fp8 split at D
# 128, i.e. 3 programs of 4 warps an SM). bench/scale_kernels.py --sweep tries 128 (4 an SM; 22 spill loads a
# 128-row step in the SASS): an A/B constant, not measured on a GPU yet
MAX_REGISTERS: int | None = None
# at head_dim 128 (Llama-3.1-8B's 32 / 8 heads) 4 stages, measured on the H200 (bench/scale_kernels.py,
# bench/RESULTS.md): 57.7 -> 47.5 us a layer at 32K rows, batch 1; 360 -> 305 at 32 x 8K; 204 -> 178 at 64 x 2K.
# Other head dims and fp32 K/V keep 2 (D 256 or fp32 tiles at 4 stages would not fit shared memory; nothing
# else was measured)
STAGES_BY_HEAD_DIM = {128: 4}
_PLAIN = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def fp8_dot() -> str:
    """The operands of the fp8 rows' dots: "fp16" (default: q and the codes in fp16, one conversion per two codes,
    the scales folded into the scores and the weights: attention_tiles.softmax_step_f16) or, with
    KVMEM_FP8_DOT=bf16, the bf16 dots before it (A/B runs: bench/scale_kernels.py --only fp8). Decided once."""
    mode = os.environ.get("KVMEM_FP8_DOT", "fp16")
    if mode not in ("fp16", "bf16"):
        raise ValueError(f"KVMEM_FP8_DOT={mode!r}: fp16 or bf16")
    logger.info("fp8 decode attention dots: %s (KVMEM_FP8_DOT)", mode)
    return mode


def supported(k_store: torch.Tensor, fp8: bool = False) -> bool:
    """Whether the kernel reads this pool layer: a plain float dtype, or with `fp8` a uint8 layer of fp8 rows
    (an fp32 scale, then D e4m3fn codes: kv_formats.py; other quantised layers keep the gather path), and a
    head_dim that is a power of two in 16..256."""
    if k_store.dim() != 3:
        return False
    if fp8:
        if k_store.dtype != torch.uint8 or not tiles.fp8_rows_aligned(k_store):
            return False
        head_dim = k_store.shape[-1] - tiles.FP8_SCALE_BYTES
    elif k_store.dtype in _PLAIN:
        head_dim = k_store.shape[-1]
    else:
        return False
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def block_rows(width: int, fp8: bool = False) -> int:
    """Rows per loop step of a split (BLOCK_N); fp8 rows of a window past SHORT_WIDTH: `fp8_block_rows`. A split's
    steps run one after another, each a chain of dependent loads (positions and rows, then K and V); the merge
    pays per split. Measured on the H200 (B 1, Gemma's 4 x 256 heads, 18 layers, bench/RESULTS.md): a 512-row
    window is fastest in 16 splits of one 32-row step (6.5 us a layer vs 8.6 in 8 splits of two), a 2K-4K window
    in 64-row steps (fewer partials to merge; 9.8 and 13.3 us vs 11.0 and 14.3 in 32-row steps). 64 rows of D 256
    spill some registers on sm_90 at 4 warps and still win there."""
    if width <= SHORT_WIDTH:
        return 32
    return fp8_block_rows() if fp8 else 64


@functools.cache
def fp8_block_rows() -> int:
    """Rows a loop step of fp8 rows past SHORT_WIDTH: FP8_BLOCK_ROWS (in splits of up to FP8_MAX_SPLIT_ROWS; the
    default) or, with KVMEM_FP8_BLOCK_ROWS=64, 64 (in 512-row splits, as plain rows: A/B runs). Decided once."""
    rows = int(os.environ.get("KVMEM_FP8_BLOCK_ROWS", FP8_BLOCK_ROWS))
    if rows not in (64, FP8_BLOCK_ROWS):
        raise ValueError(f"KVMEM_FP8_BLOCK_ROWS={rows}: 64 or {FP8_BLOCK_ROWS}")
    return rows


def split_rows(batch: int, num_kv_heads: int, width: int, fp8: bool = False) -> int:
    """Rows per split program (whole loop steps): splits of at most MAX_SPLIT_ROWS (FP8_MAX_SPLIT_ROWS for the
    128-row steps of fp8 rows), halved until the grid has TARGET_PROGRAMS programs (a small batch spreads a long
    window over the device) or they are one step, then evened out over the W rows. A function of the shapes
    only."""
    step = block_rows(width, fp8)
    rows = FP8_MAX_SPLIT_ROWS if step == FP8_BLOCK_ROWS else MAX_SPLIT_ROWS
    while rows > step and batch * num_kv_heads * triton.cdiv(width, rows) < TARGET_PROGRAMS:
        rows //= 2
    return triton.cdiv(triton.cdiv(width, triton.cdiv(width, rows)), step) * step


# -- torch references ----------------------------------------------------------------------------------


def decode_attention_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    rows: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Masked attention of one token per sequence over its pool rows, in fp32 -> [B, Hq, D] in q's dtype.

    q: [B, Hq, D]; k_store, v_store: [R, Hkv, D]; rows, key_pos: [B, W] int64; q_pos: [B] int64. Query
    head h reads KV head h // (Hq / Hkv). Every sequence must see at least one key.
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_store.shape[1]
    group = num_heads // num_kv_heads
    k = k_store[rows].float()  # [B, W, Hkv, D]
    v = v_store[rows].float()
    k = k.repeat_interleave(group, dim=2)  # [B, W, Hq, D]
    v = v.repeat_interleave(group, dim=2)
    visible = key_pos <= q_pos[:, None]  # [B, W]
    if window is not None:
        visible &= key_pos > q_pos[:, None] - window
    scores = torch.einsum("bhd,bwhd->bhw", q.float(), k) * scale  # [B, Hq, W]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhw,bwhd->bhd", probs, v).to(q.dtype)


def decode_attention_ring_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    ring_base: torch.Tensor,
    span: int,
    q_pos: torch.Tensor,
    scale: float,
    width: int,
    window: int | None = None,
) -> torch.Tensor:
    """`decode_attention_reference` over each sequence's local ring (local_ring.py): the `width` positions
    ending at the token, in rows ring_base [B] + p % span."""
    rows, key_pos = ring_read_set(ring_base, span, q_pos, width)
    return decode_attention_reference(q, k_store, v_store, rows, key_pos, q_pos, scale, window)


@dataclass(frozen=True)
class Partials:
    """The split kernel's unmerged output (`partial=True`): for each query head, S partial softmaxes over
    consecutive rows, base 2. m, l [B, Hq, S] fp32 (running max of the scaled scores, sum of exp2(score - m); fp8
    rows with fp16 dots: m is that of score + log2 of the row's value scale, any m serving as long as l and acc use it);
    acc [B, Hq, S, D] fp32 (sum of exp2(score - m) * v). `merge_reference` (or the merge kernel, or the block
    kernel's first phase, kernels/layer/block_triton.py) turns them into the attention output."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the flash-attention name)
    acc: torch.Tensor
    dtype: torch.dtype  # the output's: the merge rounds to it

    @property
    def num_splits(self) -> int:
        return int(self.m.shape[2])


def merge_reference(p: Partials) -> torch.Tensor:
    """The merge kernel in torch: out [B, Hq, D] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s (M the
    largest m_s; a split that saw no key has m = -inf and adds nothing), rounded to p.dtype."""
    top = p.m.amax(dim=2, keepdim=True)
    w = torch.exp2(p.m - top)  # [B, Hq, S]
    return ((w[..., None] * p.acc).sum(dim=2) / (w * p.l).sum(dim=2)[..., None]).to(p.dtype)


# -- kernels -------------------------------------------------------------------------------------------

# Counts that change with the window bucket or the layer: runtime ints, never a new compiled variant.
_COUNTS = ["width", "rows_per_split", "num_splits", "window", "span"]


@triton.jit(do_not_specialize=_COUNTS)
def _split_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [R, Hkv, D]
    v_ptr,  # [R, Hkv, D]
    rows_ptr,  # [B, W] int64, contiguous (RING: [B] the first row of each sequence's ring)
    key_pos_ptr,  # [B, W] int64, contiguous (RING: unused)
    q_pos_ptr,  # [B] int64
    m_ptr,  # [B, Hq, S] fp32: running max of the base-2 scores (unused when DIRECT)
    l_ptr,  # [B, Hq, S] fp32: sum of exp2(score - max)
    acc_ptr,  # [B, Hq, S, D] fp32: sum of exp2(score - max) * v
    out_ptr,  # [B, Hq, D] (DIRECT only)
    keep_ptr,  # [B, Hq, D] contiguous: a copy of q (KEEP_Q only)
    keep_pos_ptr,  # [B] int64: the position whose q is kept, < 0: every one (KEEP_AT only)
    width,
    rows_per_split,
    num_splits,
    window,
    span,  # RING: rows of one ring
    scale_log2,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    RING: tl.constexpr,  # keys are the W positions ending at the token, position p in row base + p % span
    DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,  # rows_per_split // BLOCK_N, interpreted only (0 when compiled)
    KEEP_Q: tl.constexpr,  # the first split's programs copy q to keep_ptr
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    SORTED: tl.constexpr = False,  # key positions non-decreasing along each row list (padding last)
    FP8: tl.constexpr = False,  # uint8 fp8 rows (scale + e4m3fn codes, kv_formats.py): q in bf16 against the codes
    FP8_F16: tl.constexpr = False,  # with FP8: q and the codes in fp16 (attention_tiles.softmax_step_f16)
    KEEP_AT: tl.constexpr = False,  # with KEEP_Q: only where keep_pos < 0 or q_pos == keep_pos
):
    pdl.start(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    heads = kv * G + g  # [BLOCK_G] query heads of this KV head
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    if KEEP_Q:
        if split == 0:
            keep = g_ok
            if KEEP_AT:  # a burst keeps the query of one step (its scoring step), every step when < 0
                at = tl.load(keep_pos_ptr + b)
                keep = tl.where((at < 0) | (at == tl.load(q_pos_ptr + b)), keep, False)  # interpreted: not `&`
            kept = keep_ptr + (b * tl.num_programs(1) * G + heads[:, None]) * D + d[None, :]
            tl.store(kept, q.to(keep_ptr.dtype.element_ty), mask=keep[:, None])
    if FP8_F16:  # a larger |q| would be inf in fp16 (a model's queries are far from it)
        q = tl.clamp(q.to(tl.float32), -tiles.F16_MAX, tiles.F16_MAX).to(tl.float16)
        if DOT_FP32:  # interpreted: rounded to fp16 as on the GPU, the dots in fp32
            q = q.to(tl.float32)
    elif DOT_FP32:
        q = q.to(tl.float32)
    elif FP8:
        q = q.to(tl.bfloat16)
    else:
        q = q.to(k_ptr.dtype.element_ty)
    q_pos = tl.load(q_pos_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    start = split * rows_per_split
    if RING:
        base = tl.load(rows_ptr + b)
    # SORTED: a split whose first key is after the query (the padding of a window bucket, or future rows) has
    # nothing to attend: it walks no rows and leaves m = -inf, l = 0, acc = 0 (the merge weighs it 0)
    n_stop = rows_per_split
    if SORTED:
        if not RING:
            n_stop = tl.where(tl.load(key_pos_ptr + b * width + start) > q_pos, 0, rows_per_split)
    # the last split may end past W: those rows are masked
    for n0 in range(0, SPLIT_BLOCKS * BLOCK_N if INTERPRETED else n_stop, BLOCK_N):
        n = start + n0 + tl.arange(0, BLOCK_N)
        in_w = n < width
        if SORTED:  # interpreted, the loop runs to the constexpr bound: the rows past n_stop are masked
            in_w = in_w & (n < start + n_stop)
        if RING:  # rows from arithmetic: no index load before the K/V loads
            pos = q_pos - width + 1 + n
            ok = in_w & (pos >= 0)
            row = base + tl.where(ok, pos, 0).to(tl.int32) % span  # int32: a 64-bit modulo is a long sequence
        else:
            pos = tl.load(key_pos_ptr + b * width + n, mask=in_w, other=0)
            ok = in_w & (pos <= q_pos)
            row = tl.load(rows_ptr + b * width + n, mask=in_w, other=0)  # with the positions, not after them
        if HAS_WINDOW:
            ok = ok & (pos > q_pos - window)
        k, v, k_scale, v_scale = tiles.load_kv(
            k_ptr, v_ptr, row, kv, stride_kr, stride_kh, stride_vr, stride_vh, d, ok, True, FP8, FP8_F16, INTERPRETED
        )
        if FP8_F16:
            m_i, l_i, acc = tiles.softmax_step_f16(
                q, k, v, k_scale, v_scale, ok[None, :], m_i, l_i, acc, scale_log2, True, DOT_FP32
            )
        else:
            m_i, l_i, acc = tiles.softmax_step(
                q, k, v, k_scale, v_scale, ok[None, :], m_i, l_i, acc, scale_log2, True, DOT_FP32, FP8
            )
    if DIRECT:
        o = acc / l_i[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        at = ((b * tl.num_programs(1) * G + heads) * num_splits + split).to(tl.int64)  # [BLOCK_G]
        tl.store(m_ptr + at, m_i, mask=g_ok)
        tl.store(l_ptr + at, l_i, mask=g_ok)
        tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    m_ptr,  # [B, Hq, S] fp32
    l_ptr,  # [B, Hq, S] fp32
    acc_ptr,  # [B, Hq, S, D] fp32
    out_ptr,  # [B, Hq, D]
    num_splits,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SPLITS: tl.constexpr,  # num_splits, interpreted only (0 when compiled)
    PDL: tl.constexpr,
):
    """out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s, M the largest m_s (a fully masked
    split has m = -inf and contributes nothing)."""
    pdl.start(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h).to(tl.int64) * num_splits
    d = tl.arange(0, D)
    m_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, SPLITS if INTERPRETED else num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s, mask=s < num_splits, other=float("-inf")))
    top = tl.max(m_max, axis=0)
    l_sum = tl.zeros([BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_S, D], tl.float32)
    for s0 in range(0, SPLITS if INTERPRETED else num_splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < num_splits
        w = tl.exp2(tl.load(m_ptr + base + s, mask=s_ok, other=float("-inf")) - top)  # [BLOCK_S]
        l_sum += w * tl.load(l_ptr + base + s, mask=s_ok, other=0.0)
        a = tl.load(acc_ptr + (base + s)[:, None] * D + d[None, :], mask=s_ok[:, None], other=0.0)
        acc += w[:, None] * a
    o = tl.sum(acc, axis=0) / tl.sum(l_sum, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


# -- wrappers ------------------------------------------------------------------------------------------

# Triton 3.5's interpreter fails on a loop whose bound is a runtime int under numpy >= 2.4
# (triton-lang/triton#9171: `int()` of a 1-element array): interpreted, the loop bounds are passed as
# constexprs instead (nothing is compiled there); compiled, they stay runtime ints. Its tl.dot also
# multiplies bf16/fp16 operands as raw bits, so interpreted dots are fp32 (the tests' CPU runs check the
# masking, split and merge logic; the tensor-core path of bf16/fp16 is checked by the GPU tests).
INTERPRETED = isinstance(_split_kernel, InterpretedFunction)


def decode_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    rows: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None = None,
    out: torch.Tensor | None = None,
    partial: bool = False,
    keep_q: torch.Tensor | None = None,
    sorted_keys: bool = False,
    fp8: bool = False,
    keep_pos: torch.Tensor | None = None,
) -> torch.Tensor | Partials:
    """`decode_attention_reference` in one or two launches -> out [B, Hq, D] (q's dtype unless `out`); with
    `partial`, the split kernel's Partials when there are several splits (no merge launch: the caller merges);
    `keep_q` [B, Hq, D] (contiguous): q is also copied there, by the same launch (a decode step's queries,
    kept for page scoring, without a copy of their own); with `keep_pos` [B] int64, only sequence b's with
    keep_pos[b] < 0 or q_pos[b] == keep_pos[b] (a decode burst keeps its scoring step's query: the other steps
    leave keep_q[b] as it is). `sorted_keys`: the caller promises each row list's
    key positions never decrease (the decode graphs' read sets: pages in order, padding at PAD_POS last), so a
    split whose first key is after the query skips its rows (a window bucket's padding costs no loop).

    q: [B, Hq, D] (last dim contiguous); k_store, v_store: [R, Hkv, D] one pool layer (plain float
    dtype, last dim contiguous; `fp8`: uint8 [R, Hkv, 16 + D] fp8 rows, read as codes and scales, the
    reference's over their dequantised rows); rows, key_pos: [B, W] int64 with W a multiple of 64; q_pos: [B] int64.
    Capturable in a CUDA graph (no host sync; scratch is allocated from the shapes).
    """
    batch, width = rows.shape
    assert rows.shape == key_pos.shape == (batch, width) and q_pos.shape == (batch,), (rows.shape, key_pos.shape)
    assert rows.dtype == key_pos.dtype == q_pos.dtype == torch.int64
    rows, key_pos = rows.contiguous(), key_pos.contiguous()
    return _attend(
        q, k_store, v_store, rows, key_pos, q_pos, scale, window, out, width, 0, partial, keep_q, sorted_keys, fp8,
        keep_pos,
    )  # fmt: skip


def decode_attention_ring(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    ring_base: torch.Tensor,
    span: int,
    q_pos: torch.Tensor,
    scale: float,
    width: int,
    window: int | None = None,
    out: torch.Tensor | None = None,
    partial: bool = False,
) -> torch.Tensor | Partials:
    """`decode_attention_ring_reference` in one or two launches (`partial`: as decode_attention): the keys are
    the `width` positions ending at each token in its local ring (row ring_base [B] + p % span), addressed by
    arithmetic instead of index tensors (no rows to build per step, no index load before the K/V loads).
    width: a multiple of 64."""
    batch = q.shape[0]
    assert ring_base.shape == q_pos.shape == (batch,) and ring_base.dtype == q_pos.dtype == torch.int64
    assert span >= width, (span, width)
    return _attend(
        q, k_store, v_store, ring_base.contiguous(), ring_base, q_pos, scale, window, out, width, span, partial
    )


def _attend(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    rows: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    window: int | None,
    out: torch.Tensor | None,
    width: int,
    span: int,
    partial: bool = False,
    keep_q: torch.Tensor | None = None,
    sorted_keys: bool = False,
    fp8: bool = False,
    keep_pos: torch.Tensor | None = None,
) -> torch.Tensor | Partials:
    """The launches of both read sets: rows/key_pos [B, W] (span 0), or a ring (rows = ring bases, span > 0);
    `partial`: the partials instead of the merge launch (one split: the output, as always); `keep_q`: a copy
    of q written there (`keep_pos`: only in the rows it selects); `fp8`: the stores are uint8 fp8 rows."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_store.shape[1]
    assert supported(k_store, fp8), f"k_store {k_store.dtype} {tuple(k_store.shape)}: plain float or fp8, D 2^k <= 256"
    assert v_store.dtype == k_store.dtype and v_store.shape == k_store.shape, (v_store.shape, k_store.shape)
    row_width = tiles.fp8_row_bytes(head_dim) if fp8 else head_dim
    assert k_store.shape[2] == row_width and num_heads % num_kv_heads == 0, (q.shape, k_store.shape)
    assert q.stride(2) == 1 and k_store.stride(2) == 1 and v_store.stride(2) == 1
    assert q_pos.shape == (batch,) and q_pos.dtype == torch.int64, (q_pos.shape, q_pos.dtype)
    assert width % PAGE_ROWS == 0 and width > 0, f"W {width} is not a positive multiple of {PAGE_ROWS}"
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1, (out.shape, q.shape)
    assert keep_q is None or (keep_q.shape == q.shape and keep_q.is_contiguous()), (keep_q, q.shape)
    if keep_pos is not None:
        assert keep_q is not None and keep_pos.shape == (batch,) and keep_pos.dtype == torch.int64, keep_pos.shape
        keep_pos = keep_pos.contiguous()
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    per_split = split_rows(batch, num_kv_heads, width, fp8)
    block_n = block_rows(width, fp8)
    per_split = -(-per_split // block_n) * block_n
    num_splits = triton.cdiv(width, per_split)
    direct = num_splits == 1
    if direct:  # the split kernel writes `out`; the scratch pointers are never read
        m = l_sum = acc = out
    else:
        m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
        acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    q_pos = q_pos.contiguous()
    # fp32 dots (IEEE) for fp32 or mixed inputs, and interpreted: the interpreter's tl.dot is wrong on bf16
    f16 = fp8 and fp8_dot() == "fp16"
    if f16:  # q and the codes are fp16 in the kernel, whatever q's dtype
        dot_fp32 = INTERPRETED
    elif fp8:  # the codes are bf16 in the kernel
        dot_fp32 = q.dtype == torch.float32 or INTERPRETED
    else:
        dot_fp32 = k_store.dtype == torch.float32 or q.dtype != k_store.dtype or INTERPRETED
    stages = NUM_STAGES if dot_fp32 else STAGES_BY_HEAD_DIM.get(head_dim, NUM_STAGES)
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_store, v_store, rows, key_pos, q_pos, m, l_sum, acc, out, keep_q if keep_q is not None else out,
        keep_pos if keep_pos is not None else q_pos,
        width, per_split, num_splits, window if window is not None else 0, max(span, 1), scale * LOG2E,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(MIN_BLOCK_G, triton.next_power_of_2(group)), D=head_dim, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, RING=span > 0, DIRECT=direct, DOT_FP32=dot_fp32, INTERPRETED=INTERPRETED,
        SPLIT_BLOCKS=per_split // block_n if INTERPRETED else 0, KEEP_Q=keep_q is not None, SORTED=sorted_keys,
        FP8=fp8, FP8_F16=f16, KEEP_AT=keep_pos is not None,
        num_warps=8 if dot_fp32 else NUM_WARPS, num_stages=stages, **pdl.launch_args(q.device),
        **({"maxnreg": MAX_REGISTERS} if MAX_REGISTERS and not INTERPRETED else {}),
    )  # fmt: skip
    if direct:
        return out
    partials = Partials(m, l_sum, acc, out.dtype)
    return partials if partial else merge(partials, out)


def merge(p: Partials, out: torch.Tensor | None = None) -> torch.Tensor:
    """`merge_reference` in one launch -> out [B, Hq, D] (p.dtype unless `out`)."""
    batch, num_heads, num_splits = p.m.shape
    head_dim = p.acc.shape[3]
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=p.dtype, device=p.m.device)
    assert out.shape == (batch, num_heads, head_dim) and out.stride(2) == 1, (out.shape, p.acc.shape)
    _merge_kernel[(batch, num_heads)](
        p.m, p.l, p.acc, out, num_splits, out.stride(0), out.stride(1), D=head_dim, BLOCK_S=MERGE_BLOCK_S,
        INTERPRETED=INTERPRETED, SPLITS=num_splits if INTERPRETED else 0, num_warps=4, **pdl.launch_args(out.device),
    )  # fmt: skip
    return out
