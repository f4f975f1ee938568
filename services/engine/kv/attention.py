"""The interface between the model and the KV cache, and a one-sequence reference implementation."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

if TYPE_CHECKING:
    from services.engine.kernels.decode_attention_triton import Partials

logger = logging.getLogger(__name__)

PAD_POS = 1 << 40  # key position of a padding row in a read set: after every query, so never visible


KVSink = tuple[Tensor, Tensor, Tensor]  # (k_store, v_store [R, Hkv, D], rows [N] int64): where new K/V rows go


class AttentionBackend(Protocol):
    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        window: int | None = None,
        stored: bool = False,
        partial: bool = False,
    ) -> Tensor | Partials:
        """q: [N, Hq, D]; k, v: [N, Hkv, D] for the N new tokens of this step (after RoPE and q/k norm).
        Stores k, v in the cache (unless `stored`: the model wrote them into this layer's kv_sink) and
        returns the attention output [N, Hq, D] over the cached tokens plus the new ones, causal. With a
        `window` (a sliding-window layer), the query at position p sees only keys at positions > p - window:
        itself and the window - 1 before it (transformers' sliding_window_overlay); see causal_mask.
        `partial`: the caller (the block kernel's forward, which merges them itself) takes the split
        kernel's unmerged Partials where a backend's kernel leaves several; every other case is the output."""
        ...

    def kv_sink(self, layer_idx: int) -> KVSink | None:
        """Where this layer's new K/V rows go, when the model may write them itself in its q/k norm + RoPE
        launch (the decode graphs' plain-format stores); None: attend stores them."""
        ...


class ContiguousKV:
    """AttentionBackend for ONE sequence: per-layer K/V buffers that grow by doubling.

    The new tokens of a step are the next positions of the sequence, in order. Layer i's
    length advances when layer i attends, so every layer must be called once per step.
    GQA goes through grouped_sdpa (query heads folded onto their KV head; K/V never repeated).
    Sliding-window layers keep every token too (this is the reference, not a ring) but attend
    only over the keys their window can still reach.
    """

    def __init__(self, num_layers: int, initial_capacity: int = 256) -> None:
        self.num_layers = num_layers
        self._initial_capacity = initial_capacity
        self._k: list[Tensor | None] = [None] * num_layers  # each [Hkv, capacity, D]
        self._v: list[Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers
        # window -> (key, additive mask): one mask per window size, shared by the layers that use it
        self._masks: dict[int | None, tuple[tuple[object, ...], Tensor]] = {}

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

    def kv_sink(self, layer_idx: int) -> KVSink | None:
        return None

    def attend(
        self,
        layer_idx: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        window: int | None = None,
        stored: bool = False,
        partial: bool = False,
    ) -> Tensor:
        """Append k, v to layer `layer_idx`, then causal (optionally sliding-window) SDPA of q over the cache
        (the output, `partial` or not)."""
        assert not stored, "ContiguousKV has no sink"
        num_past, num_new = self._lengths[layer_idx], q.shape[0]
        k_all, v_all = self._append(layer_idx, k, v)  # [Hkv, T, D]
        first = first_visible_key(num_past, window)  # keys before it are out of every new token's window
        row_mask = self._row_mask(num_past, num_new, q.shape[1] // k.shape[1], q, window)  # [G * N, T - first]
        return grouped_sdpa(q, k_all[:, first:], v_all[:, first:], row_mask, scale)

    def _row_mask(self, num_past: int, num_new: int, group: int, q: Tensor, window: int | None) -> Tensor | None:
        """The step's additive mask for grouped_sdpa's rows over keys first_visible_key.., shared by layers."""
        if num_new == 1:
            return None  # one new token sees every key from the first visible one
        key = (num_past, num_new, group, q.dtype, q.device)
        cached = self._masks.get(window)
        if cached is None or cached[0] != key:
            first = first_visible_key(num_past, window)
            allowed = causal_mask(num_past, num_new, q.device, window)[:, first:].repeat(group, 1)  # [G * N, T']
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            cached = key, mask.masked_fill_(~allowed, float("-inf"))
            self._masks[window] = cached
        return cached[1]

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


def causal_mask(num_past: int, num_new: int, device: torch.device, window: int | None = None) -> Tensor:
    """[num_new, num_past + num_new] bool, True where new token i (position p = num_past + i) may
    attend key j: j <= p, and with a window also j > p - window (the query and the window - 1
    keys before it; transformers' sliding-window mask, `kv_idx > q_idx - sliding_window`)."""
    keys = torch.arange(num_past + num_new, device=device)
    queries = torch.arange(num_past, num_past + num_new, device=device)
    return position_mask(queries, keys, window)


def position_mask(query_pos: Tensor, key_pos: Tensor, window: int | None = None) -> Tensor:
    """[n, T] bool from positions (keys may have gaps, e.g. pages not resident): True where query i
    may attend key j, key_pos[j] <= query_pos[i] and, with a window, key_pos[j] > query_pos[i] - window."""
    allowed = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_pos[:, None] - window
    return allowed


def first_visible_key(num_past: int, window: int | None) -> int:
    """The oldest key position any of a step's new tokens can see (0 without a window):
    the first new token, at position num_past, sees keys > num_past - window."""
    return 0 if window is None else max(0, num_past + 1 - window)


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
    out = sdpa(q_rows[None], k[None], v[None], row_mask, scale)[0]
    return out.view(num_kv_heads, group, num_new, head_dim).permute(2, 0, 1, 3).reshape(num_new, num_heads, head_dim)


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal GQA attention of the last n of T positions, no mask tensor: q [n, Hq, D]; k, v [Hkv, T, D]
    (T >= n, keys at positions 0..T-1) -> [n, Hq, D], query i (position T - n + i) seeing keys 0..T - n + i.

    torch's lower-right causal bias (torch.nn.attention.bias.causal_lower_right) with enable_gqa: on CUDA
    it runs the FlashAttention-2 kernel (causal, bottom-right aligned, K/V heads shared natively), which
    skips the masked tiles and reads no [G * n, T] additive mask; elsewhere torch materialises the same
    mask (the math path). The same function as grouped_sdpa with position_mask's causal mask."""
    n, num_heads, _ = q.shape
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    bias = causal_lower_right(n, k.shape[1])
    out = sdpa(qh, k[None], v[None], bias, scale, enable_gqa=num_heads != k.shape[0])  # type: ignore[arg-type]
    return out[0].transpose(0, 1)  # [n, Hq, D]


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, enable_gqa: bool = False) -> Tensor:
    """F.scaled_dot_product_attention (4-D inputs) without the cuDNN backend on CUDA. cuDNN builds an
    execution plan for every new shape (40-70 ms each on the H200, the first ~1.8 s; bench/RESULTS.md), and a
    step's key count changes with every chunk, prompt and selection, so its first use of a shape cost more
    than the attention: a first 8K prompt through the ring took 12 s. The memory-efficient kernel takes the
    same additive masks with no per-shape build, as fast or faster at these shapes (same table). The switch is
    process-wide while the call runs (torch keeps it global): the engine attends from one thread."""
    if not (q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
