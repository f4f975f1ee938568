"""LocalRings: the device rows of the sliding-window layers, a small ring per running sequence.

A sliding-window layer (Gemma 3's local layers) never reads a key older than its window, so its K/V
does not go through the page pool: each running sequence owns one ring of `span` rows per local layer,
and the token at position p lives in row `ring_id * span + p % span`. Only the global layers' K/V
occupies pool slots (KVPool keeps the local layers' tensors in this row space), so a slot costs
global layers only and the same device bytes hold num_layers / num_global_layers times more pages.

`span` is the window plus a page less one token, rounded up to whole pages, so a page's local rows are
contiguous and a parked ring still holds the window before the start of the page its sequence ended
in. A decode step writes its token's row, then reads the window ending at it; the page it fills is
still in the ring for the write-through (the host copy keeps every layer). A prefill step of
n tokens attends the ring's rows before its first token plus its own new rows, passed in directly
(StepAttention), and then keeps only the last min(n, span) of them: a ring's size never depends on
the prefill chunk. The pages such a step finishes are staged (KVPool.local_stage) for the write-through, since
their first rows may already have left the ring.

The ring ids are allocated by the scheduler when a sequence is admitted; there are as many rings as
sequences may run at once. A sequence that leaves with its ring intact *parks* it under the hash of its
last full page: a later request whose cached prefix ends at that page (the next turn of a chat) takes
the parked ring over as its own (positions map to the same rows, nothing is copied), together with the
start of the tail page that the parked ring also holds. Parked rings count as free: allocate() reclaims
the oldest one when no ring is free.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

import torch

from services.engine.kv.attention import PAD_POS

logger = logging.getLogger(__name__)


class LocalRingsExhaustedError(RuntimeError):
    """Every ring is in use (more running sequences than rings: a scheduler bug, not a request error)."""


def ring_span(window: int, page_size: int) -> int:
    """Rows one sequence's ring holds: the window and the page_size - 1 tokens a sequence may have computed
    past its last full page, rounded up to whole pages."""
    return -(-(window + page_size - 1) // page_size) * page_size


class ParkedRing(NamedTuple):
    """A ring left by a sequence: the rows of positions [written - span, end) hold its K/V (of its tokens);
    rows of positions [end, written) were written ahead (a decode burst cut short by a stop) and are
    rewritten before any read by whoever takes the ring over."""

    ring_id: int
    end: int  # the positions the sequence had computed
    tail: tuple[int, ...]  # its tokens after the last full page, up to `end`
    written: int  # the positions written into the ring (>= end)


class LocalRings:
    """Ring ids of running sequences and the row arithmetic of the local layers' row space."""

    def __init__(self, layer_windows: dict[int, int], span: int, num_rings: int, page_size: int) -> None:
        self.layers = frozenset(layer_windows)  # model layer indices that live here (sliding-window layers)
        self.windows = frozenset(layer_windows.values())
        self.window = max(self.windows)  # the largest window among them
        assert span % page_size == 0 and span >= self.window, (span, self.window, page_size)
        self.span = span  # rows per ring
        self.num_rings = num_rings
        self.page_size = page_size
        self._free = list(range(num_rings - 1, -1, -1))  # stack: ring 0 is handed out first
        self._parked: OrderedDict[bytes, ParkedRing] = OrderedDict()  # by last full page hash, oldest first

    @property
    def num_rows(self) -> int:
        return self.span * self.num_rings

    def num_free(self) -> int:
        """Rings a sequence can get now: free ones and parked ones (reclaimed oldest first)."""
        return len(self._free) + len(self._parked)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def allocate(self) -> int:
        if not self._free and self._parked:
            _, oldest = self._parked.popitem(last=False)
            self._free.append(oldest.ring_id)
        if not self._free:
            raise LocalRingsExhaustedError(f"all {self.num_rings} local rings are in use")
        return self._free.pop()

    def release(self, ring_id: int) -> None:
        assert 0 <= ring_id < self.num_rings and ring_id not in self._free, (ring_id, self._free)
        assert all(p.ring_id != ring_id for p in self._parked.values()), f"ring {ring_id} is parked"
        self._free.append(ring_id)

    def park(self, page_hash: bytes, ring_id: int, end: int, tail: tuple[int, ...], written: int | None = None) -> None:
        """Keep a leaving sequence's ring for a later request whose prefix ends at the page `page_hash`;
        `written`: positions written into it when more than `end` (ParkedRing)."""
        replaced = self._parked.pop(page_hash, None)
        if replaced is not None:
            self._free.append(replaced.ring_id)
        self._parked[page_hash] = ParkedRing(ring_id, end, tail, end if written is None else written)

    def take(self, page_hash: bytes) -> ParkedRing | None:
        """The ring parked under `page_hash`, now owned by the caller (None when there is none)."""
        return self._parked.pop(page_hash, None)

    def covers(self, parked: ParkedRing, position: int) -> bool:
        """The parked ring still holds the window before `position` (<= its end)."""
        return parked.written - self.span <= max(0, position - self.window + 1) and position <= parked.end

    def rows(self, ring_id: int, positions: torch.Tensor) -> torch.Tensor:
        """Rows of token positions [N] (int64, >= 0) in ring `ring_id`."""
        return ring_id * self.span + positions % self.span

    def page_row(self, ring_id: int, page: int) -> int:
        """First row of logical page `page` (its page_size rows follow contiguously)."""
        return ring_id * self.span + (page * self.page_size) % self.span


def ring_read_set(
    ring_base: torch.Tensor, span: int, q_pos: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows and key positions [B, width] of each token's window in its ring: the `width` positions ending at
    the token, position p in row ring_base + p % span; positions before 0 are padding (PAD_POS, never visible)."""
    lpos = q_pos[:, None] - torch.arange(width - 1, -1, -1, device=q_pos.device)  # [B, width]
    rows = ring_base[:, None] + lpos.remainder(span)
    return rows, torch.where(lpos >= 0, lpos, PAD_POS)
