"""Fused RMSNorm and q/k-norm + RoPE kernels (Triton): one launch where the torch code takes ten.

A decode step of a small model is bound by kernel count, not by bytes: Gemma 3 270M's torch RMSNorm
is ~10 kernels (casts, pow, mean, rsqrt, muls) and a layer has six of them, so norms were two thirds
of the ~1,400 kernels of a CUDA-graph decode step. The torch references are the models' own modules
(models/llama.py RMSNorm, models/gemma3.py GemmaRMSNorm, apply_rope); these kernels keep their
rounding points (fp32 statistics, the cast to the model dtype where the reference casts) so bf16
results match the reference to the last bit or one rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.kernels import pdl


@triton.jit
def normed(x, w_ptr, out_ptr, offs, mask, dim, eps, w_offset, GEMMA: tl.constexpr):
    """One row x (fp32 [BLOCK_D]) RMS-normed with the weight at w_ptr, in fp32: GEMMA x * r * (w + w_offset),
    else (Llama) cast(x * r) * w, cast to out_ptr's dtype as the torch reference rounds."""
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return normed_by(x, w, out_ptr.dtype.element_ty, dim, eps, w_offset, GEMMA)


@triton.jit
def normed_by(x, w, out_ty: tl.constexpr, dim, eps, w_offset, GEMMA: tl.constexpr):
    """`normed` with the weight already loaded (w: fp32 [BLOCK_D], zero past dim), rounded as to out_ty."""
    r = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    if GEMMA:
        y = x * r * (w + w_offset)
    else:
        y = (x * r).to(out_ty).to(tl.float32) * w
    return y


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, res_ptr, out_ptr, w2_ptr, out2_ptr, ids_ptr, num_heads, dim, stride_n, stride_h, eps, w_offset,
    scale, GEMMA: tl.constexpr, RESIDUAL: tl.constexpr, NEXT: tl.constexpr, EMBED: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (token, head) row of D values. GEMMA: x * r * (w + w_offset) in fp32, then cast;
    else (Llama): cast(x * r) * w in the model dtype. RESIDUAL: res + that, added in the model dtype.
    NEXT: also the norm (weight w2) of the stored result, into out2 (the next norm of a Gemma layer).
    EMBED (with NEXT): the stored result is instead row ids[n] of the table x times `scale`, rounded to
    the model dtype (a Gemma embedding lookup), and out2 its norm."""
    pdl.start(PDL)
    n = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    out_ty = out_ptr.dtype.element_ty
    if EMBED:
        row = tl.load(ids_ptr + n)
        y = tl.load(x_ptr + row * stride_n + offs, mask=mask, other=0.0).to(tl.float32) * scale
    else:
        x = tl.load(x_ptr + n * stride_n + h * stride_h + offs, mask=mask, other=0.0).to(tl.float32)
        y = normed(x, w_ptr, out_ptr, offs, mask, dim, eps, w_offset, GEMMA)
    if RESIDUAL:  # residual rows are contiguous [N * H, D], like the output
        res = tl.load(res_ptr + (n * num_heads + h) * dim + offs, mask=mask, other=0.0).to(tl.float32)
        y = res + y.to(out_ty).to(tl.float32)
    y = y.to(out_ty)
    tl.store(out_ptr + (n * num_heads + h) * dim + offs, y, mask=mask)
    if NEXT:
        z = normed(y.to(tl.float32), w2_ptr, out_ptr, offs, mask, dim, eps, w_offset, GEMMA)
        tl.store(out2_ptr + (n * num_heads + h) * dim + offs, z.to(out_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [N, D] or [N, H, D] (last dim contiguous, any row strides) -> a new contiguous tensor of x's
    shape and dtype. gemma: scale by (1 + weight) in fp32 (GemmaRMSNorm); else weight * cast(x / rms).
    residual (x's shape, contiguous): returns residual + norm(x), the sum in the model dtype."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    assert x3.stride(2) == 1, "the last dimension must be contiguous"
    n, h, d = x3.shape
    out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    if n:
        _rms_norm_kernel[(n, h)](
            x3, weight, residual if residual is not None else out, out, weight, out, out, h, d, x3.stride(0),
            x3.stride(1), eps, 1.0 if gemma else 0.0, 1.0, GEMMA=gemma, RESIDUAL=residual is not None, NEXT=False,
            EMBED=False, BLOCK_D=triton.next_power_of_2(d), **pdl.launch_args(x.device),
        )  # fmt: skip
    return out.view(x.shape)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, next_weight: torch.Tensor, eps: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm'(s)) with s = residual + norm(x) (`rms_norm` with `residual`) and norm' the same norm with
    `next_weight`, in one launch: a Gemma layer's post-norm, residual add and the next pre-norm.
    x: [N, D] (last dim contiguous); residual [N, D] contiguous, x's dtype."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [N, D] with a contiguous last dimension"
    assert residual.shape == x.shape and residual.is_contiguous() and residual.dtype == x.dtype
    n, d = x.shape
    out = torch.empty_like(residual)
    out2 = torch.empty_like(residual)
    if n:
        _rms_norm_kernel[(n, 1)](
            x, weight, residual, out, next_weight, out2, out, 1, d, x.stride(0), 0, eps, 1.0 if gemma else 0.0, 1.0,
            GEMMA=gemma, RESIDUAL=True, NEXT=True, EMBED=False, BLOCK_D=triton.next_power_of_2(d),
            **pdl.launch_args(x.device),
        )  # fmt: skip
    return out, out2


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, scale: float, weight: torch.Tensor, eps: float, gemma: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, norm(x)) with x = table[ids] * scale rounded to the table's dtype (Gemma's scaled embedding,
    `scale` a float the dtype holds exactly) and norm the first layer's input norm, in one launch:
    ids [N] int64; table [V, D] (last dim contiguous) -> two [N, D] tensors of the table's dtype."""
    assert ids.dim() == 1 and ids.dtype == torch.int64 and table.dim() == 2 and table.stride(1) == 1
    n, d = ids.shape[0], table.shape[1]
    out = torch.empty((n, d), dtype=table.dtype, device=table.device)
    out2 = torch.empty_like(out)
    if n:
        _rms_norm_kernel[(n, 1)](
            table, weight, out, out, weight, out2, ids.contiguous(), 1, d, table.stride(0), 0, eps,
            1.0 if gemma else 0.0, scale, GEMMA=gemma, RESIDUAL=False, NEXT=True, EMBED=True,
            BLOCK_D=triton.next_power_of_2(d), **pdl.launch_args(table.device),
        )  # fmt: skip
    return out, out2


