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
        """Bytes of one page: K and V of every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    @property
    def nbytes(self) -> int:
        return self.page_nbytes * self.num_slots

    def rows(self, slot_ids: torch.Tensor) -> torch.Tensor:
        """Row indices of whole pages: [P] slots -> [P * page_size]."""
        offsets = torch.arange(self.page_size, device=slot_ids.device)
        return (slot_ids[:, None] * self.page_size + offsets[None, :]).reshape(-1)

    def copy_rows(self, src_slot: int, dst_slot: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` rows of one slot into another, in every layer."""
        src, dst = src_slot * self.page_size, dst_slot * self.page_size
        for i in range(self.num_layers):
            self.k[i][dst : dst + num_tokens].copy_(self.k[i][src : src + num_tokens])
            self.v[i][dst : dst + num_tokens].copy_(self.v[i][src : src + num_tokens])

    def read_page(self, slot: int) -> torch.Tensor:
        """A copy of one page as [num_layers, 2, page_size, num_kv_heads, head_dim] on the pool's device."""
        lo, hi = slot * self.page_size, (slot + 1) * self.page_size
        return torch.stack([torch.stack((self.k[i][lo:hi], self.v[i][lo:hi])) for i in range(self.num_layers)])

    def write_page(self, slot: int, page: torch.Tensor) -> None:
        """Inverse of read_page: copy a [num_layers, 2, page_size, H, D] page into `slot`."""
        lo, hi = slot * self.page_size, (slot + 1) * self.page_size
        page = page.to(device=self.device, dtype=self.dtype)
        for i in range(self.num_layers):
            self.k[i][lo:hi].copy_(page[i, 0])
            self.v[i][lo:hi].copy_(page[i, 1])
