"""StepAttention: the AttentionBackend over the KV pool for one forward step of several sequences."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.attention import causal_mask, grouped_sdpa
from services.engine.kv_pool import KVPool


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a step: `num_new` tokens after `num_past` tokens already in the pool."""

    num_past: int
    num_new: int
    read_rows: torch.Tensor  # [num_past + num_new] pool rows of the whole context, in order


class StepAttention:
    """Writes the step's new K/V into their rows, then attends each sequence over its own pages.

    Per-step work shared by all layers (write rows, masks) is built once in the constructor.
    """

    def __init__(self, pool: KVPool, spans: list[SeqSpan], group: int, dtype: torch.dtype) -> None:
        self.pool = pool
        self.spans = spans
        # write_rows: [N] rows of the new tokens, in the step's flattened order
        self.write_rows = torch.cat([s.read_rows[s.num_past :] for s in spans])
        self.row_masks = [_row_mask(s, group, dtype, pool.device) for s in spans]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] -> [N, Hq, D]."""
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.index_copy_(0, self.write_rows, k.to(k_pool.dtype))
        v_pool.index_copy_(0, self.write_rows, v.to(v_pool.dtype))
        outs = []
        start = 0
        for span, mask in zip(self.spans, self.row_masks, strict=True):
            k_s = k_pool.index_select(0, span.read_rows).transpose(0, 1).to(q.dtype)  # [Hkv, T, D]
            v_s = v_pool.index_select(0, span.read_rows).transpose(0, 1).to(q.dtype)
            outs.append(grouped_sdpa(q[start : start + span.num_new], k_s, v_s, mask, scale))  # [n, Hq, D]
            start += span.num_new
        return torch.cat(outs) if len(outs) > 1 else outs[0]


def _row_mask(span: SeqSpan, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive [G * n, T] mask for grouped_sdpa's rows; None when one new token sees everything."""
    if span.num_new == 1:
        return None
    allowed = causal_mask(span.num_past, span.num_new, device).repeat(group, 1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
