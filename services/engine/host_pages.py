"""KVStoreHostPages: the ring's view of the host KV store (pages written through, read back)."""

from __future__ import annotations

import logging

import torch

from services.engine.write_through import WriteThrough
from services.kvstore.client import KVStoreClient

logger = logging.getLogger(__name__)


class KVStoreHostPages:
    """Implements ring.HostPages over a kvstore client and the engine's write-through."""

    def __init__(
        self, client: KVStoreClient, write_through: WriteThrough, page_shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self._client = client
        self._write_through = write_through
        self._shape = page_shape  # [num_layers, 2, page_size, Hkv, D]
        self._dtype = dtype
        self.num_fetched = 0
        self.fetched_bytes = 0

    def has(self, page_hash: bytes) -> bool:
        return self._write_through.is_written(page_hash)

    def wait(self, page_hashes: list[bytes], timeout_s: float) -> bool:
        return self._write_through.wait_written(page_hashes, timeout_s)

    def fetch(self, page_hashes: list[bytes]) -> list[torch.Tensor]:
        """Pages as [L, 2, page, Hkv, D] CPU tensors; raises PageNotFoundError when one is gone."""
        pages = []
        for h in page_hashes:
            data = self._client.get_page(h)
            pages.append(torch.frombuffer(bytearray(data), dtype=self._dtype).view(self._shape))
            self.fetched_bytes += len(data)
        self.num_fetched += len(page_hashes)
        return pages
