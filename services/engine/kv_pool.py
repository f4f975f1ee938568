"""KVPool: the device tensors that hold K and V for every slot of every KV-bearing layer."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class KVPool:
    """Per layer, K and V as [num_slots * page_size, num_kv_heads, head_dim] (token-major rows).

    Row `slot * page_size + offset` holds the token at `offset` inside the page stored in `slot`.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        rows = num_slots * page_size
        shape = (rows, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        logger.info(
            "KV pool: %d slots x %d tokens, %d layers, %d kv heads x %d, %s on %s: %.1f MiB",
            num_slots,
            page_size,
            num_layers,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            self.nbytes / 2**20,
        )

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page in its stored format: K and V of every layer (the host copy's size)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.page_nbytes * self.num_slots

    def rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Row indices of whole pages: [P] slots -> [P * page_size]."""
        offsets = torch.arange(self.page_size, device=slot_ids.device)
        return (slot_ids[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    # -- token rows (the attention pass) -------------------------------------------------------------

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K/V of new tokens: rows [N] pool rows; k, v [N, Hkv, D] in the compute dtype."""
        self.k[layer].index_copy_(0, rows, k.to(self.dtype))
        self.v[layer].index_copy_(0, rows, v.to(self.dtype))

    def gather(self, layer: int, rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `rows` [T] as [T, Hkv, D] each in `dtype` (the attention window, dequantised)."""
        return self.k[layer].index_select(0, rows).to(dtype), self.v[layer].index_select(0, rows).to(dtype)

    def gather_keys(self, layer: int, rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Only the keys of `rows` [T] -> [T, Hkv, D] in `dtype` (page summaries)."""
        return self.k[layer].index_select(0, rows).to(dtype)

    def copy_rows(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` rows of one slot into another, in every layer."""
        src, dst = src_slot * self.page_size, dst_slot * self.page_size
        for i in range(self.num_layers):
            self.k[i][dst : dst + num_tokens].copy_(self.k[i][src : src + num_tokens])
            self.v[i][dst : dst + num_tokens].copy_(self.v[i][src : src + num_tokens])

    # -- whole pages (write-through, restore): flat bytes in the stored format -----------------------

    def read_page(self, slot: int) -> torch.Tensor:
        """A copy of one page as uint8 [page_nbytes] on the pool's device: layer by layer, K then V,
        each [page_size, Hkv, D] in the stored format (the bytes the host store keeps)."""
        lo, hi = slot * self.page_size, (slot + 1) * self.page_size
        parts = [t[lo:hi].reshape(-1) for i in range(self.num_layers) for t in (self.k[i], self.v[i])]
        return torch.cat(parts).view(torch.uint8)

    def write_pages(self, slots: list[int], pages: torch.Tensor) -> None:
        """Inverse of read_page for a batch: pages uint8 [P, page_nbytes] (any device) into `slots`."""
        if not slots:
            return
        data = pages.to(self.device, non_blocking=True).view(self.dtype)
        data = data.view(len(slots), self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        rows = self.rows(torch.tensor(slots, dtype=torch.long, device=self.device))
        for i in range(self.num_layers):
            self.k[i].index_copy_(0, rows, data[:, i, 0].reshape(-1, self.num_kv_heads, self.head_dim))
            self.v[i].index_copy_(0, rows, data[:, i, 1].reshape(-1, self.num_kv_heads, self.head_dim))

    def write_page(self, slot: int, page: torch.Tensor) -> None:
        """One page (uint8 [page_nbytes]) into `slot`."""
        self.write_pages([slot], page.reshape(1, -1))

    def page_kv(self, page: torch.Tensor, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer of a page held as bytes (a host page): [page_size, Hkv, D] each in `dtype`,
        on the page's device."""
        data = page.view(self.dtype).view(self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        return data[layer, 0].to(dtype), data[layer, 1].to(dtype)
