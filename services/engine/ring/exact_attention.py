"""Attention over keys that arrive in parts (resident pages, then host pages through a staging
buffer), merged exactly with log-sum-exp: the `exact` prefill policy.

Pure torch: this is both the CPU path and the reference for any fused GPU kernel. On CUDA, half-precision inputs
multiply on the tensor cores (`_scores`, `_weighted`); the float32 forms are the references (tests compare).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_HALF = (torch.bfloat16, torch.float16)
_tensor_cores = [True]  # False once torch.bmm refused out_dtype (logged once)


def _half_on_cuda(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _tensor_cores[0] and a.is_cuda and a.dtype in _HALF and b.dtype == a.dtype


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a @ b with float32 products and sums into a float32 result, on the tensor cores; None if this torch has no
    out_dtype for bmm on this device (the float32 form is used from then on)."""
    try:
        return torch.bmm(a, b, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        _tensor_cores[0] = False
        logger.warning("exact attention in float32 CUDA cores: torch.bmm has no float32 out_dtype here (%s)", exc)
        return None


def _scores(q_rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q_rows [Hkv, R, D] against k [Hkv, T, D] -> [Hkv, R, T] float32. Half-precision inputs on CUDA multiply on the
    tensor cores into float32 (a bf16 or fp16 product is exact in float32: the float32 form's values up to the order
    of the sums; the float32 SIMT GEMMs were ~1.2 s of an 8 x 12K exact prefill at the 8B shape, bench/RESULTS.md
    round 10), anything else in float32."""
    if _half_on_cuda(q_rows, k):
        out = _bmm_f32(q_rows, k.transpose(1, 2))
        if out is not None:
            return out
    return torch.bmm(q_rows.float(), k.float().transpose(1, 2))


def _weighted(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """weights [Hkv, R, T] float32 @ v [Hkv, T, D] -> [Hkv, R, D] float32: with half-precision v on CUDA the weights
    rounded to v's dtype and the sums in float32 on the tensor cores (as flash attention weighs V), else float32."""
    if _half_on_cuda(v, v):
        out = _bmm_f32(weights.to(v.dtype), v)
        if out is not None:
            return out
    return torch.bmm(weights, v.float())


def grouped_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention and its log-sum-exp.

    q: [N, Hq, D]; k, v: [Hkv, T, D]; row_mask: additive [G * N, T] or None
    -> out [Hkv, G * N, D] (float32, normalised over these keys), lse [Hkv, G * N] (float32).
    Rows with no visible key get lse = -inf and out = 0.
    """
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # q_rows: [Hkv, G * N, D] as in grouped_sdpa
    q_rows = q.view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    # the [Hkv, G * N, T] scores are the big tensor: every pass over them in place, the output normalised after the
    # weighted sum (as flash attention does), no log-sum-exp or nan pass of its own (two 12K prompts' exact chunks on
    # the CPU: 1.9 -> 0.65 s, bench/exact_chunk.py, bench/RESULTS.md round 10)
    scores = _scores(q_rows, k).mul_(scale)  # [Hkv, G*N, T]
    if row_mask is not None:
        scores.add_(row_mask)
    top = scores.amax(dim=-1, keepdim=True).clamp_(min=-1e30)  # rows with no visible key: finite
    weights = scores.sub_(top).exp_()  # in (0, 1], 0 where masked
    total = weights.sum(dim=-1)  # [Hkv, G*N]; 0 for a row with no visible key
    out = _weighted(weights, v).div_(total.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1))
    return out, top.squeeze(-1) + total.log()


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial attentions over disjoint key sets into the attention over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    return out_a * wa + out_b * wb, lse


def rows_to_heads(out: torch.Tensor, num_new: int, num_heads: int) -> torch.Tensor:
    """[Hkv, G * N, D] -> [N, Hq, D] (the inverse of the grouped row layout)."""
    num_kv_heads, _, head_dim = out.shape
    group = num_heads // num_kv_heads
    return out.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)


def page_mass(
    q: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """The real attention mass each query puts on each page: [Tq, Hq, num_pages] float32.

    q: [Tq, Hq, D]; parts: (k [Hkv, T_i, D], key positions [T_i], additive mask [G * Tq, T_i] or None) over
    disjoint key sets that together are every key the queries attend (resident rows, host pages). The softmax
    runs over all of them; keys at or past `num_pages * page_size` count in it but belong to no returned page.
    A query's masses sum to 1 minus what it puts past those pages. Memory: one part's [Hkv, G * Tq, T_i] logits
    at a time (the host pages come in staging batches)."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads = parts[0][0].shape[0]
    group = num_heads // num_kv_heads
    q_rows = q.view(num_q, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    rows = q_rows.shape[1]
    page_lse = torch.full((num_kv_heads, rows, num_pages + 1), -torch.inf, device=q.device)
    lse = torch.full((num_kv_heads, rows), -torch.inf, device=q.device)
    for k, key_pos, mask in parts:
        logits = _scores(q_rows, k) * scale  # [Hkv, G*Tq, T_i]
        if mask is not None:
            logits = logits + mask
        top = logits.amax(dim=-1, keepdim=True).clamp(min=-1e30)  # rows with no visible key stay finite
        pages = (key_pos // page_size).clamp(max=num_pages)
        sums = torch.zeros(num_kv_heads, rows, num_pages + 1, device=q.device)
        sums.index_add_(2, pages, torch.exp(logits - top))
        page_lse = torch.logaddexp(page_lse, torch.log(sums) + top)
        lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=-1))
    mass = torch.exp(page_lse[..., :num_pages] - lse.clamp(min=-1e30).unsqueeze(-1))  # [Hkv, G*Tq, Np]
    mass = torch.nan_to_num(mass, nan=0.0)
    # rows are (kv head, group member, token): back to [Tq, Hq, Np]
    return mass.view(num_kv_heads, group, num_q, num_pages).permute(2, 0, 1, 3).reshape(num_q, num_heads, num_pages)
