"""PinTable: pages pinned by owners (an engine's running sequences, a reader's lease).

A pinned page is never evicted nor compressed. Every owner has a deadline; an owner that is not
renewed (pin, renew) before it loses all its pins, so a crashed engine cannot hold pages forever.
Pins are counted: an owner that pins a page twice must unpin it twice (or unpin everything at once).
Not thread-safe: the PageStore calls it under its lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Owner:
    deadline: float
    pin_table: Counter[bytes] = field(default_factory=Counter)  # page hash -> pins held


class PinTable:
    """Owner -> pinned pages, and page -> total pins over every owner."""

    def __init__(self) -> None:
        self._owner_table: dict[str, _Owner] = {}
        self._num_pins: Counter[bytes] = Counter()

    def pin(self, owner_id: str, page_hashes: Iterable[bytes], deadline: float) -> None:
        """Pin each page once more for owner_id and move the owner's deadline to `deadline`."""
        owner = self._owner_table.setdefault(owner_id, _Owner(deadline))
        owner.deadline = max(owner.deadline, deadline)
        for h in page_hashes:
            owner.pin_table[h] += 1
            self._num_pins[h] += 1

    def renew(self, owner_id: str, deadline: float) -> bool:
        """Move the owner's deadline (its heartbeat); False when the owner holds nothing (expired or unknown)."""
        owner = self._owner_table.get(owner_id)
        if owner is None:
            return False
        owner.deadline = max(owner.deadline, deadline)
        return True

    def unpin(self, owner_id: str, page_hashes: Iterable[bytes] | None = None) -> list[bytes]:
        """Drop one pin per listed page (every pin of the owner when None); returns pages left unpinned."""
        owner = self._owner_table.get(owner_id)
        if owner is None:
            return []
        released: Counter[bytes] = Counter()
        if page_hashes is None:
            released, owner.pin_table = owner.pin_table, Counter()
        else:
            for h in page_hashes:
                if owner.pin_table[h] > 0:
                    owner.pin_table[h] -= 1
                    released[h] += 1
            owner.pin_table = +owner.pin_table  # drop zero counts
        if not owner.pin_table:
            del self._owner_table[owner_id]
        return self._release(released)

    def expire(self, now: float) -> list[str]:
        """Drop every owner whose deadline has passed; returns their ids."""
        expired = [o for o, owner in self._owner_table.items() if owner.deadline < now]
        for owner_id in expired:
            owner = self._owner_table.pop(owner_id)
            self._release(owner.pin_table)
            logger.warning("pins of owner %s expired (%d pages): not renewed", owner_id, len(owner.pin_table))
        return expired

    def is_pinned(self, page_hash: bytes) -> bool:
        return self._num_pins[page_hash] > 0

    def pinned_hashes(self) -> set[bytes]:
        return set(self._num_pins)

    def num_owners(self) -> int:
        return len(self._owner_table)

    def owner_pins(self, owner_id: str) -> dict[bytes, int]:
        """The pins an owner holds (page hash -> count); empty when unknown."""
        owner = self._owner_table.get(owner_id)
        return dict(owner.pin_table) if owner is not None else {}

    def totals(self) -> tuple[int, int]:
        """(pins counted by page, pins counted by owner): equal unless the books are broken."""
        by_owner = sum(sum(owner.pin_table.values()) for owner in self._owner_table.values())
        return sum(self._num_pins.values()), by_owner

    def _release(self, released: Counter[bytes]) -> list[bytes]:
        unpinned = []
        for h, n in released.items():
            self._num_pins[h] -= n
            if self._num_pins[h] <= 0:
                del self._num_pins[h]
                unpinned.append(h)
        return unpinned
