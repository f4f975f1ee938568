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
