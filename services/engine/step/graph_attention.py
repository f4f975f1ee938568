"""The decode graph's attention (step/decode_graph.py): one decode step's AttentionBackend over a bucket's static
buffers (`GraphBuffers`: B sequences of one token each, their read sets padded to W rows), reading the pool in
place through the flash-decoding kernel where it applies, else gathered rows and one batched masked SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.kernels import triton_module
from services.engine.kv.attention import KVSink, sdpa
from services.engine.kv.kv_pool import KVPool
from services.engine.ring.local_ring import ring_read_set

if TYPE_CHECKING:
    from services.engine.kernels.attention.decode_attention_triton import Partials

# every read set here lists its rows by position (pages in order, the padding at PAD_POS last): the flash-
# decoding kernel may skip the splits past the token (kernels/attention/decode_attention_triton.py, `sorted_keys`)
SORTED_READS = True


@dataclass
class GraphBuffers:
    """Static inputs (and, once captured, the output) of one (B, W) bucket."""

    batch: int
    window: int
    ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    write_rows: torch.Tensor  # [B]
    rows: torch.Tensor  # [B, W]
    key_pos: torch.Tensor  # [B, W]
    rows_next: torch.Tensor  # [B, W] the read set a row switches to inside a burst (work.Switch)
    key_pos_next: torch.Tensor  # [B, W]
    local_rows: dict[int, torch.Tensor]  # window -> [B, L]
    local_pos: dict[int, torch.Tensor]  # window -> [B, L]
    ring_base: torch.Tensor  # [B] first row of each sequence's local ring (local rings only)
    state_slots: torch.Tensor  # [B] each row's recurrent-state slot (recurrent models; else zeros)
    slot_staging: torch.Tensor  # [2, B] host copies of state_slots, used in turn with `staging`
    step: torch.Tensor  # [1] the step's index in its burst (where its argmax goes in burst_tokens)
    keep_pos: torch.Tensor  # [B] the position whose query a row keeps in `queries`; < 0: every step's
    switch_pos: torch.Tensor  # [B] the first position that reads rows_next / key_pos_next; PAD_POS: none
    inputs: torch.Tensor  # [7, B] ids, positions, write_rows, ring_base, step (each column), keep_pos, switch_pos
    staging: torch.Tensor  # [2, 7, B] host copies of `inputs` (pinned on CUDA), used in turn
    burst_tokens: torch.Tensor  # [page_size, B] the argmax of each step of a burst
    queries: torch.Tensor  # [L, B, Hq, D] each layer's queries (after RoPE), kept for page scoring
    # per batch row: the read set key its rows came from (None: unknown, e.g. switched inside a burst)
    owners: list[tuple[object, ...] | None]
    turn: int = 0  # the half of `staging` the next fill writes
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None  # [B, V] the captured graph's logits

    @property
    def reads(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows, key_pos, rows_next, key_pos_next: what the end of a step switches (decode_graph.advance_inputs)."""
        return self.rows, self.key_pos, self.rows_next, self.key_pos_next


