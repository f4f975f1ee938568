"""Page selection of issue 25: per-head votes (summaries.page_votes), recent pages out of the competition,
and decode re-selections that keep the prompt's best pages (anchor_pages)."""

from __future__ import annotations

import torch

from services.engine.ring import RingManager, SeqRing
from services.engine.slots import SlotAllocator
from services.engine.summaries import PageSummaries, page_scores, page_votes
from tests.engine.helpers import ring_limits


def _one_hot_bounds(num_pages: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kmin = kmax: page p's only key is 3 * e_(p mod dim) (one KV head)."""
    k = torch.zeros(num_pages, 1, dim)
    for p in range(num_pages):
        k[p, 0, p % dim] = 3.0
    return k.clone(), k.clone()


def test_votes_give_each_head_its_top_pages_mass() -> None:
    kmin, kmax = _one_hot_bounds(6, 8)
    q = torch.zeros(2, 2, 8)  # 2 tokens, 2 query heads on one KV head
    q[:, 0, 4] = 4.0  # head 0: page 4 (logit 12 against 0)
    q[:, 1, 2] = 1.0 / 3  # head 1: barely prefers page 2 (logit 1 against 0)
    votes = page_votes(q, kmin, kmax, 1.0, top=1)
    expected = torch.zeros(6)
    expected[4] = torch.softmax(torch.tensor([0.0, 0, 0, 0, 12, 0]), 0)[4]
    expected[2] = torch.softmax(torch.tensor([0.0, 0, 1, 0, 0, 0]), 0)[2]
    assert torch.allclose(votes, expected, atol=1e-6)
    # the sum of mass instead: head 1 spreads its mass on every page
    mass = page_scores(q, kmin, kmax, 1.0)
    assert torch.allclose(mass.sum(), torch.tensor(4.0)) and mass[1] > 0


def test_votes_drop_the_tail_of_flat_heads() -> None:
    """64 pages: 40 near-flat heads, each a little above flat on its own page (0..39), and one head sure of
    page 50. Summed mass gives every page ~40/64 from the flat heads' tails; votes keep only each head's top
    page, so page 50 stands out further: its share of the total rises."""
    num_pages, dim = 64, 64
    kmin, kmax = torch.eye(num_pages)[:, None, :] * 3, torch.eye(num_pages)[:, None, :] * 3
    q = torch.zeros(1, 41, dim)
    for h in range(40):
        q[0, h, h] = 0.3 / 3
    q[0, 40, 50] = 10.0 / 3
    mass = page_scores(q, kmin, kmax, 1.0)
    votes = page_votes(q, kmin, kmax, 1.0, top=1)
    assert int(mass.argmax()) == 50 and int(votes.argmax()) == 50
    assert votes[50] / votes.sum() > 2 * mass[50] / mass.sum()
    assert float(votes[60]) == 0.0 and float(mass[60]) > 0.5  # page 60: nobody's top page


def test_summaries_score_follows_vote_top() -> None:
    s = PageSummaries(1, 6, 1, 8, torch.device("cpu"))
    kmin, kmax = _one_hot_bounds(6, 8)
    q = torch.randn(3, 2, 8)
    assert torch.equal(s.score(q, kmin, kmax, 0.5), page_scores(q, kmin, kmax, 0.5))
    s.vote_top = 2
    assert torch.equal(s.score(q, kmin, kmax, 0.5), page_votes(q, kmin, kmax, 0.5, 2))


def _manager(**kw: object) -> tuple[RingManager, SeqRing]:
    limits = ring_limits(budget_pages=12, evidence_pages=4, neighbor_pages=0, **kw)
    manager = RingManager(limits, SlotAllocator(4), pool=None, host=None)  # type: ignore[arg-type]
    ring = SeqRing(summaries=PageSummaries(1, 40, 1, 4, torch.device("cpu")), policy="sparse", query_start=0)
    return manager, ring


def test_recent_pages_are_no_candidates() -> None:
    """page_size 4, recent 3 pages: at 80 tokens (20 pages) pages 17..19 are recent; 16 is not."""
    for exclude, expected in ((False, {19, 18, 17, 16}), (True, {16, 2, 5, 6})):
        manager, ring = _manager(exclude_recent=exclude)
        scores = torch.zeros(20)
        scores[[19, 18, 17, 16, 2, 5, 6]] = torch.tensor([9.0, 8, 7, 6, 5, 4, 3])
        manager.add_scores(ring, scores, 1)
        manager.select(ring, num_candidate_pages=20, request_id="r", step=0, end_tokens=80)
        assert ring.evidence == expected


def test_decode_reselection_keeps_the_prompts_anchor_pages() -> None:
    manager, ring = _manager(anchor_pages=2)
    scores = torch.zeros(30)
    scores[[5, 9, 12, 20]] = torch.tensor([4.0, 3, 2, 1])
    manager.add_scores(ring, scores, 1)
    ring.final_scored = True  # the prompt's final selection
    manager.select(ring, 30, "r", 0)
    assert ring.anchor == [5, 9, 12, 20] and ring.evidence == {5, 9, 12, 20}
    decode = torch.zeros(30)
    decode[[25, 26, 27, 28]] = torch.tensor([4.0, 3, 2, 1])
    manager.add_scores(ring, decode, 1)
    manager.select(ring, 30, "r", 1)
    assert ring.evidence == {5, 9, 25, 26}  # the two best of the prompt's, then the decode step's best
    assert ring.anchor == [5, 9, 12, 20]  # unchanged by decode re-selections
