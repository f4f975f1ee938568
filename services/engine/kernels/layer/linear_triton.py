"""Decode-sized projections (Triton): y = x @ W^T (+ b) for a few rows of x, read once from HBM.

A decode step multiplies 1..64 rows by every weight matrix of the model. For such skinny products the
cuBLAS kernels torch picks on an H200 take 4-5 us for a 640 x 4096 bf16 matrix (about 1 TB/s of
weight reads: launch and tail dominate). This kernel gives each program BLOCK_N output columns and
walks K in BLOCK_K steps (software-pipelined loads, `num_stages`), all M rows at once with one
tl.dot per step (rows padded to 16, 32 or 64: `block_rows`; fp32 accumulation): every weight byte is read
exactly once, by as many programs as the columns allow. At 32 rows cuBLAS splits K over a second
reduction launch (a batch-32 decode step of the 8B shape); here the rows only widen the tile, and the
stages in flight shrink to fit shared memory (`stages_for`).

Two variants share the kernel:
- split-K: a long K over few column blocks (the down projection, 640 x 2048: 20 blocks of 32 columns
  for a 132-SM device) also splits K over SPLIT_K programs; each stores its fp32 partial and the last of
  a column block to finish (kernels/layer/arrivals.py) sums them and writes the output, in the same launch.
- gated (`linear_gated`): a gated MLP's fused [gate | up] weight [2I, K] -> act(x W_gate^T) * (x W_up^T)
  [M, I], each program reading its columns' gate and up rows: the activation and the product are the
  projection's epilogue instead of a launch of their own. (Computing them inside the down projection's
  loads instead was measured 5x slower on the H200: 40 vs 8 us a layer.)

The configuration (`config`) is a function of (N, K) only, so a CUDA graph captures the launch and a
new batch size compiles nothing (M is a runtime int). The torch references are `linear_reference`
(F.linear) and `linear_gated_reference`; `supported` says which calls take the kernel (the caller keeps
torch otherwise).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels import pdl
from services.engine.kernels.layer import arrivals
from services.engine.kernels.layer.norm_triton import gelu_tanh

MAX_ROWS = 64  # rows of x the kernel takes: decode batches (`routes` says which the engine sends it)
ROWS_ENV = "KVMEM_LINEAR_ROWS"  # the most rows the engine's projections send here (`routes`); more: cuBLAS
DEFAULT_ROUTED_ROWS = 64
SMEM_BUDGET = 220 * 1024  # bytes of shared memory the pipelined tiles may take (the H100/H200 allow 227 KiB)
MAX_COLS = 65_536  # larger outputs (a vocabulary head) stay on cuBLAS, which streams them at full bandwidth
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = {"gelu_tanh": 1, "silu": 2}  # the gated epilogue's activations (ACT constexpr)
SPLIT_MIN_K = 2048  # split K from this length (when the columns give few programs)
SPLIT_ROWS = 256  # K per split program
MAX_SPLIT_K = 8


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias [N] (+ residual [M, N], summed before the rounding) -> [M, N] in x's
    dtype."""
    if residual is None:
        return F.linear(x, weight, bias)
    return (residual.float() + F.linear(x.float(), weight.float(), bias.float() if bias is not None else None)).to(
        x.dtype
    )


def linear_gated_reference(x: torch.Tensor, weight: torch.Tensor, activation: str) -> torch.Tensor:
    """x [M, K], weight [2I, K] = [gate | up] -> act(gate) * up [M, I] in x's dtype, rounded as the
    unfused torch code rounds (the projection, then the activation, then the product)."""
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    act = F.gelu(gate, approximate="tanh") if activation == "gelu_tanh" else F.silu(gate)
    return act * up


@functools.cache
def routed_rows() -> int:
    """The most rows the engine's projections give this kernel (env KVMEM_LINEAR_ROWS, 1..MAX_ROWS; default
    DEFAULT_ROUTED_ROWS): an A/B switch for the batch sizes where cuBLAS and this kernel are close."""
    raw = os.environ.get(ROWS_ENV, "")
    rows = int(raw) if raw.strip() else DEFAULT_ROUTED_ROWS
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"{ROWS_ENV}={raw!r}: expected 1..{MAX_ROWS}")
    return rows


