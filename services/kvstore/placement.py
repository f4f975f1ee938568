"""HashRing: which kvstore replica a page hash is placed on (consistent hashing with virtual nodes).

Each replica owns `vnodes` points on a 64-bit ring (blake2b of "replica_id/i"); a page belongs to the
first point at or after blake2b of its hash. Adding or
removing a replica moves only the pages of the arcs it gains or loses, about 1/N of them.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

DEFAULT_VNODES = 64


class EmptyRingError(LookupError):
    """No replica to place a page on."""


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def page_point(page_hash: bytes) -> int:
    """Where a page hash falls on the ring (hashed again: ids that are not uniform spread too)."""
    return int.from_bytes(hashlib.blake2b(page_hash, digest_size=8).digest(), "big")


class HashRing:
    """An immutable ring over a set of replica ids."""

    def __init__(self, replica_ids: Iterable[str], vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.replica_ids = frozenset(replica_ids)
        self.vnodes = vnodes
        ring = sorted((_point(f"{rid}/{i}"), rid) for rid in self.replica_ids for i in range(vnodes))
        self._points = [p for p, _ in ring]
        self._owners = [rid for _, rid in ring]

    def __len__(self) -> int:
        return len(self.replica_ids)

    def owner(self, page_hash: bytes) -> str:
        """The replica a page is placed on."""
        if not self._points:
            raise EmptyRingError("no kvstore replica is alive")
        i = bisect.bisect_left(self._points, page_point(page_hash))
        return self._owners[i % len(self._owners)]

    def owners(self, page_hash: bytes, n: int) -> list[str]:
        """The first n distinct replicas clockwise from the page (its owner first)."""
        if not self._points:
            raise EmptyRingError("no kvstore replica is alive")
        start = bisect.bisect_left(self._points, page_point(page_hash))
        out: list[str] = []
        for k in range(len(self._owners)):
            rid = self._owners[(start + k) % len(self._owners)]
            if rid not in out:
                out.append(rid)
                if len(out) == n:
                    break
        return out

    def without(self, replica_id: str) -> HashRing:
        """The ring with one replica removed."""
        return HashRing(self.replica_ids - {replica_id}, self.vnodes)