@triton.jit
def gelu_tanh(g):
    """F.gelu(g, approximate="tanh") in fp32: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))."""
    inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    return 0.5 * g * (1.0 + tanh)


GATED_ACTS = {"gelu_tanh": 1, "silu": 2}  # the ACT constexpr of _act_mul_kernel


@triton.jit
def _act_mul_kernel(gate_up_ptr, out_ptr, inter, BLOCK: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr):
    """out[n, i] = act(gate[n, i]) * up[n, i] for gate_up = [gate | up] rows of 2 * inter values (ACT 1:
    gelu_tanh, 2: silu = g * sigmoid(g)); rounded to the model dtype after the activation, as F.gelu / F.silu
    then a multiply does."""
    pdl.start(PDL)
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gate_up_ptr + n * 2 * inter + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + n * 2 * inter + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if ACT == 1:
        act = gelu_tanh(g)
    else:
        act = g * tl.sigmoid(g)
    act = act.to(out_ty).to(tl.float32)
    tl.store(out_ptr + n * inter + offs, (act * u).to(out_ty), mask=mask)


def _act_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    assert gate_up.is_contiguous()
    n, two_i = gate_up.shape
    inter = two_i // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n:
        block = 1024
        _act_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, inter, BLOCK=block, ACT=GATED_ACTS[act], **pdl.launch_args(gate_up.device)
        )
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] contiguous (the fused gate/up projection) -> [N, I] = gelu_tanh(gate) * up."""
    return _act_mul(gate_up, "gelu_tanh")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [N, 2I] contiguous -> [N, I] = silu(gate) * up (the Llama family's SwiGLU, prefill-sized rows;
    before it the torch path took two launches, ~0.33 ms each per 8K-row chunk at Llama-3.1-8B's shape on the
    H200: bench/results/scale_profile_prefill_h200.txt)."""
    return _act_mul(gate_up, "silu")


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, num_q_heads, num_qk_heads, dim, stride_n, stride_h,
    eps, k_store_ptr, v_store_ptr, rows_ptr, stride_sr, stride_sh,
    GEMMA: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr, TABLE: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr = True, HEADS: tl.constexpr = 1,
):  # fmt: skip
    """One program per (token, HEADS q-or-k heads): RMSNorm of each head with its kind's weight (not with NORM
    False: a model without q/k norm, RoPE alone), then RoPE (x * cos + roll(x, D/2) * sin, the sin table
    signed), rounding where the torch reference rounds; the token's cos/sin row is read once for its HEADS.
    STORE: a k head's row also writes its k, and the token's v of that KV head, into the KV stores
    at the token's row (KVPool.write's job, without its launch). TABLE: cos/sin are the whole tables,
    read at the token's position (pos_ptr), instead of rows gathered per token."""
    pdl.start(PDL)
    n = tl.program_id(0)
    hh = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    offs = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    dmask = offs < dim
    mask = dmask & (hh < num_qk_heads)
    half = dim // 2
    rolled = (offs + half) % dim  # roll(x, D/2)[i] = x[(i + D/2) % D] for the half-split layout
    base = qkv_ptr + n * stride_n + hh * stride_h
    x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + rolled, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, axis=1)[:, None] / dim + eps)
        is_q = hh < num_q_heads
        w = tl.where(is_q, tl.load(qw_ptr + offs, mask=dmask, other=0.0), tl.load(kw_ptr + offs, mask=dmask, other=0.0))
        w2 = tl.where(
            is_q, tl.load(qw_ptr + rolled, mask=dmask, other=0.0), tl.load(kw_ptr + rolled, mask=dmask, other=0.0)
        )
        w = w.to(tl.float32)
        w2 = w2.to(tl.float32)
    if not NORM:  # x and x2 are the input's values already
        y = x
        y2 = x2
    elif GEMMA:
        y = (x * r * (w + 1.0)).to(out_ty).to(tl.float32)
        y2 = (x2 * r * (w2 + 1.0)).to(out_ty).to(tl.float32)
    else:
        y = ((x * r).to(out_ty).to(tl.float32) * w).to(out_ty).to(tl.float32)
        y2 = ((x2 * r).to(out_ty).to(tl.float32) * w2).to(out_ty).to(tl.float32)
    row = tl.load(pos_ptr + n) if TABLE else n
    c = tl.load(cos_ptr + row * dim + offs, mask=dmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + row * dim + offs, mask=dmask, other=0.0).to(tl.float32)
    a = (y * c).to(out_ty).to(tl.float32)
    b = (y2 * s).to(out_ty).to(tl.float32)
    y_out = (a + b).to(out_ty)
    tl.store(out_ptr + (n * num_qk_heads + hh) * dim + offs, y_out, mask=mask)
    if STORE:
        kmask = mask & (hh >= num_q_heads)
        kv = tl.maximum(hh - num_q_heads, 0)
        store_ty = k_store_ptr.dtype.element_ty
        dst = tl.load(rows_ptr + n) * stride_sr + kv * stride_sh + offs
        tl.store(k_store_ptr + dst, y_out.to(store_ty), mask=kmask)
        v = tl.load(qkv_ptr + n * stride_n + (num_qk_heads + kv) * stride_h + offs, mask=kmask, other=0.0)
        tl.store(v_store_ptr + dst, v.to(store_ty), mask=kmask)


