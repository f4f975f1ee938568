"""SlotAllocator: which device slot holds which page, with a prefix cache of finished pages.

A slot is in exactly one state: `free` (no content), `owned` (referenced by >= 1 live sequence),
or `cached` (holds a finished page that no live sequence references; reusable by hash until the
slot is needed for something else, least recently released first).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

logger = logging.getLogger(__name__)


class PoolExhaustedError(RuntimeError):
    """No free or evictable slot is left."""


class IntegrityError(AssertionError):
    """The slot accounting does not add up; the message has the numbers."""


class SlotCounts(NamedTuple):
    total: int
    free: int
    owned: int
    cached: int


class SlotAllocator:
    """Slot ownership, reference counts and the page-hash -> slot prefix cache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._refs: dict[int, int] = {}  # owned slot -> reference count
        self._cached: OrderedDict[int, bytes] = OrderedDict()  # unreferenced slot -> hash, LRU first
        self._hash_to_slot: dict[bytes, int] = {}
        self._slot_to_hash: dict[int, bytes] = {}
        # partial (tail) pages: never shared, but their rows can be copied into a new slot
        self._partials: dict[bytes, dict[int, tuple[int, ...]]] = {}  # parent hash -> {slot: tokens}
        self._slot_to_parent: dict[int, bytes] = {}

    def counts(self) -> SlotCounts:
        return SlotCounts(self.num_slots, len(self._free), len(self._refs), len(self._cached))

    def num_available(self) -> int:
        """Slots that allocate() can hand out now (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    def allocate(self) -> int:
        """A slot for new content, owned once; evicts the least recently released cached page."""
        if self._free:
            slot = self._free.pop()
        elif self._cached:
            slot, page_hash = self._cached.popitem(last=False)
            self._forget(slot, page_hash)
        else:
            raise PoolExhaustedError(f"all {self.num_slots} slots are owned by live sequences")
        self._refs[slot] = 1
        return slot

    def lookup(self, page_hash: bytes) -> int | None:
        """The slot holding the finished page `page_hash`, if any (does not take a reference)."""
        return self._hash_to_slot.get(page_hash)

    def acquire(self, slot: int) -> None:
        """Take one more reference to a slot holding a finished page (owned or cached)."""
        if slot in self._cached:
            del self._cached[slot]
            self._refs[slot] = 1
        else:
            assert slot in self._refs, f"slot {slot} is free"
            self._refs[slot] += 1

    def register(self, slot: int, page_hash: bytes) -> bool:
        """Record that an owned slot now holds the finished page `page_hash`.

        Returns False (and records nothing) when another slot already holds that page.
        """
        assert slot in self._refs, f"slot {slot} is not owned"
        if page_hash in self._hash_to_slot or slot in self._slot_to_hash or slot in self._slot_to_parent:
            return False
        self._hash_to_slot[page_hash] = slot
        self._slot_to_hash[slot] = page_hash
        return True

    def register_partial(self, slot: int, parent_hash: bytes, token_ids: tuple[int, ...]) -> bool:
        """Record that an owned slot holds the first len(token_ids) tokens of the page after `parent_hash`;
        False (nothing recorded) when the slot is shared or already holds a registered page."""
        if self._refs.get(slot) != 1 or slot in self._slot_to_hash or slot in self._slot_to_parent:
            return False
        self._partials.setdefault(parent_hash, {})[slot] = token_ids
        self._slot_to_parent[slot] = parent_hash
        return True

    def lookup_partial(self, parent_hash: bytes) -> list[tuple[int, tuple[int, ...]]]:
        """Unreferenced partial pages after `parent_hash`: (slot, the tokens it holds)."""
        return [(s, t) for s, t in self._partials.get(parent_hash, {}).items() if s in self._cached]

    def release(self, slot: int) -> None:
        """Drop one reference; an unreferenced slot becomes cached (finished or partial page) or free."""
        refs = self._refs[slot] - 1
        if refs > 0:
            self._refs[slot] = refs
            return
        del self._refs[slot]
        key = self._slot_to_hash.get(slot) or self._slot_to_parent.get(slot)
        if key is None:
            self._free.append(slot)
        else:
            self._cached[slot] = key

    def _forget(self, slot: int, key: bytes) -> None:
        if self._slot_to_hash.get(slot) == key:
            del self._hash_to_slot[key]
            del self._slot_to_hash[slot]
        else:
            del self._partials[key][slot]
            if not self._partials[key]:
                del self._partials[key]
            del self._slot_to_parent[slot]

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + owned + cached == total and the maps agree."""
        c = self.counts()
        if c.free + c.owned + c.cached != c.total:
            raise IntegrityError(f"free + owned + cached != total: {c.free} + {c.owned} + {c.cached} != {c.total}")
        states = [set(self._free), set(self._refs), set(self._cached)]
        if len(states[0] | states[1] | states[2]) != c.total:
            raise IntegrityError(f"a slot is in two states: free={c.free} owned={c.owned} cached={c.cached}")
        if len(self._hash_to_slot) != len(self._slot_to_hash):
            raise IntegrityError(f"hash map sizes differ: {len(self._hash_to_slot)} != {len(self._slot_to_hash)}")
