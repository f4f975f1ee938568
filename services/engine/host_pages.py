"""KVStoreHostPages: the ring's view of the host KV store (pages written through, pinned, read back)."""

from __future__ import annotations

import logging

import numpy as np
import torch

from services.engine.ring import PagesLostError
from services.engine.write_through import WriteThrough
from services.kvstore.client import KVStoreClient, PageNotFoundError

logger = logging.getLogger(__name__)


class KVStoreHostPages:
    """Implements ring.HostPages over a kvstore client and the engine's write-through.

    Pages a running sequence relies on are pinned under the engine's owner id (the store never
    evicts a pinned page; pins lapse if the engine dies). Reads are batched: on the same host they
    are views into the store's arena, copied once into the returned tensors.
    """

    def __init__(
        self,
        client: KVStoreClient,
        write_through: WriteThrough,
        page_nbytes: int,
        owner_id: str = "",
    ) -> None:
        self._client = client
        self._write_through = write_through
        self._page_nbytes = page_nbytes  # KVPool.page_nbytes: pages travel as bytes in their stored format
        self._owner = owner_id
        self.num_fetched = 0
        self.fetched_bytes = 0

    def has(self, page_hash: bytes) -> bool:
        return self._write_through.is_written(page_hash)

    def wait(self, page_hashes: list[bytes], timeout_s: float) -> bool:
        return self._write_through.wait_written(page_hashes, timeout_s)

    def leading_present(self, page_hashes: list[bytes]) -> int:
        """How many leading pages of a hash chain the store holds (they count as written through)."""
        if not page_hashes:
            return 0
        found = 0
        for loc in self._client.lookup(page_hashes):
            if not loc.found:
                break
            found += 1
        self._write_through.mark_written(page_hashes[:found])
        return found

    def fetch(self, page_hashes: list[bytes]) -> list[torch.Tensor]:
        """Pages as uint8 [page_nbytes] CPU tensors (KVPool.read_page's layout), in one batched read; PagesLostError when any is gone."""
        try:
            batch = self._client.get_pages(page_hashes)
        except PageNotFoundError as exc:
            lost = list(getattr(exc, "page_hashes", None) or page_hashes)
            self._write_through.forget(lost)
            raise PagesLostError(lost) from exc
        with batch:
            pages = [self._tensor(data) for data in batch]
        wrong = [h for h, p in zip(page_hashes, pages, strict=True) if p.numel() != self._page_nbytes]
        if wrong:  # another KV format or model under the same hash: unusable here, recompute
            logger.error("%d host page(s) are not %d bytes; treating them as lost", len(wrong), self._page_nbytes)
            self._write_through.forget(wrong)
            raise PagesLostError(wrong)
        self.num_fetched += len(pages)
        self.fetched_bytes += sum(p.numel() * p.element_size() for p in pages)
        return pages

    def pin(self, page_hashes: list[bytes]) -> None:
        if self._owner and page_hashes:
            self._client.pin(self._owner, page_hashes)

    def unpin(self, page_hashes: list[bytes]) -> None:
        if self._owner and page_hashes:
            try:
                self._client.unpin(self._owner, page_hashes)
            except Exception as exc:  # pins lapse by themselves; never fail a request over this
                logger.warning("unpin of %d page(s) failed: %s", len(page_hashes), exc)

    def _tensor(self, data: object) -> torch.Tensor:
        raw = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]
        return torch.from_numpy(raw.copy())
