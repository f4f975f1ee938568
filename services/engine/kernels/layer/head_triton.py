"""The vocabulary head of a one-row step (Triton): fp32 logits and, in the same launch, their argmax.

A batch-1 decode step ends with the vocabulary head (Gemma 3 270M: 262,144 x 640 bf16, 335 MB, the
largest read of the step), then a cast of its output to fp32 and an argmax over the vocabulary: three
launches, 94 us on the H200 of which cuBLAS's product is 80 (bench/RESULTS.md, run 20). Here each program
takes BLOCK_V rows of the weight, computes their logits in fp32 (rounded to the weight's dtype first, as
the cuBLAS output the model's torch code casts), stores them in fp32, and for the argmax also its rows' maximum
and the first row that reaches it; the last program to finish (an arrival counter, kernels/layer/arrivals.py)
reduces those partials to the step's token. Programs take tiles in row order, so the first maximal row
wins as in torch.argmax; a NaN logit counts as larger than every number (torch.argmax's rule too).

The torch references are `head_reference` (F.linear, then the cast: the models' `logits`) and
torch.argmax. Logits agree with cuBLAS's to the weight dtype's rounding (the summation order differs: one
bf16 unit in the last place for ~0.03% of a random 262K head), so every path of a process that can take
this kernel takes it (the models' `vocab_head`), eager steps and captured ones alike.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.engine.kernels import pdl
from services.engine.kernels.layer import arrivals

logger = logging.getLogger(__name__)

BLOCK_V = 64  # weight rows a program (the fastest of 16 tile shapes on the H200: bench/RESULTS.md, run 20)
BLOCK_K = 64  # hidden size a load
WARPS = 4
MAX_TILES = 1 << 16  # partials the last program reduces in one pass (a 4M-row vocabulary)
_NO_ROW: tl.constexpr = tl.constexpr(2**31 - 1)  # no row: larger than every row index


def head_reference(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [M, H] @ weight [V, H]^T -> fp32 logits [M, V], rounded to h's dtype first (the models' `logits`)."""
    return F.linear(h, weight).float()


def supported(h: torch.Tensor, weight: torch.Tensor) -> bool:
    """One contiguous row h [1, H] and a contiguous weight [V, H] of the same float dtype, V at most
    BLOCK_V * MAX_TILES rows (config's BLOCK_V)."""
    return (
        h.dim() == 2
        and h.shape[0] == 1
        and weight.dim() == 2
        and h.shape[1] == weight.shape[1]
        and h.is_contiguous()
        and weight.is_contiguous()
        and h.dtype == weight.dtype
        and h.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and 0 < weight.shape[0] <= config(weight.shape[1])[0] * MAX_TILES
    )


@functools.cache
def enabled() -> bool:
    """Whether the models take this kernel where it is `supported`: not with KVMEM_HEAD_KERNEL=0 (cuBLAS,
    the cast and torch.argmax: A/B runs)."""
    on = os.environ.get("KVMEM_HEAD_KERNEL", "1") != "0"
    logger.info("vocabulary head kernel: %s", "on" if on else "off (KVMEM_HEAD_KERNEL=0)")
    return on


