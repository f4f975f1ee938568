"""Triton kernels of a step's KV rows: plain rows written (`write_kv`), and the quantised formats' fused
quantise + scatter (write) and gather + dequantise.

`write_kv` stores a step's new K and V rows of a plain (float) layer in one launch; its torch reference is
`write_kv_reference`. The quantised formats' kernels take one program per (token, KV head) row. Their
arithmetic is that of the torch reference in services/engine/kv/kv_formats.py (e4m3 by integer operations on
the fp32 bits, E2M1 by thresholds, int8 rounding half away from zero), so both produce the same bytes; only
fp32 division may round differently on a GPU (a rare one-code difference). The Hadamard rotation of `+h`
formats stays in torch around these kernels (a [D, D] matmul). Shapes: store uint8 [R, Hkv, row_bytes],
x [N, Hkv, D], rows int64 [N].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels import pdl
from services.engine.kernels.attention import decode_attention_triton
from services.engine.kv.kv_formats import NVFP4_GROUP, KVFormat, int8_group


def supported(fmt: KVFormat, head_dim: int) -> bool:
    """Whether these kernels handle `fmt` at `head_dim` (block shapes must be powers of two)."""
    if fmt.base not in ("fp8", "int8", "nvfp4") or head_dim & (head_dim - 1):
        return False
    return head_dim >= {"fp8": 16, "int8": 16, "nvfp4": NVFP4_GROUP}[fmt.base]


@triton.jit
def _e4m3_encode(y):
    """Non-negative fp32 (clamped to 448) -> e4m3fn code as int32 (RNE for normals, half-up below 2^-6)."""
    y = tl.minimum(y, 448.0)
    bits = y.to(tl.int32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    sub = (y * 512.0 + 0.5).to(tl.int32)
    return tl.minimum(tl.where(y < 0.015625, sub, normal), 126)


@triton.jit
def _e4m3_decode(c):
    """e4m3fn code (int32, sign bit 0x80) -> fp32."""
    e = (c >> 3) & 15
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 128) != 0, -val, val)


# -- fp8: [fp32 scale, padded to S0 = 16 bytes][D e4m3 bytes] -----------------------------------------------


@triton.jit
def _fp8_store(x, base, u8_ptr, f32_ptr, D: tl.constexpr, S0: tl.constexpr):  # type: ignore[no-untyped-def]
    """One row x [D] quantised into the packed row at byte `base`: its fp32 scale, zero padding to S0, the codes."""
    amax = tl.max(tl.abs(x), 0)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    y = x / scale
    code = _e4m3_encode(tl.abs(y)) | tl.where(y < 0, 128, 0)
    tl.store(f32_ptr + base // 4, scale)
    tl.store(u8_ptr + base + S0 + tl.arange(0, D), code.to(tl.uint8))
    pad = tl.arange(0, 16)
    tl.store(u8_ptr + base + 4 + pad, tl.zeros([16], tl.uint8), mask=pad < S0 - 4)  # the zero bytes after the scale


@triton.jit
def _fp8_write(
    x_ptr, rows_ptr, u8_ptr, f32_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    x = tl.load(x_ptr + pid * D + tl.arange(0, D)).to(tl.float32)
    _fp8_store(x, (row * H + h) * RB, u8_ptr, f32_ptr, D, S0)


@triton.jit
def _fp8_write_kv(
    k_ptr, v_ptr, rows_ptr, u8_ptr, f32_ptr, k_sn, k_sh, v_sn, v_sh, V_BYTES,
    H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr,
):  # fmt: skip
    """_fp8_write of K (program_id 1 = 0) and V (1) in one launch: the V store sits V_BYTES after the K store (two
    views of one pool stack), k and v [N, H, D] read through their strides (views of the step's qkv rows)."""
    pid = tl.program_id(0)
    kv = tl.program_id(1)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    d = tl.arange(0, D)
    if kv == 0:
        x = tl.load(k_ptr + t * k_sn + h * k_sh + d).to(tl.float32)
    else:
        x = tl.load(v_ptr + t * v_sn + h * v_sh + d).to(tl.float32)
    _fp8_store(x, kv * V_BYTES + (row * H + h) * RB, u8_ptr, f32_ptr, D, S0)


@triton.jit
def _fp8_read(
    out_ptr, rows_ptr, u8_ptr, f32_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    d = tl.arange(0, D)
    base = (row * H + h) * RB
    scale = tl.load(f32_ptr + base // 4)
    code = tl.load(u8_ptr + base + S0 + d).to(tl.int32)
    val = _e4m3_decode(code) * scale
    tl.store(out_ptr + pid * D + d, val.to(out_ptr.dtype.element_ty))


# -- int8: [G fp16 scales, padded to 4 bytes][D int8] --------------------------------------------------


@triton.jit
def _int8_write(
    x_ptr, rows_ptr, u8_ptr, f16_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr,
    GS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    g = tl.arange(0, D // GS)
    k = tl.arange(0, GS)
    offs = g[:, None] * GS + k[None, :]  # [G, GS]
    x = tl.load(x_ptr + pid * D + offs).to(tl.float32)
    amax = tl.max(tl.abs(x), 1)  # [G]
    scale16 = tl.maximum(amax / 127.0, 5.960464477539063e-08).to(tl.float16)
    scale = scale16.to(tl.float32)
    v = x / scale[:, None]
    q = (v + tl.where(v < 0, -0.5, 0.5)).to(tl.int32)
    q = tl.minimum(tl.maximum(q, -127), 127)
    base = (row * H + h) * RB
    tl.store(f16_ptr + base // 2 + g, scale16)
    tl.store(u8_ptr + base + S0 + offs, (q & 255).to(tl.uint8))


@triton.jit
def _int8_read(
    out_ptr, rows_ptr, u8_ptr, f16_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr,
    GS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    g = tl.arange(0, D // GS)
    k = tl.arange(0, GS)
    offs = g[:, None] * GS + k[None, :]
    base = (row * H + h) * RB
    scale = tl.load(f16_ptr + base // 2 + g).to(tl.float32)
    b = tl.load(u8_ptr + base + S0 + offs).to(tl.int32)
    q = tl.where(b >= 128, b - 256, b).to(tl.float32)
    tl.store(out_ptr + pid * D + offs, (q * scale[:, None]).to(out_ptr.dtype.element_ty))


# -- nvfp4: [fp32 row scale][G e4m3 block scales, padded][D/2 bytes of E2M1 pairs] ---------------------


@triton.jit
def _fp4_code(v):
    """|value| / block scale -> E2M1 magnitude code 0..7 (thresholds halfway, ties down)."""
    c = (v > 0.25).to(tl.int32) + (v > 0.75).to(tl.int32) + (v > 1.25).to(tl.int32) + (v > 1.75).to(tl.int32)
    return c + (v > 2.5).to(tl.int32) + (v > 3.5).to(tl.int32) + (v > 5.0).to(tl.int32)


@triton.jit
def _fp4_value(c):
    """E2M1 code (with sign bit 8) -> fp32."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    pow2 = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    val = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * pow2)
    return tl.where((c & 8) != 0, -val, val)


@triton.jit
def _nvfp4_write(
    x_ptr, rows_ptr, u8_ptr, f32_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr,
    GS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    g = tl.arange(0, D // GS)
    j = tl.arange(0, GS // 2)
    even = g[:, None] * GS + 2 * j[None, :]  # [G, GS / 2]
    xe = tl.load(x_ptr + pid * D + even).to(tl.float32)
    xo = tl.load(x_ptr + pid * D + even + 1).to(tl.float32)
    bmax = tl.maximum(tl.max(tl.abs(xe), 1), tl.max(tl.abs(xo), 1))  # [G]
    amax = tl.max(bmax, 0)
    row_scale = tl.where(amax > 0, amax / 2688.0, 1.0)
    bcode = _e4m3_encode(bmax / (6.0 * row_scale))
    bscale = _e4m3_decode(bcode) * row_scale
    inv = tl.where(bscale > 0, bscale, 1.0)[:, None]
    ce = _fp4_code(tl.abs(xe) / inv) | tl.where(xe < 0, 8, 0)
    co = _fp4_code(tl.abs(xo) / inv) | tl.where(xo < 0, 8, 0)
    base = (row * H + h) * RB
    tl.store(f32_ptr + base // 4, row_scale)
    tl.store(u8_ptr + base + 4 + g, bcode.to(tl.uint8))
    pair = g[:, None] * (GS // 2) + j[None, :]
    tl.store(u8_ptr + base + S0 + pair, (ce | (co << 4)).to(tl.uint8))


@triton.jit
def _nvfp4_read(
    out_ptr, rows_ptr, u8_ptr, f32_ptr, H: tl.constexpr, D: tl.constexpr, RB: tl.constexpr, S0: tl.constexpr,
    GS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    t, h = pid // H, pid % H
    row = tl.load(rows_ptr + t)
    g = tl.arange(0, D // GS)
    j = tl.arange(0, GS // 2)
    base = (row * H + h) * RB
    row_scale = tl.load(f32_ptr + base // 4)
    bscale = _e4m3_decode(tl.load(u8_ptr + base + 4 + g).to(tl.int32)) * row_scale  # [G]
    pair = g[:, None] * (GS // 2) + j[None, :]
    b = tl.load(u8_ptr + base + S0 + pair).to(tl.int32)
    even = g[:, None] * GS + 2 * j[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + pid * D + even, (_fp4_value(b & 15) * bscale[:, None]).to(ty))
    tl.store(out_ptr + pid * D + even + 1, (_fp4_value(b >> 4) * bscale[:, None]).to(ty))


# -- wrappers ------------------------------------------------------------------------------------------


def _views(fmt: KVFormat, store: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert store.dtype == torch.uint8 and store.is_contiguous() and store.shape[-1] % 4 == 0
    return store, store.view(torch.float16 if fmt.base == "int8" else torch.float32)


def quantize_scatter(fmt: KVFormat, x: torch.Tensor, rows: torch.Tensor, store: torch.Tensor) -> None:
    """Quantise x [N, Hkv, D] and write the packed rows into store[rows] (uint8 [R, Hkv, row_bytes])."""
    n, h, d = x.shape
    rb = fmt.row_bytes(d)
    assert store.shape[1:] == (h, rb), f"store {tuple(store.shape)} vs rows of {h} x {rb} bytes"
    if n == 0:
        return
    x, rows = x.contiguous(), rows.contiguous()
    u8, wide = _views(fmt, store)
    if fmt.base == "fp8":
        _fp8_write[(n * h,)](x, rows, u8, wide, h, d, rb, fmt.scale_bytes(d))
    elif fmt.base == "int8":
        _int8_write[(n * h,)](x, rows, u8, wide, h, d, rb, fmt.scale_bytes(d), int8_group(d))
    else:
        _nvfp4_write[(n * h,)](x, rows, u8, wide, h, d, rb, fmt.scale_bytes(d), NVFP4_GROUP)


def quantize_scatter_kv(
    fmt: KVFormat, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor
) -> bool:
    """quantize_scatter of k into k_store and v into v_store in one launch, reading k and v [N, Hkv, D] through their
    strides (no contiguous copies): an fp8 format, unit stride along D, and v_store a view of the same tensor as
    k_store, after it (the pool's stack). False (nothing written) where that does not hold."""
    n, h, d = k.shape
    rb = fmt.row_bytes(d)
    v_bytes = v_store.data_ptr() - k_store.data_ptr()
    if (
        fmt.base != "fp8"
        or v.shape != k.shape
        or k.stride(2) != 1
        or v.stride(2) != 1
        or k_store.untyped_storage().data_ptr() != v_store.untyped_storage().data_ptr()
        or v_bytes <= 0
        or v_bytes % 16
    ):
        return False
    assert k_store.shape[1:] == v_store.shape[1:] == (h, rb), f"stores {tuple(k_store.shape)} vs rows of {h} x {rb}"
    if n:
        u8, wide = _views(fmt, k_store)
        _fp8_write_kv[(n * h, 2)](
            k, v, rows.contiguous(), u8, wide, k.stride(0), k.stride(1), v.stride(0), v.stride(1), v_bytes, h, d, rb,
            fmt.scale_bytes(d),
        )  # fmt: skip
    return True


def gather_dequantize(
    fmt: KVFormat, store: torch.Tensor, rows: torch.Tensor, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """store[rows] dequantised: [T, Hkv, head_dim] in `dtype`."""
    t, h = rows.shape[0], store.shape[1]
    out = torch.empty(t, h, head_dim, dtype=dtype, device=store.device)
    if t == 0:
        return out
    rb = store.shape[-1]
    rows = rows.contiguous()
    u8, wide = _views(fmt, store)
    if fmt.base == "fp8":
        _fp8_read[(t * h,)](out, rows, u8, wide, h, head_dim, rb, fmt.scale_bytes(head_dim))
    elif fmt.base == "int8":
        _int8_read[(t * h,)](out, rows, u8, wide, h, head_dim, rb, fmt.scale_bytes(head_dim), int8_group(head_dim))
    else:
        _nvfp4_read[(t * h,)](out, rows, u8, wide, h, head_dim, rb, fmt.scale_bytes(head_dim), NVFP4_GROUP)
    return out


# -- plain rows ----------------------------------------------------------------------------------------


def write_supported(k_store: torch.Tensor) -> bool:
    """Whether `write_kv` takes this pool layer: the plain layers the decode kernel reads in place
    (decode_attention_triton.supported)."""
    return decode_attention_triton.supported(k_store)


def write_kv_reference(
    k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_store[rows] = k and v_store[rows] = v (cast to the store dtype): rows [N]; k, v [N, Hkv, D]."""
    k_store.index_copy_(0, rows, k.to(k_store.dtype))
    v_store.index_copy_(0, rows, v.to(v_store.dtype))


@triton.jit(do_not_specialize=["num_tokens"])  # one compiled variant whatever a step's token count
def _write_kv_kernel(
    k_ptr, v_ptr, rows_ptr, k_store_ptr, v_store_ptr, num_tokens, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_sr, stride_sh, stride_tr, stride_th, D: tl.constexpr, HD: tl.constexpr, HD_BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per BLOCK_T tokens: their K and V rows (every KV head, HD = Hkv * D values a row) into the
    two stores at rows[token]. (One program per token and head moved 512 bytes each: 0.4 TB/s on a prefill
    chunk of 8K-16K tokens at the 8B shape.)"""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    j = tl.arange(0, HD_BLOCK)
    j_ok = j < HD
    h, d = j // D, j % D
    row = tl.load(rows_ptr + t, mask=t_ok, other=0)
    ok = t_ok[:, None] & j_ok[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kn + (h * stride_kh + d)[None, :], mask=ok)
    v = tl.load(v_ptr + t[:, None] * stride_vn + (h * stride_vh + d)[None, :], mask=ok)
    k_dst = k_store_ptr + row[:, None] * stride_sr + (h * stride_sh + d)[None, :]
    v_dst = v_store_ptr + row[:, None] * stride_tr + (h * stride_th + d)[None, :]
    tl.store(k_dst, k.to(k_store_ptr.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(v_store_ptr.dtype.element_ty), mask=ok)


WRITE_KV_TOKENS = 16  # tokens a write_kv program moves in a prompt chunk (16 x 1,024 values x 2 at the 8B shape)


def write_kv(
    k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """`write_kv_reference` in one launch: rows [N] int64 (distinct); k, v [N, Hkv, D] (last dim
    contiguous) written into k_store, v_store [R, Hkv, D] (plain float dtype), cast to the store dtype."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert write_supported(k_store) and v_store.dtype == k_store.dtype, (k_store.dtype, v_store.dtype)
    assert k_store.shape[1:] == v_store.shape[1:] == (num_kv_heads, head_dim) and v.shape == k.shape
    assert rows.shape == (num_tokens,) and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    assert k.stride(2) == v.stride(2) == k_store.stride(2) == v_store.stride(2) == 1
    if num_tokens == 0:
        return
    hd = num_kv_heads * head_dim
    block_t = WRITE_KV_TOKENS if num_tokens >= 64 * WRITE_KV_TOKENS and hd <= 2048 else 1  # decode rows: in parallel
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, rows.contiguous(), k_store, v_store, num_tokens, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1), D=head_dim, HD=hd,
        HD_BLOCK=triton.next_power_of_2(hd), BLOCK_T=block_t, num_warps=4 if block_t * hd <= 8192 else 8,
        **pdl.launch_args(k.device),
    )  # fmt: skip
