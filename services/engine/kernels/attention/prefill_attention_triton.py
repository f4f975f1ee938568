"""Prefill attention over paged KV (Triton): causal FlashAttention of a prompt chunk, reading the pool in place.

A prefill chunk of n new tokens at positions [P, P + n) attends every key at positions 0..P + i (causal,
bottom-right aligned: the chunk is the last n of T = P + n positions). The keys and values of all T positions
are already in the pool (the step writes the new rows before attending); `rows` [T] says which pool row holds
position t (StepAttention's SeqSpan.read_rows: the page table expanded), so nothing is gathered into a copy.

    grid (cdiv(n, BLOCK_M), Hq): program (mb, h) takes query rows [mb * BLOCK_M, (mb + 1) * BLOCK_M) of head h,
    walks key tiles of BLOCK_N positions from 0 to the last one its rows can see (online softmax in base 2,
    fp32 accumulators), the tiles left of its first row's position unmasked, the diagonal ones masked, and
    writes the normalised output [n, Hq, D]. Row blocks run last first (the longest key walks start
    first: a shorter tail). The tile step (K/V rows read in place, online softmax) is
    kernels/attention/attention_tiles.py's, shared with the decode kernel.

The exact policy's attention over keys that arrive in parts (a chunk's resident rows, then staging batches of
host pages: kv/paged_attention.StepAttention._exact_kernel) runs the same kernel with CAUSAL False (every query
sees all T keys) and a STATE: a float32 output and its log-sum-exp written, or read first and merged into (the
online softmax starts from them), so no part's scores are ever materialised.

Query head h reads KV head h // G (transformers' repeat_kv order); the G programs of one KV head run side by
side, so their K/V tiles come from L2 after the first. The torch reference is `prefill_attention_reference`
(grouped_sdpa with the causal mask over the gathered rows); `supported` says which layers take the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from services.engine.kernels.attention import attention_tiles as tiles
from services.engine.kv.attention import grouped_sdpa, lse_merge_torch, position_mask

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the kernel's copy (a jitted function reads constexpr globals only)
_PLAIN = (torch.bfloat16, torch.float16)


def prefill_attention_reference(
    q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] at positions T - n .. T - 1; k_store, v_store [R, Hkv, D]; rows [T] int64 -> [n, Hq, D]."""
    n, num_heads, _ = q.shape
    t = rows.shape[0]
    k = k_store.index_select(0, rows).to(q.dtype).transpose(0, 1)  # [Hkv, T, D]
    v = v_store.index_select(0, rows).to(q.dtype).transpose(0, 1)
    group = num_heads // k.shape[0]
    allowed = position_mask(torch.arange(t - n, t, device=q.device), torch.arange(t, device=q.device))
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    return grouped_sdpa(q, k, v, mask.repeat(group, 1), scale)


def supported(q: torch.Tensor, k_store: torch.Tensor, fp8: bool = False) -> bool:
    """A chunk of at least 16 queries over a bf16 / fp16 pool layer of the same dtype (`fp8`: a uint8 layer of
    fp8 rows, kv_formats.py, under bf16 / fp16 queries), D a power of two in 32..256, last dims contiguous."""
    d = q.shape[-1] if q.dim() == 3 else 0
    if fp8:
        layer_ok = (
            k_store.dtype == torch.uint8
            and k_store.shape[-1] == tiles.fp8_row_bytes(d)
            and q.dtype in _PLAIN
            and tiles.fp8_rows_aligned(k_store)
        )
    else:
        layer_ok = k_store.dtype in _PLAIN and q.dtype == k_store.dtype and k_store.shape[-1] == d
    return (
        q.dim() == 3
        and k_store.dim() == 3
        and q.shape[0] >= 16
        and layer_ok
        and 32 <= d <= 256
        and d & (d - 1) == 0
        and q.stride(-1) == 1
        and k_store.stride(-1) == 1
    )


