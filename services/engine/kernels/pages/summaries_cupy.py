"""CuPy RawKernels for page summaries and page scoring: the kernel set of CUDA cards below sm_80.

The same two operations as summaries_triton.py, against the same torch references
(services/engine/ring/summaries.py: `summary_update_reference`, `page_scores_reference`):

- summary update: one block per (page, KV head, 256 dims), one thread per dimension walks the
  page's rows (gathered from the source at `rows`, or consecutive) keeping min/max/sum of the
  valid tokens in registers; keys are fp32 or bf16 (bf16 widened from its bits: no header needed);
- scoring, two passes, rows r = token * Hq + head: pass 1, grid (rows, page blocks of 32), each
  warp computes the scaled Quest bound of 8 pages (lanes split head_dim, shuffle reduction) and keeps
  an online max / sum of exponentials, merged per block into [rows, page blocks] statistics; pass 2,
  grid (row chunks of 64, page blocks), merges a row's statistics into its softmax normaliser and
  adds each page's probability over the chunk's rows into [row chunks, Np], summed by torch.

Tensors cross to CuPy through DLPack on torch's current stream; no [T, Hq, Np] tensor is stored.
"""

from __future__ import annotations

import functools
import logging

import cupy
import numpy as np
import torch

logger = logging.getLogger(__name__)

PAGES_PER_BLOCK = 32  # 4 warps x 8 pages (scoring)
ROWS_PER_BLOCK = 64  # (token, head) rows per pass-2 block
MAX_HEAD_DIM = 1024  # the query row lives in shared memory
UPDATE_THREADS = 256

