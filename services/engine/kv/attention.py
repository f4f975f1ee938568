"""The interface between the model and the KV cache, and a one-sequence reference implementation."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from services.engine.kernels import triton_module
from services.engine.ring.exact_attention import grouped_attention_lse, rows_to_heads

if TYPE_CHECKING:
    from services.engine.kernels.attention.decode_attention_triton import Partials

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


PROMPT_BUCKET = 1024  # prompt_sdpa pads a chunk (and wants a past) to a multiple of this: one cuDNN plan a length


_PROMPT_REFUSED: set[tuple[torch.dtype, int]] = set()  # (dtype, head_dim) cuDNN would not run in this process
_FA4_REFUSED: set[tuple[torch.dtype, int]] = set()  # (dtype, head_dim) FlashAttention-4 would not run


def prompt_sdpa_fits(q: Tensor, past: int = 0) -> bool:
    """Whether prompt_sdpa takes a chunk of these queries [n, Hq, D] after `past` tokens on CUDA: at least one
    bucket of tokens (shorter ones would pad more than they attend), a past of whole buckets, half precision,
    and not refused before."""
    return (
        q.is_cuda
        and past % PROMPT_BUCKET == 0
        and q.shape[0] >= PROMPT_BUCKET
        and q.dtype in (torch.bfloat16, torch.float16)
        and (q.dtype, q.shape[-1]) not in _PROMPT_REFUSED
    )


def prompt_sdpa_refused(q: Tensor, exc: Exception) -> None:
    """cuDNN refused this (dtype, head_dim) (its build or this torch): logged once, never asked again."""
    _PROMPT_REFUSED.add((q.dtype, q.shape[-1]))
    logger.warning(
        "cuDNN prompt attention refused %s, head_dim %d (%s): the paged kernel instead", q.dtype, q.shape[-1], exc
    )


@functools.cache
def flash_attn4() -> Callable[..., Any] | None:
    """FlashAttention-4's forward (`flash_attn.cute.interface.flash_attn_func`: the flash-attn-4 wheel, CuTe DSL
    kernels for SM90 and SM100, compiled at first use) where it is installed and imports, else None (logged once).
    It takes a chunk after a past in one call (causal aligned bottom-right) and K/V heads shared natively."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as exc:  # noqa: BLE001 -- an optional dependency: any import failure means "not here"
        logger.warning("FlashAttention-4 (flash-attn-4) is not usable here (%s): prompt chunks through cuDNN", exc)
        return None
    return flash_attn_func  # type: ignore[no-any-return]


