"""The tile step both Triton attention kernels share: K/V rows read from the pool in place, one online-softmax step.

`load_kv` reads the K and V rows `row` [BLOCK_N] of KV head `kv` from one pool layer [R, Hkv, D] (rows anywhere
in the pool: a page table expanded, or a local ring's arithmetic), masked or not; an fp8 layer (uint8 rows of
an fp32 scale and D e4m3fn codes, kv_formats.py) is read as its codes and per-row scales, dequantised inside
the dot products (no bf16 copy of the rows is made). `softmax_step` takes query
rows q [BLOCK_M, D] against one tile of keys (base-2 scores: the softmax scale times log2(e)), updates the
running max `m_i`, sum `l_i` and fp32 accumulator `acc`, and returns them. An unmasked tile (every key visible
to every row) scales the scores inside the exponent's argument (one fused multiply-add an element); a masked
one sets invisible scores to -inf first and keeps exp2 finite for a row that has seen nothing yet.
kernels/attention/decode_attention_triton.py (one token per sequence, the G query heads of a KV head as rows) and
kernels/attention/prefill_attention_triton.py (a prompt chunk's rows of one query head) call these; Triton inlines them.
`softmax_step_f16` is the fp8 step with fp16 operands (the decode kernel's default, KVMEM_FP8_DOT): q and the
codes in fp16, each scale folded into the scores or the weights of the second dot.
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
def _e4m3_to_f16(codes):  # type: ignore[no-untyped-def]
    """uint8 e4m3fn codes -> fp16 (exact), four at a time, in the codes' own layout. For the value tile, whose
    dot reads it transposed (the rows are the reduced dim): Triton's own conversion is elementwise, so it moves the
    layout change to the dot operand before it, onto the 8-bit codes, and sm_90 has no transposing ldmatrix for
    bytes: 64 ld.shared.u8 a thread a tile (and an imad to pair them). Marked impure, this conversion stays where
    it is: the codes load from shared memory 16 bytes at a time and the fp16 tile goes through ldmatrix.trans."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [codes],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def load_kv(  # type: ignore[no-untyped-def]
    k_ptr, v_ptr, row, kv, stride_kr, stride_kh, stride_vr, stride_vh, d, ok, MASKED: tl.constexpr,
    FP8: tl.constexpr, F16: tl.constexpr = False, INTERPRETED: tl.constexpr = False,
):  # fmt: skip
    """K and V tiles [BLOCK_N, D] of the pool rows `row` for KV head `kv`, and their per-row scales [BLOCK_N];
    MASKED: rows where `ok` is false are not read (zeros). Plain layers: the stored values, scales 1. FP8 (uint8
    rows: an fp32 scale padded to 16 bytes, then D e4m3fn codes): the codes as bf16 (F16: fp16; both exact) and the
    scales, which softmax_step applies to the scores and the probabilities instead of to every element. INTERPRETED:
    no inline PTX (F16's value codes are converted by Triton there)."""
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
        if F16:  # one cvt.rn.f16x2.e4m3x2 per two codes on sm_90
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            if INTERPRETED:
                v = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            else:
                v = _e4m3_to_f16(v)
        else:  # sm_90 has no e4m3 -> bf16 cvt: Triton converts e4m3x2 -> f16x2, then each f16 -> bf16
            k = k.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            v = v.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        k_scale = _row_scales(ks_ptrs, ok, MASKED)
        v_scale = _row_scales(vs_ptrs, ok, MASKED)
    else:
        k_scale = 1.0
        v_scale = 1.0
    return k, v, k_scale, v_scale


@triton.jit
def _row_scales(head_ptrs, ok, MASKED: tl.constexpr):  # type: ignore[no-untyped-def]
    """The fp32 scales [BLOCK_N] at `head_ptrs` (each row's 16-byte head: the scale, then padding), read as one
    16-byte load a row and the scale picked out of it: a [BLOCK_N] load of the scales alone is placed by Triton
    3.6 straight into the score tile's layout, 4 bytes at a time and replicated across its threads (128 copies a
    thread in the prefill kernel's pipelined loop, against 16 for the codes; Triton 3.9 makes 8)."""
    c = tl.max_contiguous(tl.arange(0, 4), 4)
    ptrs = tl.multiple_of(head_ptrs, 16)[:, None] + c[None, :]
    if MASKED:
        head = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        head = tl.load(ptrs)
    return tl.sum(tl.where(c[None, :] == 0, head, 0.0), axis=1)


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


# fp16 operands (softmax_step_f16): q is clamped to fp16's range; the value scales enter the running max within
# [2^-64, 2^64] (a row's largest |value| from ~1e-17 to ~8e21: the weights stay < 1.07 and the sums l < 2^80; a
# smaller scale only weighs less)
F16_MAX = tl.constexpr(65504.0)
_V_SCALE_MIN = tl.constexpr(2.0**-64)
_V_SCALE_MAX = tl.constexpr(2.0**64)
_2_M23 = tl.constexpr(2.0**-23)  # an fp32's bits times this, minus 127: about its log2


@triton.jit
def log2_scale(v_scale):  # type: ignore[no-untyped-def]
    """log2 of the value scales from their bits, clamped to [2^-64, 2^64] (Mitchell's approximation: below log2 by
    less than 0.09, so weights exp2(s - m) * v_scale with m the running max of s + this stay below 1.07; tl.log2 is
    a ~25-instruction polynomial a value on sm_90)."""
    return tl.clamp(v_scale, _V_SCALE_MIN, _V_SCALE_MAX).to(tl.int32, bitcast=True).to(tl.float32) * _2_M23 - 127.0


@triton.jit
def softmax_step_f16(  # type: ignore[no-untyped-def]
    q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, scale_log2, MASKED: tl.constexpr, DOT_FP32: tl.constexpr
):
    """softmax_step for fp8 rows whose codes are fp16 (load_kv with F16), q in fp16: no conversion to bf16 and
    no per-element scale. s = (q . codes_k) * k_scale[row]; the running max m is that of s + log2(v_scale[row])
    instead of s, so the weights of the second dot, w = exp2(s - m) * v_scale[row], are < 1.07 and fp16 keeps them
    at 11 bits (a bare p * v_scale would sink into fp16's subnormals at small scales and long rows). The sums l
    and the accumulator use the same m, which is all the merge needs (Partials: m is then a reference, not the
    largest score). DOT_FP32 (the interpreter): q and w arrive / are rounded to fp16 as on the GPU, and the dots
    run in fp32, where fp16 products are exact: the tensor cores' arithmetic up to the order of the sums."""
    if DOT_FP32:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * (k_scale * scale_log2)[None, :]  # one multiply an element: the key scale and the softmax scale
    log2_v = log2_scale(v_scale)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s + log2_v[None, :], axis=1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet: keep exp2 finite
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])  # <= 2^64 (fp32): the row sums l
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    w = (p * v_scale[None, :]).to(tl.float16)
    if DOT_FP32:
        acc = tl.dot(w.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, v, acc)
    return m_new, l_i, acc