def config(head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a head dim. D 128 from five tried on the H200 at the 8B
    shape's last 8K chunk of 32K (bench/scale.py --attn-bench, RESULTS): 128 x 64 at 4 warps, 3 stages 9.35 ms
    (412 TFLOP/s), 128 x 128 / 8 warps 9.54, 128 x 64 / 8 warps 12.4, 64 x 64 / 4 warps 11.9, 128 x 32 / 4
    warps, 4 stages 13.4 (torch's FlashAttention-2, causal_sdpa: 11.2). Other head dims: untuned guesses."""
    if head_dim <= 128:
        return 128, 64, 4, 3
    return 64, 32, 4, 2


@triton.jit
def _tile(  # type: ignore[no-untyped-def]
    q, q_pos, start, last_pos, rows_ptr, k_ptr, v_ptr, kv, stride_kr, stride_kh, stride_vr, stride_vh, d,
    m_i, l_i, acc, scale_log2, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_FP32: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """The key tile at positions [start, start + BLOCK_N): its pool rows, K/V and one online-softmax step.
    MASKED (a diagonal tile): keys past `last_pos` are not read, and each row sees keys up to its position."""
    kk = start + tl.arange(0, BLOCK_N)
    k_ok = kk <= last_pos
    if MASKED:
        r = tl.load(rows_ptr + kk, mask=k_ok, other=0)
    else:
        r = tl.load(rows_ptr + kk)
    k, v, k_scale, v_scale = tiles.load_kv(
        k_ptr, v_ptr, r, kv, stride_kr, stride_kh, stride_vr, stride_vh, d, k_ok, MASKED, FP8
    )
    visible = (kk[None, :] <= q_pos[:, None]) & k_ok[None, :]
    return tiles.softmax_step(q, k, v, k_scale, v_scale, visible, m_i, l_i, acc, scale_log2, MASKED, DOT_FP32, FP8)


@triton.jit
def _prefill_kernel(
    q_ptr,  # [n, Hq, D]
    k_ptr,  # [R, Hkv, D]
    v_ptr,
    rows_ptr,  # [T] int64
    out_ptr,  # [n, Hq, D]
    lse_ptr,  # [n, Hq] float32 (STATE only)
    n_q,
    past,  # CAUSAL: T - n, the position of query row 0; else T - 1, the last key every query sees
    scale_log2,
    stride_qn,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_on,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FP8: tl.constexpr,  # uint8 fp8 rows (scale + e4m3fn codes): q in bf16 against the codes
    CAUSAL: tl.constexpr = True,  # False: every query sees all T keys
    STATE: tl.constexpr = 0,  # 0: out only; 1: out (fp32) and its log-sum-exp; 2: both read first and merged into
):
    mb = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest) row blocks first: a shorter tail
    h = tl.program_id(1)
    kv = h // G
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < n_q
    d = tl.arange(0, D)
    q = tl.load(q_ptr + m[:, None] * stride_qn + h * stride_qh + d[None, :], mask=m_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    elif FP8:
        q = q.to(tl.bfloat16)
    out_at = out_ptr + m[:, None] * stride_on + h * stride_oh + d[None, :]
    if STATE == 2:  # the attention so far (normalised) and its log-sum-exp: exp2(s - m) sums to 1 at m = lse
        lse0 = tl.load(lse_ptr + m * tl.num_programs(1) + h, mask=m_ok, other=float("-inf"))
        m_i = lse0 * _LOG2E
        l_i = tl.where(lse0 == float("-inf"), 0.0, 1.0)
        acc = tl.load(out_at, mask=m_ok[:, None], other=0.0).to(tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
    if CAUSAL:
        q_pos = past + m  # [BLOCK_M]
        first_pos = past + mb * BLOCK_M  # the block's first query sees keys 0..first_pos
        last_pos = tl.minimum(past + (mb + 1) * BLOCK_M, past + n_q) - 1
    else:  # every row sees keys 0..past
        q_pos = past + 0 * m
        first_pos = past
        last_pos = past
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N  # tiles before it are visible to every row
    for start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _tile(q, q_pos, start, last_pos, rows_ptr, k_ptr, v_ptr, kv, stride_kr, stride_kh,
                              stride_vr, stride_vh, d, m_i, l_i, acc, scale_log2,
                              BLOCK_N, False, DOT_FP32, FP8)  # fmt: skip
    for start in range(full_end, last_pos + 1, BLOCK_N):  # the diagonal tiles: causal mask
        m_i, l_i, acc = _tile(q, q_pos, start, last_pos, rows_ptr, k_ptr, v_ptr, kv, stride_kr, stride_kh,
                              stride_vr, stride_vh, d, m_i, l_i, acc, scale_log2,
                              BLOCK_N, True, DOT_FP32, FP8)  # fmt: skip
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_at, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    if STATE != 0:  # natural log; -inf for a row that saw no key
        lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i))) / _LOG2E)
        tl.store(lse_ptr + m * tl.num_programs(1) + h, lse, mask=m_ok)


# the interpreter multiplies bf16 operands as raw bits (decode_attention_triton.py): fp32 dots there
INTERPRETED = isinstance(_prefill_kernel, InterpretedFunction)


