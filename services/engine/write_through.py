"""WriteThrough: copies every finished page to the kvstore (the authoritative host copy), off the step loop."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

import torch

from services.kvstore.client import KVStoreClient, PageMeta

logger = logging.getLogger(__name__)


class PendingPage(NamedTuple):
    page_hash: bytes
    data: torch.Tensor  # [layers, 2, page_size, H, D] on the CPU, already copied out of the pool
    num_tokens: int


class WriteThrough:
    """A bounded queue and one writer thread per engine; the step loop only enqueues a CPU copy."""

    def __init__(self, client: KVStoreClient, kv_format: str, max_pending: int) -> None:
        self._client = client
        self._kv_format = kv_format
        self._queue: queue.Queue[PendingPage | None] = queue.Queue(maxsize=max_pending)
        self.num_written = 0
        self.num_failed = 0
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="write-through", daemon=True)
        self._thread.start()

    def submit(self, page_hash: bytes, page: torch.Tensor, num_tokens: int) -> None:
        """Queue a page; when the writer is behind, drop it (counted) rather than stall decoding."""
        try:
            self._queue.put_nowait(PendingPage(page_hash, page.to("cpu", copy=True), num_tokens))
        except queue.Full:
            self.num_dropped += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued page has been handled (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._client.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            finally:
                self._queue.task_done()

    def _write(self, item: PendingPage) -> None:
        data = item.data.contiguous().view(torch.uint8).numpy().reshape(-1)
        meta = PageMeta(
            page_hash=item.page_hash, kv_format=self._kv_format, num_tokens=item.num_tokens, nbytes=data.nbytes
        )
        try:
            self._client.put_page(meta, data.data)
            self.num_written += 1
        except Exception as exc:  # the host copy is best effort here; the pool copy stays valid
            self.num_failed += 1
            logger.warning("write-through of page %s failed: %s", item.page_hash.hex(), exc)