def routes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """`supported`, and x has at most `routed_rows` rows: the engine's projections take the kernel."""
    return supported(x, weight) and x.shape[0] <= routed_rows()


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A decode-sized x (2-D, at most MAX_ROWS rows, unit stride along K) times a contiguous weight of
    the same float dtype, at most MAX_COLS outputs."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[0] <= MAX_COLS
        and weight.shape[1] == x.shape[1]
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
    )


def config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) for an [N, K] weight, from sweeps on the H200 at
    Gemma 3 270M's four projections (bench/kernel_sweep.py, bench/RESULTS.md). Columns per program are
    halved down to 16 until there are ~128 programs; few programs take long K steps, and a long K more
    stages in flight. A long K over few columns (K >= SPLIT_MIN_K, under 64 blocks of 32: the down
    projection, 640 x 2048) is split over programs of SPLIT_ROWS each: 5.6 -> 4.8 us a layer; a split
    measured slower at K 1024 (o: 3.3 -> 4.2 us) and at K 640."""
    if k >= SPLIT_MIN_K and triton.cdiv(n, 32) < 64:
        return 32, 128, 4, 4, min(MAX_SPLIT_K, k // SPLIT_ROWS)
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 128:
        block_n //= 2
    block_k = 256 if triton.cdiv(n, block_n) < 64 else 128
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    return block_n, block_k, 4, 6 if k >= 2048 else 4, 1


def block_rows(m: int) -> int:
    """The tile's rows for m rows of x: 16 (tl.dot's minimum), 32 or 64."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def stages_for(stages: int, block_m: int, block_n: int, block_k: int, gated: bool, itemsize: int) -> int:
    """`stages` cut to what fits SMEM_BUDGET: a stage holds the x tile and one (two, gated) weight tiles."""
    per_stage = (block_m + block_n * (2 if gated else 1)) * block_k * itemsize
    return max(2, min(stages, SMEM_BUDGET // per_stage))


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] contiguous ([2N, K] = [gate | up] when ACT)
    b_ptr,  # [N] (HAS_BIAS only)
    r_ptr,  # [M, N] the residual added in the epilogue (HAS_RESIDUAL only; out_ptr may be it: in place)
    out_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, M, N] fp32 partials (SPLIT_K > 1 only)
    cnt_ptr,  # [>= column blocks] int32 arrival counters, zero between launches (SPLIT_K > 1 only)
    m,
    n_cols,
    k_dim,
    k_split,  # K per split program, a multiple of BLOCK_K (specialised: a function of (N, K))
    stride_xm,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ACT: tl.constexpr,  # 0: plain; ACTIVATIONS: act(gate) * up
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    K_LOOP: tl.constexpr,  # k_split, interpreted only (0 when compiled)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
):
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < n_cols
    row_ok = rows < m
    k_start = tl.multiple_of(tl.program_id(1) * k_split, BLOCK_K)  # aligned K steps: vectorised weight loads
    pdl.start(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_LOOP if INTERPRETED else k_split, BLOCK_K):
        kk = k_start + k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_dim
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k_dim + kk[None, :], mask=w_mask, other=0.0)
        acc = _dot(x, w, acc, DOT_FP32)
        if ACT != 0:
            wu = tl.load(w_ptr + (cols[:, None] + n_cols).to(tl.int64) * k_dim + kk[None, :], mask=w_mask, other=0.0)
            acc_up = _dot(x, wu, acc_up, DOT_FP32)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, b_ptr, r_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_rm, stride_om, HAS_BIAS,
                  HAS_RESIDUAL, ACT)  # fmt: skip
    else:
        tile = rows[:, None] * n_cols + cols[None, :]
        tl.store(part_ptr + tl.program_id(1) * m * n_cols + tile, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the count (release below)
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:  # the last split of this column block: every partial is visible
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * m * n_cols + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            _epilogue(total, acc_up, b_ptr, r_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_rm, stride_om,
                      HAS_BIAS, HAS_RESIDUAL, ACT)  # fmt: skip
            tl.store(cnt_ptr + pid_n, 0)  # zero again for the next launch (its end makes the store visible)


@triton.jit
def _dot(x, w, acc, DOT_FP32: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T in fp32."""
    if DOT_FP32:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def _epilogue(acc, acc_up, b_ptr, r_ptr, out_ptr, rows, cols, col_ok, out_mask, stride_rm, stride_om,
              HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ACT: tl.constexpr):  # fmt: skip
    """The output tile: acc (+ bias) (+ residual, rounded once), or act(gate) * up rounded where the unfused
    torch code rounds (the projection, the activation, the product)."""
    out_ty = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=out_mask, other=0.0).to(tl.float32)
    if ACT != 0:
        acc = act_mul(acc, acc_up, out_ty, ACT)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ty), mask=out_mask)


@triton.jit
def act_mul(gate, up, out_ty: tl.constexpr, ACT: tl.constexpr):
    """act(gate) * up (fp32 in and out) rounded to out_ty where the unfused torch code rounds: the
    projections, the activation (ACTIVATIONS) and, by the caller, the product."""
    g = gate.to(out_ty).to(tl.float32)
    if ACT == 1:
        a = gelu_tanh(g)
    else:
        a = g * tl.sigmoid(g)
    return a.to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)


# as in kernels/attention/decode_attention_triton.py: interpreted, the loop bound is a constexpr
# (triton-lang/triton#9171) and the dots are fp32 (the interpreter multiplies bf16 operands as raw bits)
INTERPRETED = isinstance(_linear_kernel, InterpretedFunction)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: tuple[int, int, int, int, int] | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear_reference` in one launch -> [M, N] in x's dtype; `cfg` overrides `config` (benchmarks).
    `residual` [M, N] (x's dtype, unit stride along N): the result is residual + x @ W^T (+ b), summed in fp32
    and rounded once, written over the residual (returned): the sum after a layer's o or down projection
    without an add launch of its own."""
    if not supported(x, weight):
        raise ValueError(f"linear kernel: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (
        residual.dim() != 2
        or residual.shape != (x.shape[0], weight.shape[0])
        or residual.dtype != x.dtype
        or residual.stride(1) != 1
    ):
        raise ValueError(f"linear kernel: residual {tuple(residual.shape)} {residual.dtype} for x {tuple(x.shape)}")
    return _launch(x, weight, bias, weight.shape[0], 0, cfg or config(weight.shape[0], x.shape[1]), residual)


def linear_gated(
    x: torch.Tensor, weight: torch.Tensor, activation: str, cfg: tuple[int, int, int, int, int] | None = None
) -> torch.Tensor:
    """`linear_gated_reference` in one launch: x [M, K], weight [2I, K] = [gate | up] -> [M, I]; activation
    one of ACTIVATIONS. Never split over K (the gate and up halves already give the grid 2I / 16 columns)."""
    if not supported(x, weight) or weight.shape[0] % 2 or activation not in ACTIVATIONS:
        raise ValueError(f"gated linear kernel: x {tuple(x.shape)}, weight {tuple(weight.shape)}, {activation!r}")
    inter = weight.shape[0] // 2
    block_n, block_k, warps, stages, _ = cfg or config(inter, x.shape[1])
    return _launch(x, weight, None, inter, ACTIVATIONS[activation], (block_n, block_k, warps, stages, 1))


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    n_cols: int,
    act: int,
    cfg: tuple[int, int, int, int, int],
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    m, k_dim = x.shape
    block_n, block_k, warps, stages, split_k = cfg
    block_m = block_rows(m)
    stages = stages_for(stages, block_m, block_n, block_k, act != 0, x.element_size())
    blocks = triton.cdiv(n_cols, block_n)
    counts = arrivals.counters(x.device, blocks) if split_k > 1 else None
    if counts is None:  # no counters (kernels/layer/arrivals.py: none now): one program per column block
        split_k = 1
    k_split = triton.cdiv(triton.cdiv(k_dim, split_k), block_k) * block_k
    split_k = triton.cdiv(k_dim, k_split)
    out = residual if residual is not None else torch.empty(m, n_cols, dtype=x.dtype, device=x.device)
    part = torch.empty(split_k, m, n_cols, dtype=torch.float32, device=x.device) if split_k > 1 else out
    _linear_kernel[(blocks, split_k)](
        x, weight, bias if bias is not None else out, out, out, part, counts if counts is not None else out,
        m, n_cols, k_dim, k_split, x.stride(0), out.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, ACT=act, SPLIT_K=split_k, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=x.dtype == torch.float32 or INTERPRETED, INTERPRETED=INTERPRETED,
        K_LOOP=k_split if INTERPRETED else 0, num_warps=warps, num_stages=stages,
        **pdl.launch_args(x.device),
    )  # fmt: skip
    return out
