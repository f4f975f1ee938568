"""A decoder layer's second half in one persistent launch (Triton): o projection to the next layer's qkv.

A batch-1 decode step of Gemma 3 270M is ~170 kernels of 2-5 us, each mostly start-up and first-load
latency (bench/RESULTS.md, runs 7-14); the weights of a layer (11 MB) stream in under 3 us. This kernel
runs the launches between one layer's attention and the next layer's attention (six for Gemma 3, eight
for the Llama family) as four phases of one launch, separated by grid-wide barriers instead of kernel
boundaries:

    1. o = attn @ W_o^T                                    (column tiles of the hidden size)
    2. s = x + post_attn_norm(o); h = pre_ffn_norm(s)      (every program, from the whole o)
       g = act(h @ W_gate^T) * (h @ W_up^T)                (column tiles of the intermediate size)
    3. d = g @ W_down^T                                    (column tiles of the hidden size)
    4. x' = s + post_ffn_norm(d); h' = next_norm(x')       (every program, from the whole d)
       qkv' = h' @ W_qkv'^T (+ b)                          (column tiles; the last layer has none)

Phase 1 may take the attention as the split kernel's unmerged partials instead of its output
(decode_attention_triton.Partials, `takes`): its tiles are then (query head, rows of W_o), each program
merges its head's partials itself and stores that head's share of o in fp32, and phase 2 sums the shares:
the merge launch of every layer is gone (KVMEM_BLOCK_MERGE=0 keeps it: `merges`).

Gemma 3 has the post-norms (its sandwich norms: RMSNorm x * r * (1 + w) in fp32, GELU-tanh); the Llama
family (Llama, SmolLM2, Qwen2 with its qkv bias, Qwen3) adds o and d to the residual as they are (RMSNorm
w * cast(x * r), SiLU). The norms are not phases of their own: every program recomputes the row it needs.

The launch has one program per SM at most, all resident at once, which the barriers need (a barrier is an
arrival counter of kernels/layer/arrivals.py each program increments, then polls until every program has
arrived; the last program to leave sets the counters back to zero, so a CUDA graph replays the launch as
is). Under MPS with a share of the SMs it is off (`enabled`). Each intermediate is rounded to the model
dtype where the launches it replaces round it (`block_reference`, their torch references composed).

Batch 1 only (`supported`): a decode batch of more rows keeps the launches, as does KVMEM_BLOCK_KERNEL=0.
Interpreted (CPU tests) the kernel runs as one program that takes every tile, its barriers trivially passed.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels import pdl
from services.engine.kernels.attention.decode_attention_triton import Partials, merge, merge_reference
from services.engine.kernels.layer import arrivals
from services.engine.kernels.layer.linear_triton import ACTIVATIONS, act_mul, linear_gated_reference
from services.engine.kernels.layer.norm_triton import normed_by

logger = logging.getLogger(__name__)

COUNTERS = 4  # three barriers and the exit count
MAX_SPLITS = 64  # partials merged in the first phase: a program holds one head's [splits, head_dim] in fp32


@dataclass(frozen=True)
class BlockWeights:
    """One layer's second half and the next layer's qkv projection (None after the last layer). `gemma`:
    Gemma's norms (scale 1 + weight, as transformers stores it) with the post-norms `post_attn` and
    `post_ffn`; else the Llama family's (scale weight), whose post-norms are None."""

    o: torch.Tensor  # [H, Q]
    post_attn: torch.Tensor | None  # [H]
    pre_ffn: torch.Tensor  # [H]: the MLP's input norm
    gate_up: torch.Tensor  # [2I, H] = [gate | up]
    down: torch.Tensor  # [H, I]
    post_ffn: torch.Tensor | None  # [H]
    next_norm: torch.Tensor  # [H]: the next layer's input norm, or the final norm
    qkv: torch.Tensor | None  # [N, H]: the next layer's projection
    qkv_bias: torch.Tensor | None  # [N]
    eps: float
    gemma: bool
    act: str  # one of ACTIVATIONS


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """models/gemma3.GemmaRMSNorm (gemma) or models/llama.RMSNorm, as their torch code rounds."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (x32 * (1.0 + weight.float())).to(x.dtype)
    return weight * x32.to(x.dtype)


def block_reference(
    attn: torch.Tensor | Partials, x: torch.Tensor, w: BlockWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """attn [M, Q] (or the attention's unmerged Partials, merged as the merge kernel does), x [M, H] (the
    residual stream) -> (x', h', qkv' or None) as the launches compute them: each projection rounded to the
    model dtype, each norm as the model's torch code rounds it, the residual adds in the model dtype (the
    layers of models/gemma3.py and models/llama.py)."""
    if isinstance(attn, Partials):
        attn = merge_reference(attn).reshape(attn.m.shape[0], -1)
    o = F.linear(attn, w.o)
    s = x + (_norm_reference(o, w.post_attn, w.eps, w.gemma) if w.post_attn is not None else o)
    h = _norm_reference(s, w.pre_ffn, w.eps, w.gemma)
    d = F.linear(linear_gated_reference(h, w.gate_up, w.act), w.down)
    x2 = s + (_norm_reference(d, w.post_ffn, w.eps, w.gemma) if w.post_ffn is not None else d)
    h2 = _norm_reference(x2, w.next_norm, w.eps, w.gemma)
    return x2, h2, F.linear(h2, w.qkv, w.qkv_bias) if w.qkv is not None else None


def supported(x: torch.Tensor, w: BlockWeights) -> bool:
    """One row x [1, H] of the weights' float dtype, contiguous weights, a hidden size of at most 1,024 and
    an intermediate size of at most 4,096 (a program holds a whole row of each), both post-norms or none."""
    mats = [w.o, w.gate_up, w.down] + ([w.qkv] if w.qkv is not None else [])
    hidden, inter = w.o.shape[0], w.down.shape[1]
    norms = [n for n in (w.post_attn, w.pre_ffn, w.post_ffn, w.next_norm) if n is not None]
    return (
        x.shape == (1, hidden)
        and x.is_contiguous()
        and hidden <= 1024
        and inter <= 4096
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and all(m.dtype == x.dtype and m.is_contiguous() for m in mats)
        and w.gate_up.shape == (2 * inter, hidden)
        and w.down.shape[0] == hidden
        and (w.qkv is None or w.qkv.shape[1] == hidden)
        and (
            w.qkv_bias is None
            or (w.qkv is not None and w.qkv_bias.shape == (w.qkv.shape[0],) and w.qkv_bias.is_contiguous())
        )
        and (w.post_attn is None) == (w.post_ffn is None)
        and all(n.shape == (hidden,) and n.is_contiguous() and n.is_floating_point() for n in norms)
        and w.act in ACTIVATIONS
    )


@functools.cache
def enabled() -> bool:
    """Whether the forward takes this kernel where it can: not with KVMEM_BLOCK_KERNEL=0 (the launches: A/B
    runs), nor under MPS with a share of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE below 100), where fewer
    programs than the SM count may be resident at once and a barrier would wait for ever."""
    if os.environ.get("KVMEM_BLOCK_KERNEL", "1") == "0":
        logger.info("persistent layer-half kernel: off (KVMEM_BLOCK_KERNEL=0)")
        return False
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100").strip()
    if share not in ("100", "100.0"):
        logger.warning("persistent layer-half kernel: off (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s)", share)
        return False
    logger.info("persistent layer-half kernel: on")
    return True


@functools.cache
def merges() -> bool:
    """Whether a forward that takes this kernel hands it the attention's unmerged partials (its first phase
    merges them: one launch fewer a layer); KVMEM_BLOCK_MERGE=0 keeps the merge launch (A/B runs)."""
    on = os.environ.get("KVMEM_BLOCK_MERGE", "1") != "0"
    logger.info("attention merge in the layer-half kernel: %s", "on" if on else "off (KVMEM_BLOCK_MERGE=0)")
    return on


@triton.jit
def _arrive(bar_ptr):
    """A grid-wide barrier's first half: this program's stores so far are released to every program that
    passes `_await` on the same counter (an atomic increment, release). Between the two halves a program
    loads only what no program writes (the next phase's weight tile): the release waits for the loads
    issued before it, so a tile loaded before `_arrive` delays the arrival, one loaded after it arrives
    while the program waits (bench/RESULTS.md, run 18)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release")


@triton.jit
def _await(bar_ptr, nprog):
    """A grid-wide barrier's second half: polls the counter with atomic reads (acquire) until every program
    has arrived. Polling with `ld.acquire.gpu` loads instead was slower on the H200 (bench/RESULTS.md)."""
    arrived = tl.atomic_add(bar_ptr, 0, sem="acquire")
    while arrived < nprog:
        arrived = tl.atomic_add(bar_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _norm_weight(ptr, offs, mask):
    """A norm's weight in fp32 (zero past the row), loaded at the launch's start: weights are never written,
    so the loads need not wait for the previous kernel or a barrier."""
    return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _row(ptr, offs, mask):
    """A row this launch wrote (another program's stores: read from L2, not a stale L1 line) in fp32."""
    return tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _residual(x, y, w_norm, out_ty: tl.constexpr, dim, eps, GEMMA: tl.constexpr, POST_NORMS: tl.constexpr):
    """x (fp32) + the row y (fp32), post-normed with the weight w_norm when POST_NORMS (norm_triton's
    `normed_by`, rounded as the model's norm rounds), -> out_ty."""
    if POST_NORMS:
        y = normed_by(y, w_norm, out_ty, dim, eps, 1.0, GEMMA).to(out_ty).to(tl.float32)
    return (x + y).to(out_ty)


@triton.jit
def _wtile(w_ptr, row_off, n_rows, k_dim, t, BN: tl.constexpr, BK: tl.constexpr):
    """Rows t*BN.. of w (rows of k_dim, from row_off), zero past the ends: [BN, BK] in w's dtype."""
    cols = t * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    mask = (cols < n_rows)[:, None] & (ks < k_dim)[None, :]
    return tl.load(w_ptr + (row_off + cols[:, None]).to(tl.int64) * k_dim + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _wtile_head(w_ptr, n_rows, stride, t, col0, ok, BN: tl.constexpr, D: tl.constexpr):
    """Rows t*BN.. of w (rows of `stride` elements), its D columns from col0: [BN, D], zero past the last
    row and where not `ok` (a program with no tile)."""
    cols = t * BN + tl.arange(0, BN)
    ks = tl.arange(0, D)
    mask = ((cols < n_rows) & ok)[:, None] & (ks < D)[None, :]
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * stride + col0 + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _merged(m_ptr, l_ptr, acc_ptr, head, splits, ok, out_ty, BLOCK_S: tl.constexpr, D: tl.constexpr):
    """Query head `head`'s attention output from the split kernel's partials (decode_attention_triton's
    merge kernel for one head, Partials): [D] fp32, rounded to out_ty as the merge kernel stores it. Zeros
    where not `ok`."""
    s = tl.arange(0, BLOCK_S)
    s_ok = (s < splits) & ok
    at = head * splits + s
    m = tl.load(m_ptr + at, mask=s_ok, other=float("-inf"))
    lsum = tl.load(l_ptr + at, mask=s_ok, other=0.0)
    d = tl.arange(0, D)
    acc = tl.load(acc_ptr + at[:, None].to(tl.int64) * D + d[None, :], mask=s_ok[:, None], other=0.0)
    top = tl.where(ok, tl.max(m, axis=0), 0.0)  # a split that saw no key has m = -inf: weight 0
    w = tl.exp2(m - top)
    den = tl.where(ok, tl.sum(w * lsum, axis=0), 1.0)
    return (tl.sum(w[:, None] * acc, axis=0) / den).to(out_ty).to(tl.float32)


@triton.jit
def _mv(w, x):
    """w [BN, BK] times x [BK] (fp32) -> [BN] fp32."""
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _store(ptr, t, y, n, BN: tl.constexpr, ok=True):
    cols = t * BN + tl.arange(0, BN)
    tl.store(ptr + cols, y.to(ptr.dtype.element_ty), mask=(cols < n) & ok)


@triton.jit
def _biased(y, b_ptr, t, n, BN: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y [BN] (fp32, columns t*BN..) plus their bias (HAS_BIAS), before the one rounding."""
    if HAS_BIAS:
        cols = t * BN + tl.arange(0, BN)
        y += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    return y


@triton.jit
def _block_kernel(
    attn_ptr, x_ptr, wo_ptr, post_attn_ptr, pre_ffn_ptr, wgu_ptr, wd_ptr, post_ffn_ptr, next_ptr, wqkv_ptr,
    bqkv_ptr, o_ptr, g_ptr, d_ptr, x_out_ptr, h_out_ptr, qkv_ptr, bar_ptr, pm_ptr, pl_ptr, pacc_ptr, o32_ptr,
    eps, splits, hidden: tl.constexpr, q_dim: tl.constexpr, inter: tl.constexpr, n_qkv: tl.constexpr,
    GEMMA: tl.constexpr, POST_NORMS: tl.constexpr, ACT: tl.constexpr, HAS_QKV: tl.constexpr,
    HAS_QKV_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_I: tl.constexpr,
    BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BN_QKV: tl.constexpr, NPROG: tl.constexpr,
    ONE_ROUND: tl.constexpr, PARTIALS: tl.constexpr, HEADS: tl.constexpr, HEAD_D: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One of NPROG programs (all resident): the four phases over their column tiles, a grid-wide barrier
    between them. ONE_ROUND (compiled: at most one tile per program in every phase): each phase's weight tile
    is loaded while the program waits at the barrier that precedes it (between `_arrive` and `_await`;
    weights are never written), and the norms' weights at the start, so a phase after a barrier waits only
    for the row it reads; else (interpreted, one program) each phase loops over its tiles.
    PARTIALS: the attention comes as the split kernel's partials (`splits` per query head, Partials) and
    phase 1's tiles are (query head, BN_O rows): each program merges its head and writes that head's share
    of o in fp32 (o32 [HEADS, hidden]), which phase 2 sums. Sizes are constexprs: a model's shapes."""
    pid = tl.program_id(0)
    out_ty = x_out_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < hidden
    offs_q = tl.arange(0, BLOCK_Q)
    offs_i = tl.arange(0, BLOCK_I)
    tiles_h = (hidden + BN_O - 1) // BN_O  # PARTIALS: row tiles of one head's columns
    if ONE_ROUND:
        if PARTIALS:
            head, rt = pid // tiles_h, pid % tiles_h
            w_o = _wtile_head(wo_ptr, hidden, q_dim, rt, head * HEAD_D, head < HEADS, BN_O, HEAD_D)
        else:
            w_o = _wtile(wo_ptr, 0, hidden, q_dim, pid, BN_O, BLOCK_Q)
    w_post_attn = _norm_weight(post_attn_ptr, offs_h, mask_h)  # POST_NORMS: else not read
    w_pre_ffn = _norm_weight(pre_ffn_ptr, offs_h, mask_h)
    w_post_ffn = _norm_weight(post_ffn_ptr, offs_h, mask_h)  # POST_NORMS: else not read
    w_next = _norm_weight(next_ptr, offs_h, mask_h)
    pdl.start(PDL)
    # 1. o = attn @ W_o^T
    x = tl.load(x_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if PARTIALS:
        if ONE_ROUND:
            a_h = _merged(pm_ptr, pl_ptr, pacc_ptr, head, splits, head < HEADS, out_ty, BLOCK_S, HEAD_D)
            _store(o32_ptr + head * hidden, rt, _mv(w_o, a_h), hidden, BN_O, head < HEADS)
        else:
            for i in range(0, HEADS * tiles_h, NPROG):  # past the end: the last tile again (the same values)
                t = tl.minimum(i + pid, HEADS * tiles_h - 1)
                head, rt = t // tiles_h, t % tiles_h
                a_h = _merged(pm_ptr, pl_ptr, pacc_ptr, head, splits, True, out_ty, BLOCK_S, HEAD_D)
                w_t = _wtile_head(wo_ptr, hidden, q_dim, rt, head * HEAD_D, True, BN_O, HEAD_D)
                _store(o32_ptr + head * hidden, rt, _mv(w_t, a_h), hidden, BN_O)
    else:
        a = tl.load(attn_ptr + offs_q, mask=offs_q < q_dim, other=0.0).to(tl.float32)
        if ONE_ROUND:
            _store(o_ptr, pid, _mv(w_o, a), hidden, BN_O)
        else:
            for i in range(0, (hidden + BN_O - 1) // BN_O, NPROG):  # tiles past the end are masked
                t = i + pid
                _store(o_ptr, t, _mv(_wtile(wo_ptr, 0, hidden, q_dim, t, BN_O, BLOCK_Q), a), hidden, BN_O)
    _arrive(bar_ptr)
    if ONE_ROUND:
        w_g = _wtile(wgu_ptr, 0, inter, hidden, pid, BN_GU, BLOCK_H)
        w_u = _wtile(wgu_ptr, inter, inter, hidden, pid, BN_GU, BLOCK_H)
    _await(bar_ptr, NPROG)
    # 2. the attention's (post-normed) residual add and the MLP's input norm; gate/up with act(gate) * up
    if PARTIALS:  # o: the heads' shares summed in fp32, rounded once as the o projection rounds
        o_row = tl.zeros([BLOCK_H], tl.float32)
        for hh in tl.static_range(HEADS):
            o_row += _row(o32_ptr + hh * hidden, offs_h, mask_h)
        o_row = o_row.to(out_ty).to(tl.float32)
    else:
        o_row = _row(o_ptr, offs_h, mask_h)
    s = _residual(x, o_row, w_post_attn, out_ty, hidden, eps, GEMMA, POST_NORMS)
    h = normed_by(s.to(tl.float32), w_pre_ffn, out_ty, hidden, eps, 1.0, GEMMA).to(out_ty).to(tl.float32)
    if ONE_ROUND:
        _store(g_ptr, pid, act_mul(_mv(w_g, h), _mv(w_u, h), out_ty, ACT), inter, BN_GU)
    else:
        for i in range(0, (inter + BN_GU - 1) // BN_GU, NPROG):  # tiles past the end are masked
            t = i + pid
            gate = _mv(_wtile(wgu_ptr, 0, inter, hidden, t, BN_GU, BLOCK_H), h)
            up = _mv(_wtile(wgu_ptr, inter, inter, hidden, t, BN_GU, BLOCK_H), h)
            _store(g_ptr, t, act_mul(gate, up, out_ty, ACT), inter, BN_GU)
    _arrive(bar_ptr + 1)
    if ONE_ROUND:
        w_d = _wtile(wd_ptr, 0, hidden, inter, pid, BN_D, BLOCK_I)
    _await(bar_ptr + 1, NPROG)
    # 3. d = g @ W_down^T
    g = _row(g_ptr, offs_i, offs_i < inter)
    if ONE_ROUND:
        _store(d_ptr, pid, _mv(w_d, g), hidden, BN_D)
    else:
        for i in range(0, (hidden + BN_D - 1) // BN_D, NPROG):  # tiles past the end are masked
            t = i + pid
            _store(d_ptr, t, _mv(_wtile(wd_ptr, 0, hidden, inter, t, BN_D, BLOCK_I), g), hidden, BN_D)
    _arrive(bar_ptr + 2)
    if ONE_ROUND and HAS_QKV:
        w_qkv = _wtile(wqkv_ptr, 0, n_qkv, hidden, pid, BN_QKV, BLOCK_H)
    _await(bar_ptr + 2, NPROG)
    # 4. the MLP's (post-normed) residual add and the next norm; the next layer's qkv (+ bias)
    x2 = _residual(s.to(tl.float32), _row(d_ptr, offs_h, mask_h), w_post_ffn, out_ty, hidden, eps, GEMMA, POST_NORMS)
    h2 = normed_by(x2.to(tl.float32), w_next, out_ty, hidden, eps, 1.0, GEMMA).to(out_ty)
    if pid == 0:
        tl.store(x_out_ptr + offs_h, x2, mask=mask_h)
        tl.store(h_out_ptr + offs_h, h2, mask=mask_h)
    if HAS_QKV:
        if ONE_ROUND:
            _store(qkv_ptr, pid, _biased(_mv(w_qkv, h2.to(tl.float32)), bqkv_ptr, pid, n_qkv, BN_QKV, HAS_QKV_BIAS),
                   n_qkv, BN_QKV)  # fmt: skip
        else:
            for i in range(0, (n_qkv + BN_QKV - 1) // BN_QKV, NPROG):  # tiles past the end are masked
                t = i + pid
                w_t = _wtile(wqkv_ptr, 0, n_qkv, hidden, t, BN_QKV, BLOCK_H)
                y = _biased(_mv(w_t, h2.to(tl.float32)), bqkv_ptr, t, n_qkv, BN_QKV, HAS_QKV_BIAS)
                _store(qkv_ptr, t, y, n_qkv, BN_QKV)
    # the last program out sets the counters back to zero (every program has passed every barrier): one
    # plain store (the launch's end makes it visible to the next launch); four atomic exchanges, each
    # waiting for the one before (acq_rel), kept the launch's end ~2.5 us later (bench/RESULTS.md, run 18)
    left = tl.atomic_add(bar_ptr + 3, 1, sem="acq_rel")
    if left == NPROG - 1:
        tl.store(bar_ptr + tl.arange(0, 4), tl.zeros([4], tl.int32))  # the COUNTERS


INTERPRETED = isinstance(_block_kernel, InterpretedFunction)


def _tile(n: int, programs: int) -> int:
    """Columns per tile: the smallest power of two that gives at most one tile per program (one round of
    tiles per phase), at most 64 (interpreted: one program loops over tiles of 64)."""
    bn = 1
    while bn < 64 and triton.cdiv(n, bn) > programs:
        bn *= 2
    return bn


def ready(device: torch.device, launches: int) -> bool:
    """Whether `launches` launches on `device` now get their barrier counters (kernels/layer/arrivals.py): a
    forward checks this before it takes the kernel for every layer."""
    return arrivals.available(device, launches, COUNTERS)


@functools.cache
def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def takes(p: Partials, x: torch.Tensor, w: BlockWeights) -> bool:
    """Whether `block` merges these partials itself: one row, fp32 partials of the model dtype's output, the
    query heads' width the o projection's, at most MAX_SPLITS splits (a program holds a head's partials)."""
    batch, heads, splits = p.m.shape
    head_dim = p.acc.shape[3]
    return (
        batch == 1
        and p.l.shape == p.m.shape
        and p.acc.shape == (1, heads, splits, head_dim)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (p.m, p.l, p.acc))
        and p.dtype == x.dtype
        and heads * head_dim == w.o.shape[1]
        and head_dim & (head_dim - 1) == 0
        and splits <= MAX_SPLITS
    )


def block(
    attn: torch.Tensor | Partials,
    x: torch.Tensor,
    w: BlockWeights,
    programs: int | None = None,
    warps: int = 8,
    preload: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`block_reference` in one launch (`supported` inputs; Partials that `takes`): -> (x', h', qkv' or
    None). `programs` overrides the grid (benchmarks); at most the SM count, so that every program is
    resident. `preload=False` (benchmarks, tests) takes the looping path even where one round of tiles would
    do: each phase loads its weight tiles after its barrier."""
    if isinstance(attn, Partials) and not takes(attn, x, w):  # merged by its own launch first
        attn = merge(attn).reshape(attn.m.shape[0], -1)
    partials = attn if isinstance(attn, Partials) else None
    if partials is not None:
        if not supported(x, w):  # partials that `takes` refuses were merged above
            raise ValueError(f"block kernel: partials m {tuple(partials.m.shape)}, acc {tuple(partials.acc.shape)}")
        heads, splits, head_dim = partials.m.shape[1], partials.num_splits, partials.acc.shape[3]
        attn_t = x  # not read
    else:
        assert isinstance(attn, torch.Tensor)
        attn = attn.reshape(1, -1).contiguous() if attn.dim() == 3 else attn.contiguous()
        if not supported(x, w) or attn.shape != (1, w.o.shape[1]) or attn.dtype != x.dtype:
            raise ValueError(f"block kernel: attn {tuple(attn.shape)} {attn.dtype}, x {tuple(x.shape)} {x.dtype}")
        heads, splits, head_dim = 1, 1, 1
        attn_t = attn
    device = x.device
    hidden, q_dim, inter = x.shape[1], w.o.shape[1], w.down.shape[1]
    n_qkv = w.qkv.shape[0] if w.qkv is not None else 0
    bar = arrivals.counters(device, COUNTERS)  # the stream's, or this captured launch's own
    if bar is None:
        raise RuntimeError("block kernel: no barrier counters (first made inside a graph capture, or all taken)")
    limit = _programs(device)
    grid = 1 if INTERPRETED else min(programs or limit, limit)
    # the smallest tiles that still give each program work, so every phase spreads over the grid
    bn_o = _tile(hidden, max(grid // heads, 1))  # PARTIALS: `heads` tiles of rows per row range
    bn_gu, bn_d, bn_qkv = _tile(inter, grid), _tile(hidden, grid), _tile(max(n_qkv, 1), grid)
    tiles = [heads * triton.cdiv(hidden, bn_o)]
    tiles += [triton.cdiv(n, bn) for n, bn in ((inter, bn_gu), (hidden, bn_d), (n_qkv, bn_qkv))]
    one_round = preload and not INTERPRETED and max(tiles) <= grid
    scratch = torch.empty(2 * hidden + inter, dtype=x.dtype, device=device)
    o, g, d = scratch.split([hidden, inter, hidden])
    o32 = torch.empty(heads, hidden, dtype=torch.float32, device=device) if partials is not None else o
    x_out, h_out = torch.empty_like(x), torch.empty_like(x)
    qkv = torch.empty(1, n_qkv, dtype=x.dtype, device=device) if w.qkv is not None else None
    post = w.post_attn is not None
    pm, pl, pacc = (partials.m, partials.l, partials.acc) if partials is not None else (o32, o32, o32)
    _block_kernel[(grid,)](
        attn_t, x, w.o, w.post_attn if post else w.pre_ffn, w.pre_ffn, w.gate_up, w.down,
        w.post_ffn if post else w.pre_ffn, w.next_norm, w.qkv if w.qkv is not None else w.o,
        w.qkv_bias if w.qkv_bias is not None else x, o, g, d, x_out, h_out, qkv if qkv is not None else x_out, bar,
        pm, pl, pacc, o32, w.eps, splits, hidden, q_dim, inter, n_qkv,
        GEMMA=w.gemma, POST_NORMS=post, ACT=ACTIVATIONS[w.act], HAS_QKV=w.qkv is not None,
        HAS_QKV_BIAS=w.qkv_bias is not None, BLOCK_H=triton.next_power_of_2(hidden),
        BLOCK_Q=triton.next_power_of_2(q_dim), BLOCK_I=triton.next_power_of_2(inter), BN_O=bn_o, BN_GU=bn_gu,
        BN_D=bn_d, BN_QKV=bn_qkv, NPROG=grid, ONE_ROUND=one_round, PARTIALS=partials is not None, HEADS=heads,
        HEAD_D=head_dim, BLOCK_S=triton.next_power_of_2(splits), num_warps=warps, **pdl.launch_args(device),
    )  # fmt: skip
    return x_out, h_out, qkv
