"""The tile step both Triton attention kernels share: K/V rows read from the pool in place, one online-softmax step.

`load_kv` reads the K and V rows `row` [BLOCK_N] of KV head `kv` from one pool layer [R, Hkv, D] (rows anywhere
in the pool: a page table expanded, or a local ring's arithmetic), masked or not; an fp8 layer (uint8 rows of
an fp32 scale and D e4m3fn codes, kv_formats.py) is read as its codes and per-row scales, dequantised inside
the dot products (no bf16 copy of the rows is made). `softmax_step` takes query
rows q [BLOCK_M, D] against one tile of keys (base-2 scores: the softmax scale times log2(e)), updates the
running max `m_i`, sum `l_i` and fp32 accumulator `acc`, and returns them. An unmasked tile (every key visible
to every row) scales the scores inside the exponent's argument (one fused multiply-add an element); a masked
one sets invisible scores to -inf first and keeps exp2 finite for a row that has seen nothing yet.
kernels/decode_attention_triton.py (one token per sequence, the G query heads of a KV head as rows) and
kernels/prefill_attention_triton.py (a prompt chunk's rows of one query head) call these; Triton inlines them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kv.kv_formats import FP8_HEAD_BYTES

FP8_SCALE_BYTES = FP8_HEAD_BYTES  # an fp8 row (kv_formats.py): its fp32 scale padded to 16 bytes, then D codes
_SCALE_BYTES = tl.constexpr(FP8_SCALE_BYTES)  # the same for the kernels (a jit function reads constexpr globals only)


FP8_ALIGN = 16  # what load_kv promises the compiler about an fp8 row's start (and so its codes')


def fp8_row_bytes(head_dim: int) -> int:
    """Bytes of one fp8 row of head_dim values (no padding when head_dim % 4 == 0)."""
    return FP8_SCALE_BYTES + head_dim


def fp8_rows_aligned(store: torch.Tensor) -> bool:
    """What load_kv promises the compiler about an fp8 layer [R, Hkv, 16 + D] (uint8): every row, hence its codes,
    starts on a multiple of 16 bytes (the base and both outer strides; D % 16 == 0), and the last dim is
    contiguous."""
    a = FP8_ALIGN
    return store.data_ptr() % a == 0 and store.stride(0) % a == 0 and store.stride(1) % a == 0 and store.stride(2) == 1


@triton.jit
def load_kv(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, row, kv, stride_kr, stride_kh, stride_vr, stride_vh, d, ok, MASKED: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """K and V tiles [BLOCK_N, D] of the pool rows `row` for KV head `kv`, and their per-row scales [BLOCK_N];
    MASKED: rows where `ok` is false are not read (zeros). Plain layers: the stored values, scales 1. FP8 (uint8
    rows: an fp32 scale padded to 16 bytes, then D e4m3fn codes): the codes as bf16 (exact) and the scales, which
    softmax_step applies to the scores and the probabilities instead of to every element."""
    if FP8:  # every fp8 row starts on 16 bytes (a row is 16 + D bytes, D % 16 == 0: `supported`), so its codes
        # do too: said to the compiler, the codes load 16 bytes at a time (and pipeline); 4-byte words with the
        # old 4 + D rows ran the decode kernel at a third of bf16's bandwidth, bytes one by one at a quarter
        k_off = tl.multiple_of(row * stride_kr + kv * stride_kh, 16)
        v_off = tl.multiple_of(row * stride_vr + kv * stride_vh, 16)
    else:
        k_off = row * stride_kr + kv * stride_kh
        v_off = row * stride_vr + kv * stride_vh
    k_row = k_ptr + k_off  # [BLOCK_N]
    v_row = v_ptr + v_off
    if FP8:
        k_ptrs = k_row[:, None] + _SCALE_BYTES + d[None, :]
        v_ptrs = v_row[:, None] + _SCALE_BYTES + d[None, :]
        ks_ptrs = k_row.to(tl.pointer_type(tl.float32))
        vs_ptrs = v_row.to(tl.pointer_type(tl.float32))
    else:
        k_ptrs = k_row[:, None] + d[None, :]
        v_ptrs = v_row[:, None] + d[None, :]
    if MASKED:
        k = tl.load(k_ptrs, mask=ok[:, None], other=0)
        v = tl.load(v_ptrs, mask=ok[:, None], other=0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if FP8:
        k = k.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        v = v.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        if MASKED:
            k_scale = tl.load(ks_ptrs, mask=ok, other=0.0)
            v_scale = tl.load(vs_ptrs, mask=ok, other=0.0)
        else:
            k_scale = tl.load(ks_ptrs)
            v_scale = tl.load(vs_ptrs)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v, k_scale, v_scale


@triton.jit
def softmax_step(  # type: ignore[no-untyped-def]
    q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """One tile of flash attention: q [M, D] x k [N, D]^T -> scores, online softmax (base 2), acc += p @ v.
    `visible` [M, N] (or broadcastable) is read only when MASKED. DOT_FP32: IEEE fp32 dots (the interpreter,
    which multiplies 16-bit operands as raw bits); else tensor-core dots with the probabilities rounded to
    v's dtype, as flash attention does. FP8: the keys' scales [N] multiply the scores, the values' the
    probabilities that weigh them (the row sums l use the unscaled ones). Returns (m_i, l_i, acc)."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep exp2 finite
        p = tl.exp2(s - m_safe[:, None])
    else:  # every score finite: the scale goes into exp2's argument (scale > 0 commutes with the max)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        m_safe = m_new
        p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if FP8:
        p = p * v_scale[None, :]
    if DOT_FP32:
        acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l_i, acc