def prompt_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    past: tuple[Tensor, Tensor] | None = None,
    impl: str = "cudnn",
    joined: bool = False,
) -> Tensor:
    """Causal GQA attention of a prompt chunk over its own keys and, with `past`, every key before it:
    q [n, Hq, D]; k, v [n, Hkv, D] (the step's rows as computed); past (k, v) [P, Hkv, D] the keys before the
    chunk (P a multiple of PROMPT_BUCKET, prompt_sdpa_fits) -> [n, Hq, D], query i seeing keys 0..P + i.
    `joined` (no `past`): k, v are [P + n, Hkv, D], the past's rows and then the chunk's (one gather of a plain
    layer's pool rows, which the chunk has already written: nothing to concatenate for FlashAttention-4).

    `impl` "fa4" (the `fa4` prefill mode) on CUDA where flash_attn4 is usable: FlashAttention-4 over the past and the
    chunk's rows concatenated, one call (no padding, no merge); else, and by default, cuDNN as below.

    On CUDA it is cuDNN's fused attention (K/V heads shared natively): at the 8B shape on the H200 600
    TFLOP/s on a whole 32K prompt and 530-555 on 8K, against 410-420 / 375 for the Triton paged kernel and 345 /
    319 for FlashAttention-2; a chunk after a past as two calls, the past without a mask and the chunk's own
    triangle, merged by their log-sum-exp: 545 TFLOP/s for 8K after 24K against 416 (cuDNN's own lower-right
    mask runs at 254; bench/RESULTS.md, `bench/scale.py --only-attn`). cuDNN builds an execution plan per
    shape (40-70 ms), so the chunk is padded at its end to a multiple of PROMPT_BUCKET (padded keys sit after
    every real query and are never seen, padded queries' rows are dropped) and the past must be one: a length
    class pays its plan once per process. Elsewhere the same function in float32 torch (the reference the
    GPU tests compare with)."""
    n, num_heads, _ = q.shape
    assert not (joined and past is not None), "a joined chunk carries its past in k, v"
    fa4 = flash_attn4() if impl == "fa4" and q.is_cuda and (q.dtype, q.shape[-1]) not in _FA4_REFUSED else None
    if fa4 is not None:
        kk, vv = (k, v) if past is None else (torch.cat((past[0], k)), torch.cat((past[1], v)))
        try:
            return fa4(q[None], kk[None], vv[None], softmax_scale=scale, causal=True)[0][0]  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 -- its checks raise AssertionError too: cuDNN from now on
            _FA4_REFUSED.add((q.dtype, q.shape[-1]))
            logger.warning("FlashAttention-4 refused %s, head_dim %d (%s): cuDNN instead", q.dtype, q.shape[-1], exc)
    if joined and k.shape[0] > n:  # cuDNN (and the torch form) take the past apart
        past, k, v = (k[:-n], v[:-n]), k[-n:], v[-n:]
    assert n >= PROMPT_BUCKET or not q.is_cuda, "a short chunk takes the paged kernel (prompt_sdpa_fits)"
    padded = -(-n // PROMPT_BUCKET) * PROMPT_BUCKET
    if padded != n:  # rows [n, padded) zero
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, padded - n)) for x in (q, k, v))
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D] views of the [T, H, D] rows
    gqa = num_heads != kh.shape[1]
    if past is None and q.is_cuda:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)[:n]  # [n, Hq, D]
    o_own, l_own = _sdpa_lse(qh, kh, vh, True, scale)
    if past is None:
        return o_own[0].transpose(0, 1)[:n].to(q.dtype)
    assert past[0].shape[0] % PROMPT_BUCKET == 0 or not q.is_cuda, "the past must be whole buckets"
    o_past, l_past = _sdpa_lse(qh, past[0].transpose(0, 1)[None], past[1].transpose(0, 1)[None], False, scale)
    # the past's share of each query's softmax mass, exp(l_past) / (exp(l_past) + exp(l_own)), interpolates the
    # two outputs: one Triton pass on that tier (kernels/attention/prefill_attention_triton.lse_merge), else its torch
    # reference (one lerp; the fp32 form before it, five passes over [n, Hq, D], took ~60 ms of a 32K prompt's
    # prefill in chunks of 8K on the H200)
    kernels = triton_module("attention.prefill_attention_triton", q.device)
    merge = kernels.lse_merge if kernels is not None and o_own.dtype == o_past.dtype else lse_merge_torch
    return merge(o_own, l_own, o_past, l_past, n).to(q.dtype)


def lse_merge_torch(o_own: Tensor, l_own: Tensor, o_past: Tensor, l_past: Tensor, n: int) -> Tensor:
    """A prompt chunk's attention from its two parts: o_own, o_past [1, Hq, T, D] (the chunk over its own keys,
    and over the past's) and their log-sum-exps l_own, l_past [1, Hq, T, 1] float32 -> [n, Hq, D] (the first n
    of T rows): the past's share of each query's softmax mass, sigmoid(l_past - l_own), interpolates (the
    reference of kernels/attention/prefill_attention_triton.lse_merge)."""
    share = torch.sigmoid(l_past - l_own).to(o_own.dtype)
    return torch.lerp(o_own, o_past.to(o_own.dtype), share)[0].transpose(0, 1)[:n]


def _sdpa_lse(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Attention [1, Hq, T, D] and its log-sum-exp [1, Hq, T, 1] (float32) of q [1, Hq, T, D] over k, v
    [1, Hkv, S, D]; `causal` top-left aligned (query i sees keys 0..i). cuDNN's fused kernel on CUDA (its
    aten op, the one that returns the log-sum-exp), float32 torch elsewhere."""
    heads, t = q.shape[1], q.shape[2]
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )[:2]
        return out, lse.reshape(1, heads, t, 1).float()
    mask = None
    if causal:  # the additive [G * T, S] mask in grouped_sdpa's row order
        seen = position_mask(torch.arange(t), torch.arange(k.shape[2])).repeat(heads // k.shape[1], 1)
        mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
    out, lse = grouped_attention_lse(q[0].transpose(0, 1), k[0], v[0], mask, scale)  # [Hkv, G * T, D], [Hkv, G * T]
    return rows_to_heads(out, t, heads).transpose(0, 1)[None], lse.reshape(1, heads, t, 1)


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