ROPE_HEADS = 8  # heads per program of a prompt chunk's qk_norm_rope (a decode step's keep one each)
ROPE_HEADS_FROM = 64  # tokens from which a launch takes ROPE_HEADS


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    gemma: bool,
    kv_sink: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv: [N, Hq + 2 Hkv, D] (the fused projection, viewed by head); cos, sin: [N, 1, D] from
    RotaryEmbedding, or with `positions` [N] int64 the whole tables [P, D] (each token's row read in the
    launch: no gather launches) -> [N, Hq + Hkv, D]: q and k normed (their own weights) and rotated, contiguous;
    with no weights (None, None: a model without q/k norm) rotated only, as apply_rope rounds.
    kv_sink (k_store, v_store [R, Hkv, D] of a plain dtype, rows [N] int64, distinct): k and v are also
    written there, row rows[n] (what write_kv_reference does with them)."""
    n, _, d = qkv.shape
    assert qkv.stride(2) == 1 and d % 2 == 0
    heads = num_q_heads + num_kv_heads
    out = torch.empty((n, heads, d), dtype=qkv.dtype, device=qkv.device)
    store = (out, out, out, 0, 0)  # unused without a sink
    if kv_sink is not None:
        k_store, v_store, rows = kv_sink
        assert k_store.shape[1:] == v_store.shape[1:] == (num_kv_heads, d) and k_store.dtype == v_store.dtype
        assert k_store.stride() == v_store.stride() and k_store.stride(2) == 1, (k_store.stride(), v_store.stride())
        assert rows.shape == (n,) and rows.dtype == torch.int64 and rows.is_contiguous(), (rows.shape, rows.dtype)
        store = (k_store, v_store, rows, k_store.stride(0), k_store.stride(1))
    if positions is not None:
        assert positions.shape == (n,) and positions.dtype == torch.int64, (positions.shape, positions.dtype)
        assert cos.dim() == 2 and cos.shape[1] == d and cos.is_contiguous() and sin.is_contiguous(), cos.shape
        cos2, sin2 = cos, sin
    else:
        cos2, sin2 = cos.reshape(n, d), sin.reshape(n, d)
        assert cos2.is_contiguous() and sin2.is_contiguous()
    norm = q_weight is not None and k_weight is not None
    if not norm:
        assert q_weight is None and k_weight is None, "both q/k norm weights or neither"
        q_weight = k_weight = cos2  # never read
    per = ROPE_HEADS if n >= ROPE_HEADS_FROM else 1  # 0.32 ms a layer of 8K tokens at 8B with one head each
    if n:
        _qk_norm_rope_kernel[(n, triton.cdiv(heads, per))](
            qkv, q_weight, k_weight, cos2, sin2, positions.contiguous() if positions is not None else cos2, out,
            num_q_heads, heads, d, qkv.stride(0), qkv.stride(1), eps,
            *store, GEMMA=gemma, BLOCK_D=triton.next_power_of_2(d), STORE=kv_sink is not None,
            TABLE=positions is not None, NORM=norm, HEADS=per, **pdl.launch_args(qkv.device),
        )  # fmt: skip
    return out
