"""Budget buckets of a sequence's resident pages, and the identity that must hold at every change.

Every slot a ring sequence may use belongs to exactly one bucket:
`protect` (the opening pages: attention sinks and the head of the prompt), `skeleton` (the pages of
the query: the last user turn), `evidence` (pages retrieved for the query), `recent` (the trailing
window, including the partial page and the chunk being written), `free` (budget not in use).
`protect + skeleton + evidence + recent + free == budget` is checked on every change.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import NamedTuple


class Bucket(enum.Enum):
    PROTECT = "protect"
    SKELETON = "skeleton"
    EVIDENCE = "evidence"
    RECENT = "recent"
    FREE = "free"


class BucketError(AssertionError):
    """The bucket identity does not hold; the message carries the numbers."""


class BucketCounts(NamedTuple):
    protect: int
    skeleton: int
    evidence: int
    recent: int
    free: int

    @property
    def total(self) -> int:
        return self.protect + self.skeleton + self.evidence + self.recent + self.free


@dataclass(frozen=True)
class BucketPlan:
    """Which logical pages a sequence keeps resident, by bucket (page indices; disjoint sets)."""

    protect: frozenset[int]
    skeleton: frozenset[int]
    evidence: frozenset[int]
    recent: frozenset[int]

    @functools.cached_property
    def resident(self) -> frozenset[int]:
        """Every resident page (computed once per plan: the scheduler asks for it per page)."""
        return self.protect | self.skeleton | self.evidence | self.recent

    def bucket_of(self, page: int) -> Bucket:
        for bucket, pages in (
            (Bucket.PROTECT, self.protect),
            (Bucket.SKELETON, self.skeleton),
            (Bucket.EVIDENCE, self.evidence),
            (Bucket.RECENT, self.recent),
        ):
            if page in pages:
                return bucket
        return Bucket.FREE

    def counts(self, budget: int) -> BucketCounts:
        """Sizes with `free = budget - used`; raises BucketError when the identity cannot hold. Kept with the
        plan (RingManager.plan hands the same plan out many times, the ring snapshot counts every one of them)."""
        cached = self.__dict__.get("_counts")
        if cached is not None and cached[0] == budget:
            return cached[1]
        sizes = (len(self.protect), len(self.skeleton), len(self.evidence), len(self.recent))
        used = sum(sizes)
        overlap = used - len(self.resident)
        if overlap:
            raise BucketError(f"{overlap} page(s) are in two buckets: {sizes}")
        counts = BucketCounts(*sizes, budget - used)
        if counts.free < 0 or counts.total != budget:
            raise BucketError(
                "protect + skeleton + evidence + recent + free != budget: "
                f"{counts.protect} + {counts.skeleton} + {counts.evidence} + {counts.recent} + {counts.free} "
                f"!= {budget}"
            )
        object.__setattr__(self, "_counts", (budget, counts))  # frozen: as functools.cached_property does
        return counts


def plan_buckets(
    num_pages: int,
    budget: int,
    protect_pages: int,
    recent_pages: int,
    skeleton: set[int],
    evidence: set[int],
) -> BucketPlan:
    """Assign a sequence's first `num_pages` logical pages to buckets, in priority order
    protect > recent > skeleton > evidence, each clipped so the total stays within `budget`.
    While everything fits the budget, everything stays resident (the trailing window is all of it)."""
    protect = set(range(min(protect_pages, num_pages)))
    if num_pages <= budget:
        recent_pages = num_pages
    recent = set(range(max(len(protect), num_pages - recent_pages), num_pages))
    room = budget - len(protect) - len(recent)
    if room < 0:
        raise BucketError(f"protect {len(protect)} + recent {len(recent)} pages exceed the budget of {budget} pages")
    skel = sorted(p for p in skeleton if p < num_pages and p not in protect and p not in recent)[-room:] if room else []
    room -= len(skel)
    taken = protect | recent | set(skel)
    evid = [p for p in sorted(evidence) if p < num_pages and p not in taken][:room] if room else []
    plan = BucketPlan(frozenset(protect), frozenset(skel), frozenset(evid), frozenset(recent))
    plan.counts(budget)
    return plan
