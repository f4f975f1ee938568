"""Inputs of the flash-decoding attention tests (test_decode_attention.py, test_decode_attention_fp8.py): scattered
pool rows with gapped positions, padding and future keys, and the kernel's tolerance against its reference."""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.engine.kv.attention import PAD_POS


class Inputs(NamedTuple):
    """One decode-attention call's arguments."""

    q: torch.Tensor  # [B, Hq, D]
    k_store: torch.Tensor  # [R, Hkv, D]
    v_store: torch.Tensor
    rows: torch.Tensor  # [B, W] int64
    key_pos: torch.Tensor  # [B, W] int64
    q_pos: torch.Tensor  # [B] int64
    scale: float


def inputs(
    batch: int, heads: tuple[int, int], head_dim: int, width: int, dtype: torch.dtype, device: torch.device, seed: int
) -> Inputs:
    """Scattered pool rows in shuffled order, positions with gaps, padding rows (row 0 at PAD_POS) at the
    end of each sequence's rows, and a few real keys after the query (masked as future)."""
    num_heads, num_kv_heads = heads
    g = torch.Generator().manual_seed(seed)
    num_rows = batch * width + 64
    k_store = torch.randn(num_rows, num_kv_heads, head_dim, generator=g)
    v_store = torch.randn(num_rows, num_kv_heads, head_dim, generator=g)
    q = 2 * torch.randn(batch, num_heads, head_dim, generator=g)  # scores spread: a peaked softmax
    rows = torch.stack([torch.randperm(num_rows - 1, generator=g)[:width] + 1 for _ in range(batch)])
    key_pos = torch.cumsum(torch.randint(1, 4, (batch, width), generator=g), dim=1)  # increasing, gaps
    q_pos = torch.empty(batch, dtype=torch.int64)
    for b in range(batch):
        num_pad = (width // 4 + 13 * b) % (width // 2)
        key_pos[b, width - num_pad :] = PAD_POS
        rows[b, width - num_pad :] = 0
        real = width - num_pad
        q_pos[b] = key_pos[b, real - 1 - min(3, real - 1)]  # the last real keys are in the future
        order = torch.randperm(width, generator=g)  # rows in no particular order
        rows[b], key_pos[b] = rows[b, order], key_pos[b, order]
    return Inputs(
        q.to(device, dtype), k_store.to(device, dtype), v_store.to(device, dtype),
        rows.to(device), key_pos.to(device), q_pos.to(device), head_dim**-0.5,
    )  # fmt: skip


def tolerance(dtype: torch.dtype) -> float:
    """The decode kernel's tolerance against its reference in this dtype."""
    return 2e-5 if dtype == torch.float32 else 2e-2  # bf16/fp16: one rounding of the output (and of p on GPU)
