"""Decode-sized projections (Triton): y = x @ W^T (+ b) for a few rows of x, read once from HBM.

A decode step multiplies 1..16 rows by every weight matrix of the model. For such skinny products the
cuBLAS kernels torch picks on an H200 take 4-5 us for a 640 x 4096 bf16 matrix (about 1 TB/s of
weight reads: launch and tail dominate). This kernel gives each program BLOCK_N output columns and
walks K in BLOCK_K steps (software-pipelined loads, `num_stages`), all M rows at once with one
tl.dot per step (rows padded to 16, fp32 accumulation): every weight byte is read exactly once, by
as many programs as the columns allow. (Computing a gated MLP's GELU(gate) * up inside the down
projection's loads instead of a separate launch was measured 5x slower on the H200: 40 vs 8 us a layer.)

The configuration (`config`) is a function of (N, K) only, so a CUDA graph captures the launch and a
new batch size compiles nothing (M is a runtime int). The torch reference is `linear_reference`
(F.linear); `supported` says which calls take the kernel (the caller keeps torch otherwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

MAX_ROWS = 16  # rows of x the kernel takes (tl.dot's minimum M): decode batches
MAX_COLS = 65_536  # larger outputs (a vocabulary head) stay on cuBLAS, which streams them at full bandwidth
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias [N] -> [M, N] in x's dtype."""
    return F.linear(x, weight, bias)


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


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [N, K] weight: enough programs to spread the
    weight over the device's SMs (columns per program halved down to 16 until there are ~128); few
    programs take long K steps, and a long K more stages in flight. Chosen from a sweep of 108 configs on
    the H200 at Gemma 3 270M's four projections (bench/RESULTS.md): within 4% of the best config of each."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 128:
        block_n //= 2
    block_k = 256 if triton.cdiv(n, block_n) < 64 else 128
    block_k = min(block_k, max(32, triton.next_power_of_2(k)))
    return block_n, block_k, 4, 6 if k >= 2048 else 4


@triton.jit(do_not_specialize=["m"])
def _linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] contiguous
    b_ptr,  # [N] (HAS_BIAS only)
    out_ptr,  # [M, N]
    m,
    n_cols,
    k_dim,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    K_LOOP: tl.constexpr,  # k_dim, interpreted only (0 when compiled)
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < n_cols
    row_ok = rows < m
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_LOOP if INTERPRETED else k_dim, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k_dim
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * k_dim + kk[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    o_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# as in decode_attention_triton.py: interpreted, the loop bound is a constexpr (triton-lang/triton#9171)
# and the dots are fp32 (the interpreter multiplies bf16 operands as raw bits)
INTERPRETED = isinstance(_linear_kernel, InterpretedFunction)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    cfg: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """`linear_reference` in one launch -> [M, N] in x's dtype; `cfg` overrides `config` (benchmarks)."""
    if not supported(x, weight):
        raise ValueError(f"linear kernel: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    m, k_dim = x.shape
    n_cols = weight.shape[0]
    block_n, block_k, warps, stages = cfg or config(n_cols, k_dim)
    out = torch.empty(m, n_cols, dtype=x.dtype, device=x.device)
    _linear_kernel[(triton.cdiv(n_cols, block_n),)](
        x, weight, bias if bias is not None else out, out, m, n_cols, k_dim, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_FP32=x.dtype == torch.float32 or INTERPRETED, INTERPRETED=INTERPRETED, K_LOOP=k_dim if INTERPRETED else 0,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
