"""The interface between the model and the KV cache, and a one-sequence reference implementation."""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)


class AttentionBackend(Protocol):
    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] for the N new tokens of this step (after RoPE and q/k norm).
        Stores k, v in the cache and returns the attention output [N, Hq, D] over the cached
        tokens plus the new ones, causal."""
        ...


class ContiguousKV:
    """AttentionBackend for ONE sequence: per-layer K/V buffers that grow by doubling.

    The new tokens of a step are the next positions of the sequence, in order. Layer i's
    length advances when layer i attends, so every layer must be called once per step.
    GQA goes through grouped_sdpa (query heads folded onto their KV head; K/V never repeated).
    """

    def __init__(self, num_layers: int, initial_capacity: int = 256) -> None:
        self.num_layers = num_layers
        self._initial_capacity = initial_capacity
        self._k: list[Tensor | None] = [None] * num_layers  # each [Hkv, capacity, D]
        self._v: list[Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers
        self._mask_key: tuple[object, ...] | None = None
        self._mask: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens cached in the last layer (= all layers between steps)."""
        return self._lengths[-1]

    def layer_kv(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """The cached K and V of one layer: [Hkv, T, D] each (views, not copies)."""
        k, v = self._k[layer_idx], self._v[layer_idx]
        assert k is not None and v is not None, f"layer {layer_idx} has no tokens"
        length = self._lengths[layer_idx]
        return k[:, :length], v[:, :length]

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
        """Append k, v to layer `layer_idx`, then causal SDPA of q over the whole cache."""
        num_past, num_new = self._lengths[layer_idx], q.shape[0]
        k_all, v_all = self._append(layer_idx, k, v)  # [Hkv, T, D]
        row_mask = self._row_mask(num_past, num_new, q.shape[1] // k.shape[1], q)
        return grouped_sdpa(q, k_all, v_all, row_mask, scale)

    def _row_mask(self, num_past: int, num_new: int, group: int, q: Tensor) -> Tensor | None:
        """The step's additive mask for grouped_sdpa's rows, built once and shared by all layers."""
        if num_new == 1:
            return None  # one new token sees the whole cache
        key = (num_past, num_new, group, q.dtype, q.device)
        if self._mask_key != key:
            allowed = causal_mask(num_past, num_new, q.device).repeat(group, 1)  # [G * N, T]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            self._mask = mask.masked_fill_(~allowed, float("-inf"))
            self._mask_key = key
        return self._mask

    def _append(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        start = self._lengths[layer_idx]
        end = start + k.shape[0]
        self._reserve(layer_idx, k, end)
        k_buf, v_buf = self._k[layer_idx], self._v[layer_idx]
        assert k_buf is not None and v_buf is not None
        k_buf[:, start:end] = k.transpose(0, 1)
        v_buf[:, start:end] = v.transpose(0, 1)
        self._lengths[layer_idx] = end
        return k_buf[:, :end], v_buf[:, :end]

    def _reserve(self, layer_idx: int, like: Tensor, num_tokens: int) -> None:
        """Make layer `layer_idx`'s buffers hold at least `num_tokens` (doubling, copying the prefix)."""
        old_k, old_v = self._k[layer_idx], self._v[layer_idx]
        capacity = 0 if old_k is None else old_k.shape[1]
        if num_tokens <= capacity:
            return
        new_capacity = max(self._initial_capacity, capacity)
        while new_capacity < num_tokens:
            new_capacity *= 2
        num_kv_heads, head_dim = like.shape[1], like.shape[2]
        shape = (num_kv_heads, new_capacity, head_dim)
        new_k = like.new_empty(shape)
        new_v = like.new_empty(shape)
        if old_k is not None and old_v is not None:
            length = self._lengths[layer_idx]
            new_k[:, :length] = old_k[:, :length]
            new_v[:, :length] = old_v[:, :length]
        self._k[layer_idx], self._v[layer_idx] = new_k, new_v


def causal_mask(num_past: int, num_new: int, device: torch.device) -> Tensor:
    """[num_new, num_past + num_new] bool, True where new token i may attend: key j <= num_past + i."""
    keys = torch.arange(num_past + num_new, device=device)
    queries = torch.arange(num_past, num_past + num_new, device=device)
    return keys[None, :] <= queries[:, None]


def grouped_sdpa(q: Tensor, k: Tensor, v: Tensor, row_mask: Tensor | None, scale: float) -> Tensor:
    """GQA attention without repeating K/V: the G query heads sharing a KV head become G x N query rows.

    q: [N, Hq, D]; k, v: [Hkv, T, D]; row_mask: [G * N, T] (bool, or additive float) or None
    -> [N, Hq, D].
    Query head h uses KV head h // G (transformers' repeat_kv order).
    """
    num_new, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # q_rows: [Hkv, G * N, D], row g * N + i is token i of query head kv * G + g
    q_rows = q.view(num_new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)
    # 4-D inputs: the fused (flash / memory-efficient) kernels take only those; 3-D falls back to math
    out = F.scaled_dot_product_attention(q_rows[None], k[None], v[None], attn_mask=row_mask, scale=scale)[0]
    return out.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)