_SOURCE = r"""
#define NEG_INF __uint_as_float(0xff800000u)
#define POS_INF __uint_as_float(0x7f800000u)
#define PAGES_PER_WARP 8
#define WARPS 4
#define MAX_HEAD_DIM 1024

__device__ __forceinline__ float load_key(const float* p) { return *p; }
__device__ __forceinline__ float load_key(const short* p) {
    return __int_as_float(((int)(unsigned short)(*p)) << 16);  // bf16 bits -> fp32
}

template <typename T>
__device__ __forceinline__ void summary_update(
    const T* src, const long long* rows, const unsigned char* valid, const long long* page_ids,
    float* kmin, float* kmax, float* kmean, long long stride_src_row, long long stride_src_head,
    long long stride_tab_page, long long stride_tab_head, int page_size, int head_dim, int has_rows)
{
    const int page = blockIdx.x, head = blockIdx.y;
    const int d = blockIdx.z * blockDim.x + threadIdx.x;
    if (d >= head_dim) return;
    float lo = POS_INF, hi = NEG_INF, total = 0.0f;
    int count = 0;
    for (int t = 0; t < page_size; ++t) {
        const long long flat = (long long)page * page_size + t;
        if (!valid[flat]) continue;
        const long long row = has_rows ? rows[flat] : flat;
        const float x = load_key(src + row * stride_src_row + head * stride_src_head + d);
        lo = fminf(lo, x);
        hi = fmaxf(hi, x);
        total += x;
        ++count;
    }
    const long long dst = page_ids[page] * stride_tab_page + head * stride_tab_head + d;
    kmin[dst] = lo;
    kmax[dst] = hi;
    kmean[dst] = total / (float)(count > 0 ? count : 1);
}

extern "C" __global__ void summary_update_f32(
    const float* src, const long long* rows, const unsigned char* valid, const long long* page_ids,
    float* kmin, float* kmax, float* kmean, long long stride_src_row, long long stride_src_head,
    long long stride_tab_page, long long stride_tab_head, int page_size, int head_dim, int has_rows)
{
    summary_update<float>(src, rows, valid, page_ids, kmin, kmax, kmean, stride_src_row, stride_src_head,
                          stride_tab_page, stride_tab_head, page_size, head_dim, has_rows);
}

extern "C" __global__ void summary_update_bf16(
    const short* src, const long long* rows, const unsigned char* valid, const long long* page_ids,
    float* kmin, float* kmax, float* kmean, long long stride_src_row, long long stride_src_head,
    long long stride_tab_page, long long stride_tab_head, int page_size, int head_dim, int has_rows)
{
    summary_update<short>(src, rows, valid, page_ids, kmin, kmax, kmean, stride_src_row, stride_src_head,
                          stride_tab_page, stride_tab_head, page_size, head_dim, has_rows);
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Quest bound of the query row in shared memory against page p of kv head kvh (all lanes get it).
__device__ __forceinline__ float page_bound(
    const float* qs, const float* kmin, const float* kmax, long long p, int kvh,
    long long stride_kp, long long stride_kh, int head_dim, int lane)
{
    const float* lo = kmin + p * stride_kp + kvh * stride_kh;
    const float* hi = kmax + p * stride_kp + kvh * stride_kh;
    float acc = 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
        const float q = qs[d];
        acc = fmaf(q, q > 0.0f ? hi[d] : lo[d], acc);
    }
    return warp_sum(acc);
}

__device__ __forceinline__ void load_query(
    float* qs, const float* q, long long r, int num_heads, long long stride_qt, long long stride_qh, int head_dim)
{
    const long long t = r / num_heads;
    const int h = (int)(r % num_heads);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) qs[d] = q[t * stride_qt + h * stride_qh + d];
}

// grid (rows, page blocks), 128 threads: per row and page block, max and sum of exp(scaled bound - max)
extern "C" __global__ void score_stats(
    const float* q, const float* kmin, const float* kmax, float* m_out, float* l_out,
    int num_heads, int group, int num_pages, int num_page_blocks, float scale,
    long long stride_qt, long long stride_qh, long long stride_kp, long long stride_kh, int head_dim)
{
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float warp_m[WARPS], warp_l[WARPS];
    const long long r = blockIdx.x;
    const int pb = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kvh = (int)(r % num_heads) / group;
    load_query(qs, q, r, num_heads, stride_qt, stride_qh, head_dim);
    __syncthreads();
    float m = NEG_INF, l = 0.0f;
    for (int k = 0; k < PAGES_PER_WARP; ++k) {
        const long long p = (long long)pb * (WARPS * PAGES_PER_WARP) + warp * PAGES_PER_WARP + k;
        if (p >= num_pages) break;
        const float s = page_bound(qs, kmin, kmax, p, kvh, stride_kp, stride_kh, head_dim, lane) * scale;
        const float m_new = fmaxf(m, s);
        l = l * expf(m - m_new) + expf(s - m_new);
        m = m_new;
    }
    if (lane == 0) { warp_m[warp] = m; warp_l[warp] = l; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float bm = NEG_INF, bl = 0.0f;
        for (int w = 0; w < WARPS; ++w) bm = fmaxf(bm, warp_m[w]);
        for (int w = 0; w < WARPS; ++w) if (warp_l[w] > 0.0f) bl += warp_l[w] * expf(warp_m[w] - bm);
        m_out[r * num_page_blocks + pb] = bm;
        l_out[r * num_page_blocks + pb] = bl;
    }
}

// grid (row chunks, page blocks), 128 threads: partial[chunk, p] = sum over the chunk's rows of softmax prob
extern "C" __global__ void score_mass(
    const float* q, const float* kmin, const float* kmax, const float* m_in, const float* l_in, float* partial,
    long long num_rows, int rows_per_block, int num_heads, int group, int num_pages, int num_page_blocks,
    float scale, long long stride_qt, long long stride_qh, long long stride_kp, long long stride_kh, int head_dim)
{
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float row_stat[2];
    const int pb = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const long long first = (long long)blockIdx.x * rows_per_block;
    const long long last = first + rows_per_block < num_rows ? first + rows_per_block : num_rows;
    const long long page0 = (long long)pb * (WARPS * PAGES_PER_WARP) + warp * PAGES_PER_WARP;
    float acc[PAGES_PER_WARP];
#pragma unroll
    for (int k = 0; k < PAGES_PER_WARP; ++k) acc[k] = 0.0f;
    for (long long r = first; r < last; ++r) {
        __syncthreads();  // the previous row is done with qs and row_stat
        load_query(qs, q, r, num_heads, stride_qt, stride_qh, head_dim);
        if (warp == 0) {
            const float* rm = m_in + r * num_page_blocks;
            const float* rl = l_in + r * num_page_blocks;
            float mx = NEG_INF;
            for (int b = lane; b < num_page_blocks; b += 32) mx = fmaxf(mx, rm[b]);
            mx = warp_max(mx);
            float sum = 0.0f;
            for (int b = lane; b < num_page_blocks; b += 32) if (rl[b] > 0.0f) sum += rl[b] * expf(rm[b] - mx);
            sum = warp_sum(sum);
            if (lane == 0) { row_stat[0] = mx; row_stat[1] = sum; }
        }
        __syncthreads();
        const float row_max = row_stat[0], row_sum = row_stat[1];
        const int kvh = (int)(r % num_heads) / group;
#pragma unroll
        for (int k = 0; k < PAGES_PER_WARP; ++k) {
            if (page0 + k < num_pages) {
                const float s = page_bound(qs, kmin, kmax, page0 + k, kvh, stride_kp, stride_kh, head_dim, lane);
                acc[k] += expf(s * scale - row_max) / row_sum;
            }
        }
    }
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < PAGES_PER_WARP; ++k)
            if (page0 + k < num_pages) partial[(long long)blockIdx.x * num_pages + page0 + k] = acc[k];
    }
}
"""


@functools.cache
def _module(device_index: int) -> cupy.RawModule:
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=_SOURCE, options=("--std=c++14",))
        module.compile()
    logger.info("compiled the CuPy summary kernels for cuda:%d", device_index)
    return module