def prefill_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    cfg: tuple[int, int, int, int] | None = None,
    fp8: bool = False,
    causal: bool = True,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """`prefill_attention_reference` in one launch -> [n, Hq, D] in q's dtype; `cfg` overrides `config`; `fp8`:
    the stores are uint8 fp8 rows (the reference over their dequantised rows).

    `causal` False: every query attends all T = len(rows) keys (keys earlier than every query: the exact policy's
    host pages). `state` (out float32 [n, Hq, D], lse float32 [n, Hq], contiguous): the attention is written there
    with its log-sum-exp (natural log, -inf where a row saw no key) and returned; with `accumulate` they hold the
    attention over other keys so far and are merged with these keys' in place (the online softmax starts from
    them): attention over keys that arrive in parts, in one pass each (ring/exact_attention.py's torch
    grouped_attention_lse + merge_partials is the reference)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_store.shape[1]
    if not supported(q, k_store, fp8) or v_store.shape != k_store.shape or num_heads % num_kv_heads:
        raise ValueError(f"prefill attention kernel: q {tuple(q.shape)} {q.dtype}, pool {tuple(k_store.shape)}")
    assert rows.dim() == 1 and rows.dtype == torch.int64, (rows.shape, rows.dtype)
    assert rows.shape[0] >= (n if causal else 1), (rows.shape, n, causal)
    block_m, block_n, warps, stages = cfg or config(head_dim)
    if state is not None:
        out, lse = state
        assert out.shape == q.shape and out.dtype == torch.float32 and out.is_contiguous(), (out.shape, out.dtype)
        assert lse.shape == q.shape[:2] and lse.dtype == torch.float32 and lse.is_contiguous(), (lse.shape, lse.dtype)
    else:
        assert not accumulate, "accumulate needs a state"
        out = torch.empty_like(q)
        lse = out  # never read
    rows = rows.contiguous()
    _prefill_kernel[(triton.cdiv(n, block_m), num_heads)](
        q, k_store, v_store, rows, out, lse, n, rows.shape[0] - n if causal else rows.shape[0] - 1, scale * LOG2E,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        out.stride(0), out.stride(1),
        G=num_heads // num_kv_heads, D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, DOT_FP32=INTERPRETED,
        FP8=fp8, CAUSAL=causal, STATE=0 if state is None else 2 if accumulate else 1, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return out


# -- a prompt chunk's two parts merged (kv/attention.prompt_sdpa) ------------------------------------------


lse_merge_reference = lse_merge_torch  # kv/attention.py's torch form


@triton.jit(do_not_specialize=["n"])  # one compiled variant whatever a chunk's length
def _lse_merge_kernel(
    own_ptr, past_ptr, l_own_ptr, l_past_ptr, out_ptr, n,
    s_oh, s_ot, s_ph, s_pt, s_lh, s_lt, s_mh, s_mt, s_qt, s_qh,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Program (tb, h): rows [tb * BLOCK_T, +BLOCK_T) of head h, read once from each part, written once."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    ok = t < n
    d = tl.arange(0, D)
    share = tl.sigmoid(
        tl.load(l_past_ptr + h * s_mh + t * s_mt, mask=ok, other=0.0)
        - tl.load(l_own_ptr + h * s_lh + t * s_lt, mask=ok, other=0.0)
    )
    own = tl.load(own_ptr + h * s_oh + t[:, None] * s_ot + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    past = tl.load(past_ptr + h * s_ph + t[:, None] * s_pt + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    out = own + share[:, None] * (past - own)
    tl.store(out_ptr + t[:, None] * s_qt + h * s_qh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=ok[:, None])


def lse_merge(
    o_own: torch.Tensor, l_own: torch.Tensor, o_past: torch.Tensor, l_past: torch.Tensor, n: int
) -> torch.Tensor:
    """`lse_merge_reference` in one launch (one read of each part, the output written [n, Hq, D] contiguous; the
    torch form's broadcast lerp ran unvectorised: ~130 us an 8K chunk a layer at the 8B shape on the H200,
    about 3x its bytes' time)."""
    _, heads, _, head_dim = o_own.shape
    assert o_past.shape == o_own.shape and o_own.stride(3) == o_past.stride(3) == 1, (o_own.stride(), o_past.stride())
    assert l_own.shape[:3] == l_past.shape[:3] == o_own.shape[:3] and l_own.dtype == l_past.dtype == torch.float32
    assert head_dim & (head_dim - 1) == 0, head_dim
    out = torch.empty((n, heads, head_dim), dtype=o_own.dtype, device=o_own.device)
    block_t = 32
    _lse_merge_kernel[(triton.cdiv(n, block_t), heads)](
        o_own, o_past, l_own, l_past, out, n,
        o_own.stride(1), o_own.stride(2), o_past.stride(1), o_past.stride(2),
        l_own.stride(1), l_own.stride(2), l_past.stride(1), l_past.stride(2), out.stride(0), out.stride(1),
        D=head_dim, BLOCK_T=block_t, num_warps=4,
    )  # fmt: skip
    return out