@triton.jit
def _tile_dot(h_ptr, w_ptr, rows, row_ok, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr):  # type: ignore[no-untyped-def]
    """sum over ks in [k0, k0 + BLOCK_K) of w[rows, ks] * h[ks] in fp32 -> [BLOCK_V]."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < HIDDEN
    x = tl.load(h_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    w = tl.load(
        w_ptr + rows[:, None].to(tl.int64) * HIDDEN + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
    )
    return tl.sum(w.to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _head_kernel(
    h_ptr, w_ptr, logits_ptr, pmax_ptr, prow_ptr, count_ptr, token_ptr, vocab,
    HIDDEN: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, TILES: tl.constexpr,
    BLOCK_T: tl.constexpr, ARGMAX: tl.constexpr, LOOP_STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program `pid`: rows pid*BLOCK_V.. of the logits; with ARGMAX its partial (maximum, first row reaching
    it; a NaN tile: NaN and its first NaN row), and the last program to arrive writes the token. LOOP_STAGES 0:
    the hidden loop unrolled; else a loop software-pipelined that many stages deep (a long hidden)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < vocab
    pdl.start(PDL)
    acc = tl.zeros([BLOCK_V], tl.float32)
    if LOOP_STAGES == 0:
        for k0 in tl.static_range(0, HIDDEN, BLOCK_K):
            acc += _tile_dot(h_ptr, w_ptr, rows, row_ok, k0, HIDDEN, BLOCK_K)
    else:
        for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=LOOP_STAGES):
            acc += _tile_dot(h_ptr, w_ptr, rows, row_ok, k0, HIDDEN, BLOCK_K)
    y = acc.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the product's output, then cast
    tl.store(logits_ptr + rows, y, mask=row_ok)
    if ARGMAX:
        is_nan = (y != y) & row_ok
        first_nan = tl.min(tl.where(is_nan, rows, _NO_ROW), axis=0)
        key = tl.where(row_ok & ~is_nan, y, float("-inf"))
        top = tl.max(key, axis=0)
        first = tl.min(tl.where(row_ok & (key == top), rows, _NO_ROW), axis=0)
        has_nan = first_nan < _NO_ROW
        tl.store(pmax_ptr + pid, tl.where(has_nan, float("nan"), top))
        tl.store(prow_ptr + pid, tl.where(has_nan, first_nan, first))
        tl.debug_barrier()  # every thread's stores before the count: released to the last program's acquire
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if arrived == TILES - 1:
            t = tl.arange(0, BLOCK_T)
            t_ok = t < TILES
            pm = tl.load(pmax_ptr + t, mask=t_ok, other=float("-inf"), cache_modifier=".cg")
            pr = tl.load(prow_ptr + t, mask=t_ok, other=_NO_ROW, cache_modifier=".cg")
            nan_t = (pm != pm) & t_ok
            nan_row = tl.min(tl.where(nan_t, pr, _NO_ROW), axis=0)
            key_t = tl.where(t_ok & ~nan_t, pm, float("-inf"))
            best = tl.max(key_t, axis=0)
            row = tl.min(tl.where(t_ok & ~nan_t & (key_t == best), pr, _NO_ROW), axis=0)
            tl.store(token_ptr, tl.where(nan_row < _NO_ROW, nan_row, row).to(tl.int64))
            tl.store(count_ptr, 0)  # for the next launch (a graph replays this one as is)


LONG_HIDDEN = 2048  # a hidden size from which the head takes the pipelined loop (config)


def config(hidden: int) -> tuple[int, int, int, int]:
    """(BLOCK_V, BLOCK_K, num_warps, LOOP_STAGES) for a hidden size. Short (Gemma 3 270M's 640): 64 x 64 tiles,
    4 warps, the loop unrolled (the fastest of 16 shapes, run 20). Long (Llama-3.1-8B's 4096): 32 x 256 tiles in
    a loop pipelined 3 deep, measured on the H200 at 128,256 x 4096 (bench/scale_kernels.py --only head, RESULTS):
    240 us (4.38 TB/s) against 570 us unrolled 64 x 64 and cuBLAS + cast + argmax's 279; 64 x 128 / 3 stages
    247, 64 x 256 / 8 warps 247, 128 x 128 / 8 warps 248, 32 x 128 / 4 stages 263."""
    if hidden >= LONG_HIDDEN:
        return 32, 256, 4, 3
    return BLOCK_V, BLOCK_K, WARPS, 0


def head(
    h: torch.Tensor, weight: torch.Tensor, argmax: bool = False, cfg: tuple[int, int, int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_reference` for a `supported` row in one launch -> (logits [1, V] fp32, with `argmax` its
    torch.argmax [1] int64, else None). The argmax needs an arrival counter (kernels/layer/arrivals.py); where
    none is to be had (inside a capture before any was made) it is torch.argmax of the logits."""
    if not supported(h, weight):
        raise ValueError(f"head kernel: h {tuple(h.shape)} {h.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    vocab, hidden = weight.shape
    block_v, block_k, warps, loop_stages = cfg or config(hidden)
    tiles = triton.cdiv(vocab, block_v)
    device = h.device
    logits = torch.empty(1, vocab, dtype=torch.float32, device=device)
    count = arrivals.counters(device, 1) if argmax else None
    token = torch.empty(1, dtype=torch.int64, device=device) if count is not None else None
    partial_max = torch.empty(tiles if count is not None else 1, dtype=torch.float32, device=device)
    partial_row = torch.empty(tiles if count is not None else 1, dtype=torch.int32, device=device)
    _head_kernel[(tiles,)](
        h, weight, logits, partial_max, partial_row, count if count is not None else partial_row,
        token if token is not None else partial_row, vocab, HIDDEN=hidden, BLOCK_V=block_v, BLOCK_K=block_k,
        TILES=tiles, BLOCK_T=triton.next_power_of_2(tiles), ARGMAX=count is not None, LOOP_STAGES=loop_stages,
        num_warps=warps,
        **pdl.launch_args(device),
    )  # fmt: skip
    if argmax and token is None:
        token = torch.argmax(logits, dim=-1)
    return logits, token