class GraphAttention:
    """AttentionBackend of one decode step over a bucket's static buffers (B sequences, 1 token each)."""

    def __init__(self, pool: KVPool, bufs: GraphBuffers, dtype: torch.dtype, sinks: bool = True) -> None:
        self.pool = pool
        self.bufs = bufs
        self.dtype = dtype
        self.kernels = triton_module("attention.decode_attention_triton", pool.device)
        self.sinks = sinks  # offer kv_sink (the model writes K/V in its q/k norm + RoPE launch)
        # additive masks [B, 1, 1, W|L] by (read set, window), built on first use: only the SDPA path needs
        # them (the fused kernel masks from the positions itself)
        self._masks: dict[tuple[str, int | None], torch.Tensor] = {}
        local = pool.local
        if local is not None:  # the token's row in its sequence's ring
            self.ring_write = bufs.ring_base + bufs.positions.remainder(local.span)
        self._ring_read: tuple[torch.Tensor, torch.Tensor] | None = None  # built only for the SDPA path

    def kv_sink(self, layer_idx: int) -> KVSink | None:
        """The layer's plain K/V stores and the step's rows in them (the ring rows of a local layer), on the
        Triton tier: the model's q/k norm + RoPE launch writes the new rows (one launch fewer a layer)."""
        plain = self.pool.plain_kv(layer_idx)
        if not self.sinks or self.kernels is None or plain is None or not self.kernels.supported(plain[0]):
            return None
        rows = self.ring_write if self.pool.is_local(layer_idx) else self.bufs.write_rows
        return plain[0], plain[1], rows

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        window: int | None = None,
        stored: bool = False,
        partial: bool = False,
    ) -> torch.Tensor | Partials:
        """q: [B, Hq, D]; k, v: [B, Hkv, D] -> [B, Hq, D] (one token per sequence); `stored`: the model
        wrote k, v into kv_sink's rows; `partial`: the fused kernel's unmerged Partials where it splits."""
        bufs = self.bufs
        if self.pool.is_local(layer_idx):
            assert window is not None and self.pool.local is not None
            local = self.pool.local
            if not stored:
                self.pool.write(layer_idx, self.ring_write, k, v)
            fused = self._fused_stores(layer_idx, local.window, fp8=False)  # the ring read: plain layers only
            if fused is not None:  # the window before each token, rows by arithmetic
                return self.kernels.decode_attention_ring(  # type: ignore[union-attr,no-any-return]
                    q, *fused[0], bufs.ring_base, local.span, bufs.positions, scale, local.window, window,
                    partial=partial,
                )  # fmt: skip
            if self._ring_read is None:  # the same window for every sliding layer of the step
                self._ring_read = ring_read_set(bufs.ring_base, local.span, bufs.positions, local.window)
            rows, key_pos = self._ring_read
            return self._sdpa(layer_idx, q, k.shape[1], "ring", rows, key_pos, window, scale)
        if not stored:
            self.pool.write(layer_idx, bufs.write_rows, k, v)
        if window is not None and window in bufs.local_rows:  # a sliding layer's last pages only
            return self._sdpa(layer_idx, q, k.shape[1], "local", bufs.local_rows[window], bufs.local_pos[window],
                              window, scale, partial, keep_q=True)  # fmt: skip
        return self._sdpa(layer_idx, q, k.shape[1], "rows", bufs.rows, bufs.key_pos, window, scale, partial, True)

    def _sdpa(
        self,
        layer_idx: int,
        q: torch.Tensor,
        num_kv_heads: int,
        read_set: str,
        rows: torch.Tensor,
        key_pos: torch.Tensor,
        window: int | None,
        scale: float,
        partial: bool = False,
        keep_q: bool = False,
    ) -> torch.Tensor | Partials:
        """q [B, Hq, D] over the pool rows [B, W] of the layer at positions key_pos [B, W]: the fused kernel
        where it applies (`partial`: its Partials where it splits), else gathered rows and SDPA with the
        additive mask of (read_set, window). `keep_q`: q is also kept in the step's queries (page scoring
        reads them after a scoring step), by the fused kernel itself or by a copy, in the batch rows whose
        keep_pos is < 0 or this step's position (a burst keeps the query of its scoring step)."""
        batch, width = rows.shape
        fused = self._fused_stores(layer_idx, width)
        kept = self.bufs.queries[layer_idx] if keep_q else None
        if fused is not None:
            return self.kernels.decode_attention(  # type: ignore[union-attr,no-any-return]
                q, *fused[0], rows, key_pos, self.bufs.positions, scale, window, partial=partial, keep_q=kept,
                keep_pos=self.bufs.keep_pos, sorted_keys=SORTED_READS, fp8=fused[1],
            )  # fmt: skip
        if kept is not None:  # the fused kernel's rule: keep_pos < 0 (every step) or the step at keep_pos
            keep_pos = self.bufs.keep_pos
            keep = (keep_pos < 0) | (self.bufs.positions == keep_pos)
            kept.copy_(torch.where(keep[:, None, None], q, kept))
        num_heads, head_dim = q.shape[1], q.shape[2]
        k_w, v_w = self.pool.gather(layer_idx, rows.reshape(-1), q.dtype)  # [B * W, Hkv, D]
        k_w = k_w.view(batch, width, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, W, D]
        v_w = v_w.view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
        q_g = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
        mask = self._mask(read_set, key_pos, window)
        out = sdpa(q_g, k_w, v_w, mask, scale)  # [B, Hkv, G, D]
        return out.reshape(batch, num_heads, head_dim)

    def _fused_stores(
        self, layer_idx: int, width: int, fp8: bool = True
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], bool] | None:
        """(the layer's K and V stores, whether they are fp8 rows) when the flash-decoding kernel reads `width`
        rows of it (the Triton tier, a plain-format layer or with `fp8` a plain-fp8 one, whole pages); None:
        gather + SDPA."""
        kernels = self.kernels
        if kernels is None or width % kernels.PAGE_ROWS:
            return None
        plain = self.pool.plain_kv(layer_idx)
        if plain is not None:
            return (plain, False) if kernels.supported(plain[0]) else None
        fp8_rows = self.pool.fp8_kv(layer_idx) if fp8 else None
        if fp8_rows is not None and kernels.supported(fp8_rows[0], fp8=True):
            return fp8_rows, True
        return None

    def _mask(self, read_set: str, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
        """Causal (and sliding-window) additive mask of the keys at key_pos [B, W], once per step."""
        mask = self._masks.get((read_set, window))
        if mask is None:
            q_pos = self.bufs.positions[:, None]  # [B, 1]
            allowed = key_pos <= q_pos
            if window is not None:
                allowed &= key_pos > q_pos - window
            mask = self._masks[(read_set, window)] = _additive(allowed, self.dtype)
        return mask


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [B, W] -> additive [B, 1, 1, W] (0 where allowed, -inf elsewhere)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, float("-inf")).to(dtype)[:, None, None, :]
