"""Buckets: exact page sets, the identity, priorities and clipping, typed errors with numbers."""

from __future__ import annotations

import pytest

from services.engine.ring.buckets import Bucket, BucketError, BucketPlan, plan_buckets


def test_everything_resident_while_it_fits() -> None:
    plan = plan_buckets(num_pages=6, budget=8, protect_pages=2, recent_pages=3, skeleton=set(), evidence={4})
    assert plan.protect == {0, 1} and plan.recent == {2, 3, 4, 5}
    assert plan.evidence == frozenset() and plan.counts(8) == (2, 0, 0, 4, 2)


def test_over_budget_keeps_protect_recent_skeleton_evidence() -> None:
    plan = plan_buckets(
        num_pages=20, budget=10, protect_pages=2, recent_pages=3, skeleton={15, 16}, evidence={5, 6, 17, 18}
    )
    assert plan.protect == {0, 1}
    assert plan.recent == {17, 18, 19}
    assert plan.skeleton == {15, 16}
    assert plan.evidence == {5, 6}  # 17, 18 are already recent
    assert plan.counts(10) == (2, 2, 2, 3, 1)
    assert plan.bucket_of(5) is Bucket.EVIDENCE and plan.bucket_of(9) is Bucket.FREE


def test_evidence_is_clipped_to_the_room_left() -> None:
    plan = plan_buckets(num_pages=30, budget=8, protect_pages=2, recent_pages=3, skeleton={20}, evidence={3, 4, 5, 6})
    assert plan.evidence == {3, 4} and plan.counts(8).free == 0


def test_protect_plus_recent_over_budget_is_refused_with_numbers() -> None:
    with pytest.raises(BucketError, match="protect 4 \\+ recent 5 pages exceed the budget of 8"):
        plan_buckets(num_pages=30, budget=8, protect_pages=4, recent_pages=5, skeleton=set(), evidence=set())


def test_identity_violation_names_the_numbers() -> None:
    plan = BucketPlan(frozenset({0}), frozenset(), frozenset({3, 4}), frozenset({7, 8}))
    with pytest.raises(BucketError, match=r"1 \+ 0 \+ 2 \+ 2 \+ -1 != 4"):
        plan.counts(4)
    overlapping = BucketPlan(frozenset({0}), frozenset({3}), frozenset({3}), frozenset())
    with pytest.raises(BucketError, match="two buckets"):
        overlapping.counts(10)
