"""Attention over keys that arrive in parts (resident pages, then host pages through a staging
buffer), merged exactly with log-sum-exp: the `exact` prefill policy.

Pure torch: this is both the CPU path and the reference for any fused GPU kernel.
"""

from __future__ import annotations

import torch


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
    scores = torch.bmm(q_rows.float(), k.float().transpose(1, 2)) * scale  # [Hkv, G*N, T]
    if row_mask is not None:
        scores = scores + row_mask
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G*N]
    weights = torch.exp(scores - lse.unsqueeze(-1).clamp(min=-1e30))
    weights = torch.nan_to_num(weights, nan=0.0)
    return torch.bmm(weights, v.float()), lse


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
    q_rows = q_rows.float()
    rows = q_rows.shape[1]
    page_lse = torch.full((num_kv_heads, rows, num_pages + 1), -torch.inf, device=q.device)
    lse = torch.full((num_kv_heads, rows), -torch.inf, device=q.device)
    for k, key_pos, mask in parts:
        logits = torch.bmm(q_rows, k.float().transpose(1, 2)) * scale  # [Hkv, G*Tq, T_i]
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
