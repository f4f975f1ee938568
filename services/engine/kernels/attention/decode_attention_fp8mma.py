"""Flash-decoding over fp8 rows on fp8 tensor cores (Triton, Hopper's wgmma): the split kernel of
decode_attention_triton.py for fp8 pool rows, its products transposed so that no code is converted.

The fp16-dot split kernel converts every K and V code to fp16 before its dots (16K conversions a 128-row step)
and pads the G = Hq / Hkv query heads of a KV head to 16 rows of mma.sync, 4 of them real at the 8B shape: on an
H100 it reads 32 x 4K fp8 rows at 2.1 TB/s (143 us a layer) where bf16 rows stream at 2.75 (bench/RESULTS.md,
round 13): it is bound by its instructions, not by its bytes. Here a program's tiles are the transposes:

    scores^T [BLOCK_N, NG] = codes_K [BLOCK_N, D] @ q^T [D, NG]       (wgmma m64nNGk32, e4m3 x e4m3)
    acc^T    [D, NG]      += codes_V^T [D, BLOCK_N] @ w^T [BLOCK_N, NG]

with the rows as the products' M (64 per warpgroup instruction) and the heads as N (NG = G padded to 8), so the
codes go to the tensor cores as they are. q and the weights w are the fp8 operands: each in two e4m3 terms (hi,
then the rounding error of hi as lo, two dots accumulated), q scaled per head so that its largest |element| is
256 and w (< 1.07, softmax_step_f16's weights) by 256: 7-8 significant bits, about bf16's, where the K/V codes
carry 4. The softmax runs down the rows (axis 0) of a [BLOCK_N, NG] tile: a quarter of the fp16 kernel's [16,
BLOCK_N] padded tile.

The partials (m, l, acc) and the launch grid (B, Hkv, S) are the fp16 kernel's (`decode_attention_triton.Partials`,
its merge), as are `rows` / `key_pos`, `sorted_keys`, `keep_q` / `keep_pos` and windows; no local rings (their
layers are never fp8). `decode_attention_triton._attend` launches it for fp8 rows with KVMEM_FP8_DOT=mma. The
interpreter (CPU tests) multiplies the same fp8 operands in fp32, where their products are exact.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels import pdl
from services.engine.kernels.attention import attention_tiles as tiles

MIN_HEADS = 8  # wgmma's smallest N: the G query heads of a KV head are padded to this
Q_TOP = tl.constexpr(256.0)  # q's largest |element| a head, scaled (e4m3's largest finite value is 448)
W_SCALE = tl.constexpr(256.0)  # the weights (< 1.07) scaled into e4m3's range


@triton.jit
def _e4m3_round(x):  # type: ignore[no-untyped-def]
    """fp32 x (|x| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32: the interpreter's own
    conversion rounds up across a power of two wrongly (31.4 -> 16). Normal values keep 3 mantissa bits (the fp32
    bits rounded at bit 20); below 2^-6 the steps are 2^-9 (an fp32 add of 1.5 * 2^14 rounds there)."""
    bits = x.to(tl.int32, bitcast=True)
    kept = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # -1048576: 0xFFF00000
    small = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, small, kept)


@triton.jit
def _two_terms(x, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
    """x (fp32, |x| <= 448) as hi + lo, both e4m3 values: hi = x rounded, lo = what hi missed, rounded; e4m3
    tensors, or interpreted fp32 tensors holding those values."""
    if INTERPRETED:
        hi = _e4m3_round(x)
        return hi, _e4m3_round(x - hi)
    hi = x.to(tl.float8e4nv)
    lo = (x - hi.to(tl.float32)).to(tl.float8e4nv)
    return hi, lo


@triton.jit
def _dot2(a, b_hi, b_lo, acc, INTERPRETED: tl.constexpr):  # type: ignore[no-untyped-def]
    """acc + a @ (b_hi + b_lo) (fp8 operands, fp32 accumulation); interpreted in IEEE fp32 (exact products)."""
    if INTERPRETED:
        af = a.to(tl.float32)
        acc = tl.dot(af, b_hi.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(af, b_lo.to(tl.float32), acc, input_precision="ieee")
    acc = tl.dot(a, b_hi, acc)
    return tl.dot(a, b_lo, acc)


@triton.jit(do_not_specialize=["width", "rows_per_split", "num_splits", "window"])
def _split_fp8_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [R, Hkv, 16 + D] uint8 fp8 rows
    v_ptr,
    rows_ptr,  # [B, W] int64
    key_pos_ptr,  # [B, W] int64
    q_pos_ptr,  # [B] int64
    m_ptr,  # [B, Hq, S] fp32 (unused when DIRECT)
    l_ptr,
    acc_ptr,  # [B, Hq, S, D] fp32
    out_ptr,  # [B, Hq, D] (DIRECT only)
    keep_ptr,  # [B, Hq, D]: a copy of q (KEEP_Q only)
    keep_pos_ptr,  # [B] int64 (KEEP_AT only)
    width,
    rows_per_split,
    num_splits,
    window,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    NG: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SPLIT_BLOCKS: tl.constexpr,  # rows_per_split // BLOCK_N, interpreted only (0 when compiled)
    KEEP_Q: tl.constexpr,
    PDL: tl.constexpr,
    SORTED: tl.constexpr = False,
    KEEP_AT: tl.constexpr = False,
    V_F16: tl.constexpr = False,  # the value codes converted to fp16 for the second product (an A/B variant)
):
    pdl.start(PDL)
    b = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, NG)
    g_ok = g < G
    heads = kv * G + g
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
    if KEEP_Q:
        if split == 0:
            tiles.keep_query(q, keep_ptr, keep_pos_ptr, q_pos_ptr, b, heads, g_ok, d, G, D, KEEP_AT)
    q = q.to(tl.float32)
    top = tl.max(tl.abs(q), axis=1)  # [NG]
    q_scale = tl.where(top > 0, Q_TOP / top, 1.0)
    q_hi, q_lo = _two_terms(q * q_scale[:, None], INTERPRETED)
    q_hi = tl.trans(q_hi)  # [D, NG]
    q_lo = tl.trans(q_lo)
    col = scale_log2 / q_scale  # [NG]: the softmax scale (base 2) and q's own, undone on the scores
    q_pos = tl.load(q_pos_ptr + b)
    m_i = tl.full([NG], float("-inf"), tl.float32)
    l_i = tl.zeros([NG], tl.float32)
    acc = tl.zeros([D, NG], tl.float32)
    start = split * rows_per_split
    n_stop = rows_per_split
    if SORTED:
        n_stop = tl.where(tl.load(key_pos_ptr + b * width + start) > q_pos, 0, rows_per_split)
    for n0 in range(0, SPLIT_BLOCKS * BLOCK_N if INTERPRETED else n_stop, BLOCK_N):
        n = start + n0 + tl.arange(0, BLOCK_N)
        in_w = n < width
        if SORTED:
            in_w = in_w & (n < start + n_stop)
        pos = tl.load(key_pos_ptr + b * width + n, mask=in_w, other=0)
        ok = in_w & (pos <= q_pos)
        row = tl.load(rows_ptr + b * width + n, mask=in_w, other=0)
        if HAS_WINDOW:
            ok = ok & (pos > q_pos - window)
        k, v, k_scale, v_scale = tiles.load_kv(
            k_ptr, v_ptr, row, kv, stride_kr, stride_kh, stride_vr, stride_vh, d, ok, True, True, CODES=True
        )
        s = _dot2(k, q_hi, q_lo, tl.zeros([BLOCK_N, NG], tl.float32), INTERPRETED)  # [BLOCK_N, NG]
        s = s * k_scale[:, None] * col[None, :]
        s = tl.where(ok[:, None], s, float("-inf"))
        # the running max is that of s + log2(v_scale) (softmax_step_f16): the weights w below stay < 1.07
        m_new = tl.maximum(m_i, tl.max(s + tiles.log2_scale(v_scale)[:, None], axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[None, :])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if V_F16:  # the value codes converted (fp16 weights, one dot): the value side as the fp16 kernel has it
            w = (p * v_scale[:, None]).to(tl.float16)
            vf = v.to(tl.float16)
            if INTERPRETED:
                acc = tl.dot(
                    tl.trans(vf.to(tl.float32)), w.to(tl.float32), acc * alpha[None, :], input_precision="ieee"
                )
            else:
                acc = tl.dot(tl.trans(vf), w, acc * alpha[None, :])
        else:
            w_hi, w_lo = _two_terms(p * (v_scale * W_SCALE)[:, None], INTERPRETED)
            pv = _dot2(tl.trans(v), w_hi, w_lo, tl.zeros([D, NG], tl.float32), INTERPRETED)
            acc = acc * alpha[None, :] + pv * (1.0 / W_SCALE)
        m_i = m_new
    if DIRECT:
        o = acc / l_i[None, :]
        o_ptrs = out_ptr + b * stride_ob + heads[None, :] * stride_oh + d[:, None]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[None, :])
    else:
        at = ((b * tl.num_programs(1) * G + heads) * num_splits + split).to(tl.int64)  # [NG]
        tl.store(m_ptr + at, m_i, mask=g_ok)
        tl.store(l_ptr + at, l_i, mask=g_ok)
        tl.store(acc_ptr + at[None, :] * D + d[:, None], acc, mask=g_ok[None, :])


INTERPRETED = isinstance(_split_fp8_kernel, InterpretedFunction)  # TRITON_INTERPRET=1 (the CPU tests)


def heads_tile(group: int) -> int:
    """NG: the G query heads of a KV head padded to a power of two >= MIN_HEADS (wgmma's N)."""
    return max(MIN_HEADS, triton.next_power_of_2(group))


V_F16 = False  # the second product's value codes converted to fp16 (A/B: bench/scale_kernels.py's sweep)
NUM_WARPS = 4  # one warpgroup: wgmma's unit
NUM_STAGES = 3
BLOCK_ROWS = 128  # rows a loop step (two m64 instructions a product)
