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

MAX_BATCH = 64  # pages per put_pages call (a ring chunk of 2,048 tokens finishes 32)


class PendingPage(NamedTuple):
    page_hash: bytes
    data: torch.Tensor  # uint8 [page_nbytes] on the CPU (a row of KVPool.read_pages), copied out of the pool
    num_tokens: int
    ready: torch.cuda.Event | None = None  # the copy into `data` is done once this event has completed


class WriteThrough:
    """A bounded queue and one writer thread per engine; the step loop only enqueues a CPU copy."""

    def __init__(self, client: KVStoreClient, kv_format: str, max_pending: int) -> None:
        self._client = client
        self._kv_format = kv_format
        self._queue: queue.Queue[PendingPage | None] = queue.Queue(maxsize=max_pending)
        self.num_written = 0
        self.num_failed = 0
        self.num_dropped = 0
        self._written: set[bytes] = set()  # pages whose host copy is known to exist
        self._queued: set[bytes] = set()
        self._written_cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="write-through", daemon=True)
        self._thread.start()

    def submit(
        self,
        page_hash: bytes,
        page: torch.Tensor,
        num_tokens: int,
        timeout_s: float = 30.0,
        ready: torch.cuda.Event | None = None,
    ) -> None:
        """Queue a page (unless it is written or queued already); when the writer is behind, wait for
        room (the ring relies on host copies), and only after `timeout_s` drop it (counted). A CPU `page`
        is handed over as it is (the caller's own copy, never changed afterwards; still arriving from the
        device until `ready` completes: the writer waits for it); a device one is copied."""
        with self._written_cond:
            if page_hash in self._written or page_hash in self._queued:
                return
            self._queued.add(page_hash)
        try:
            data = page if page.device.type == "cpu" else page.to("cpu")
            self._queue.put(PendingPage(page_hash, data, num_tokens, ready), timeout=timeout_s)
        except queue.Full:
            with self._written_cond:
                self._queued.discard(page_hash)
                self._written_cond.notify_all()
            self.num_dropped += 1
            logger.error("write-through queue full for %.0f s: page %s dropped", timeout_s, page_hash.hex())

    def mark_written(self, page_hashes: list[bytes]) -> None:
        """Pages found in the store already (e.g. written by another engine)."""
        with self._written_cond:
            self._written.update(page_hashes)
            self._written_cond.notify_all()

    def forget(self, page_hashes: list[bytes]) -> None:
        """The store lost these pages (a replica went away): write them again when they are recomputed."""
        with self._written_cond:
            self._written.difference_update(page_hashes)

    def wants(self, page_hash: bytes) -> bool:
        """True unless the page is written or queued already (saves copying it out of the pool)."""
        return page_hash not in self._written and page_hash not in self._queued

    def is_written(self, page_hash: bytes) -> bool:
        return page_hash in self._written

    def wait_written(self, page_hashes: list[bytes], timeout_s: float, queued_ok: bool = False) -> bool:
        """Block until every page has been written (or found present) in the store, or with `queued_ok` is
        written or queued (its bytes handed over, on their way to the store); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._written_cond:
            while not all(h in self._written or (queued_ok and h in self._queued) for h in page_hashes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._written_cond.wait(left)
        return True

    def wait_settled(self, page_hashes: list[bytes], timeout_s: float) -> bool:
        """Block until none of these pages is queued (each written, or its write failed or dropped): a read of
        the store after it finds every page that was on its way; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._written_cond:
            while any(h in self._queued for h in page_hashes):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._written_cond.wait(left)
        return True

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
        """Write what is queued in batches: one blocking get, then whatever else is already waiting (up to
        MAX_BATCH pages) goes into the same put_pages call (one reserve/commit round trip, not one per page)."""
        while True:
            batch = [self._queue.get()]
            while len(batch) < MAX_BATCH and batch[-1] is not None:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            pages = [item for item in batch if item is not None]
            try:
                if pages:
                    self._write(pages)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _write(self, items: list[PendingPage]) -> None:
        """Put a batch; any failure (the copy's event, the store) leaves its pages unwritten, counted and no longer
        queued, and the writer thread running (a thread that died here left every later page queued forever)."""
        hashes = [item.page_hash for item in items]
        try:
            puts = []
            for item in items:
                if item.ready is not None:
                    item.ready.synchronize()
                data = item.data.contiguous().view(torch.uint8).numpy().reshape(-1)
                meta = PageMeta(
                    page_hash=item.page_hash, kv_format=self._kv_format, num_tokens=item.num_tokens, nbytes=data.nbytes
                )
                puts.append((meta, data.data))
            self._client.put_pages(puts)
            self.num_written += len(items)
            with self._written_cond:
                self._written.update(hashes)
                self._written_cond.notify_all()
        except Exception as exc:  # the pool copies stay valid; the ring will not demote these pages
            self.num_failed += len(items)
            logger.warning("write-through of %d page(s) (first %s) failed: %s", len(items), hashes[0].hex(), exc)
        finally:
            with self._written_cond:
                self._queued.difference_update(hashes)
                self._written_cond.notify_all()