def _cp(t: torch.Tensor) -> cupy.ndarray:
    """A CuPy view of a CUDA tensor (bool as uint8, bf16 as int16: DLPack-safe dtypes)."""
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    elif t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def _launch(device: torch.device, name: str, grid: tuple[int, ...], block: int, args: tuple[object, ...]) -> None:
    """Run kernel `name` on torch's current stream; tensors in `args` become CuPy views there (DLPack on
    the same stream: no cross-stream wait, so the launch can sit inside a CUDA graph capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _module(index).get_function(name)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream):
        kernel(grid, (block,), tuple(_cp(a) if isinstance(a, torch.Tensor) else a for a in args))


def summary_update(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    kmean: torch.Tensor,
    page_ids: torch.Tensor,
    src: torch.Tensor,
    valid: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> None:
    """Write min/max/mean of pages into one layer's tables (same contract as summaries_triton).

    kmin, kmax, kmean: [max_pages, Hkv, D] fp32 (contiguous in D); page_ids: [P]; valid: [P, page_size]
    bool; src: [R, Hkv, D] keys read at `rows` [P * page_size], or rows 0..P*page_size-1 when None.
    fp32 and bf16 keys are read as they are; other dtypes are converted to fp32 first (a copy).
    """
    num_pages, page_size = valid.shape
    if num_pages == 0:
        return
    _, num_kv_heads, head_dim = src.shape
    assert kmin.stride(2) == 1 and kmin.stride() == kmax.stride() == kmean.stride()
    assert kmin.shape[1:] == (num_kv_heads, head_dim), (kmin.shape, src.shape)
    if src.dtype not in (torch.float32, torch.bfloat16):
        src = src.float()
    if src.stride(2) != 1:
        src = src.contiguous()
    page_ids = page_ids.to(torch.int64).contiguous()
    if rows is None:
        assert src.shape[0] >= num_pages * page_size, (src.shape, valid.shape)
        rows_arg = page_ids  # unused by the kernel
    else:
        assert rows.numel() == num_pages * page_size, (rows.shape, valid.shape)
        rows_arg = rows.reshape(-1).to(torch.int64).contiguous()
    threads = min(UPDATE_THREADS, (head_dim + 31) // 32 * 32)
    grid = (num_pages, num_kv_heads, (head_dim + threads - 1) // threads)
    name = "summary_update_f32" if src.dtype == torch.float32 else "summary_update_bf16"
    args = (
        src, rows_arg, valid.contiguous(), page_ids, kmin, kmax, kmean,
        np.int64(src.stride(0)), np.int64(src.stride(1)), np.int64(kmin.stride(0)), np.int64(kmin.stride(1)),
        np.int32(page_size), np.int32(head_dim), np.int32(rows is not None),
    )  # fmt: skip
    _launch(src.device, name, grid, threads, args)


def page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, scale: float) -> torch.Tensor:
    """Unit mass per (query token, head) spread over pages and summed.

    q: [T, Hq, D] (converted to fp32); kmin, kmax: [Np, Hkv, D] fp32 -> [Np] fp32 (sums to T * Hq).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_pages, num_kv_heads = kmin.shape[0], kmin.shape[1]
    assert num_heads % num_kv_heads == 0 and kmin.shape == kmax.shape and kmin.shape[2] == head_dim
    assert head_dim <= MAX_HEAD_DIM, f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    if num_pages == 0 or num_tokens == 0:
        return torch.zeros(num_pages, dtype=torch.float32, device=q.device)
    q = q.float().contiguous()
    kmin, kmax = kmin.float().contiguous(), kmax.float().contiguous()
    group = num_heads // num_kv_heads
    num_rows = num_tokens * num_heads
    page_blocks = (num_pages + PAGES_PER_BLOCK - 1) // PAGES_PER_BLOCK
    row_chunks = (num_rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    stats = torch.empty((2, num_rows, page_blocks), dtype=torch.float32, device=q.device)
    partial = torch.empty((row_chunks, num_pages), dtype=torch.float32, device=q.device)
    strides = (np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(kmin.stride(0)), np.int64(kmin.stride(1)))
    shape = (np.int32(num_heads), np.int32(group), np.int32(num_pages), np.int32(page_blocks), np.float32(scale))
    m, sums = stats[0], stats[1]
    _launch(q.device, "score_stats", (num_rows, page_blocks), 128, (q, kmin, kmax, m, sums, *shape, *strides,
                                                                    np.int32(head_dim)))  # fmt: skip
    _launch(q.device, "score_mass", (row_chunks, page_blocks), 128, (
        q, kmin, kmax, m, sums, partial, np.int64(num_rows), np.int32(ROWS_PER_BLOCK), *shape, *strides,
        np.int32(head_dim),
    ))  # fmt: skip
    return partial.sum(dim=0) if row_chunks > 1 else partial[0]
