"""Page selection: top pages plus seam neighbours (protect and skeleton excluded, audit records written), the
negative control, issue 25's per-head votes (summaries.page_votes), recent pages out of the competition, decode
re-selections that keep the prompt's best pages (anchor_pages), and exact attention's page masses."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine.kv.slots import SlotAllocator
from services.engine.ring.ring import RingManager
from services.engine.ring.selection import taking_turns
from services.engine.ring.state import SeqRing
from services.engine.ring.summaries import PageSummaries, page_scores, page_votes, warm_page_scores
from tests.engine.helpers import device_or_skip, ring_limits


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


def test_read_ahead_follows_the_prompts_best_page_and_each_decode_pick_not_the_anchors() -> None:
    """read_ahead 1: the prompt's final selection takes the page after its best one (where an answer that continues
    the context starts), and each page a decode re-selection picks from the decode step's scores brings the page
    after it (an answer that copies the context in order needs it next); the anchors bring none."""
    manager, ring = _manager(anchor_pages=1, read_ahead=1)
    scores = torch.zeros(30)
    scores[[5, 9, 12, 20]] = torch.tensor([4.0, 3, 2, 1])
    manager.add_scores(ring, scores, 1)
    ring.final_scored = True
    manager.select(ring, 30, "r", 0)
    assert ring.anchor == [5, 6, 9, 12]  # the best page, the one after it, then by rank (room for 4)
    decode = torch.zeros(30)
    decode[[25, 14, 29]] = torch.tensor([4.0, 3, 2])
    manager.add_scores(ring, decode, 1)
    manager.select(ring, 30, "r", 1)
    assert ring.evidence == {5, 25, 26, 14}  # anchor 5 alone, then 25 and 26, then 14 (room for 4)
    decode[[25, 14, 29]] = torch.tensor([2.0, 3, 4])
    manager.add_scores(ring, decode, 1)
    manager.select(ring, 30, "r", 2)
    assert ring.evidence == {5, 29, 14, 15}  # page 29 is the last of 30: nothing after it


# -- real attention query pass (RingLimits.query_pass "attention" / "exact") and head fusion ----------------


def test_page_mass_is_the_softmax_over_all_parts_summed_per_page() -> None:
    """Two parts (resident rows with a causal mask, host pages without) against a brute-force softmax over
    their union: per query head, the mass on each page; keys past num_pages count in the softmax only."""
    from services.engine.ring.exact_attention import page_mass

    torch.manual_seed(0)
    size, hkv, group, d = 4, 2, 3, 8
    q = torch.randn(2, hkv * group, d)  # 2 query tokens at positions 22, 23
    q_pos = torch.tensor([22, 23])
    res_pos = torch.tensor([0, 1, 2, 3, 20, 21, 22, 23])  # page 0 and the current page 5 (past num_pages=5)
    host_pos = torch.arange(8, 16)  # pages 2, 3 from the host
    k_res, k_host = torch.randn(hkv, len(res_pos), d), torch.randn(hkv, len(host_pos), d)
    allowed = (res_pos[None, :] <= q_pos[:, None]).repeat(group, 1)  # [G * Tq, T]: rows (group member, token)
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    got = page_mass(q, [(k_res, res_pos, mask), (k_host, host_pos, None)], 0.5, num_pages=5, page_size=size)
    assert got.shape == (2, hkv * group, 5)
    keys = torch.cat((k_res, k_host), dim=1)
    pos = torch.cat((res_pos, host_pos))
    for t in range(2):
        for h in range(hkv * group):
            logits = (keys[h // group] @ q[t, h]) * 0.5
            logits[pos > q_pos[t]] = float("-inf")
            p = torch.softmax(logits, 0)
            want = torch.zeros(6).index_add_(0, (pos // size).clamp(max=5), p)[:5]
            assert torch.allclose(got[t, h], want, atol=1e-5), (t, h)
    assert float(got[:, :, 1].abs().max()) == 0.0 and float(got[:, :, 4].abs().max()) == 0.0  # pages never read


def test_fuse_heads_rules() -> None:
    from services.engine.ring.summaries import fuse_heads

    # 3 heads over 4 pages; page 0 excluded (a sink every head loves)
    mass = torch.tensor([[0.90, 0.02, 0.05, 0.03], [0.50, 0.30, 0.11, 0.10], [0.80, 0.01, 0.02, 0.18]])
    candidate = torch.tensor([False, True, True, True])
    summed = fuse_heads(mass, candidate, "sum")
    assert torch.allclose(summed, torch.tensor([0.0, 0.33, 0.18, 0.31]))
    norm = fuse_heads(mass, candidate, "norm")  # each head's candidates' mass rescaled to one
    rows = mass[:, 1:] / mass[:, 1:].sum(dim=1, keepdim=True)
    assert torch.allclose(norm, torch.cat((torch.zeros(1), rows.sum(dim=0))), atol=1e-6)
    # ranks over pages 1..3 per head: (2, 0, 1), (0, 1, 2), (2, 1, 0); a page gets 1 / (1 + 1 + rank) from each
    rrf = fuse_heads(mass, candidate, "rrf:1")
    want = torch.tensor([0.0, 1 / 4 + 1 / 2 + 1 / 4, 1 / 2 + 1 / 3 + 1 / 3, 1 / 3 + 1 / 4 + 1 / 2])
    assert torch.allclose(rrf, want, atol=1e-6) and int(rrf.argmax()) == 2  # summed mass would pick page 1
    # shares over pages 1..3: head 0 (0.2, 0.5, 0.3), head 1 (0.59, 0.22, 0.20), head 2 (0.05, 0.10, 0.86)
    shares = rows
    assert torch.allclose(fuse_heads(mass, candidate, "max"), torch.cat((torch.zeros(1), shares.amax(dim=0))))
    assert int(fuse_heads(mass, candidate, "max").argmax()) == 3  # head 2 singles page 3 out; the sum picks page 1
    peak = fuse_heads(mass, candidate, "peak")
    want = (shares * shares.amax(dim=1, keepdim=True)).sum(dim=0)
    assert torch.allclose(peak, torch.cat((torch.zeros(1), want))) and int(peak.argmax()) == 3
    try:
        fuse_heads(mass, candidate, "median")
    except ValueError as exc:
        assert "sum, norm, rrf, max, peak" in str(exc)
    else:
        raise AssertionError("an unknown rule must raise")


def test_select_fuses_per_head_masses_over_the_candidates_only() -> None:
    """Per-head masses [heads, pages] (an attention query pass): protect pages and the skeleton never count,
    so a head that puts most of its mass on the sink still votes for its best candidate (norm)."""
    manager, ring = _manager(head_fusion="norm")
    ring.skeleton = {19}
    mass = torch.zeros(3, 20)
    mass[:, 0] = 0.9  # the sink (protect page 0) takes most of every head's mass
    mass[0, 7], mass[1, 7], mass[2, 11] = 0.05, 0.04, 0.08
    mass[:, 19] = 0.05  # the skeleton
    mass[0, 3] = 0.01
    manager.add_scores(ring, mass, 2)
    ring.final_scored = True
    manager.select(ring, num_candidate_pages=20, request_id="r", step=0)
    assert ring.anchor[:2] == [7, 11] and 0 not in ring.evidence and 19 not in ring.evidence


def test_score_from_skips_the_early_layers() -> None:
    s = PageSummaries(4, 6, 2, 8, torch.device("cpu"), layers=[0, 1, 3])
    s.kmin.copy_(torch.randn_like(s.kmin))
    s.kmax.copy_(s.kmin + 1)
    assert s.scored_rows() == [0, 1, 2]
    s.score_from = 0.5  # layers 2 and 3 of 4 score; layer 3 is row 2
    assert not s.scores_layer(1) and s.scores_layer(3) and s.scored_rows() == [2]
    kmin, kmax = s.stacked_bounds(5, s.scored_rows())
    assert torch.equal(kmin, s.kmin[2, :5]) and torch.equal(kmax, s.kmax[2, :5])
    full = s.stacked_bounds(5)[0]
    assert full.shape == (5, 6, 8) and torch.equal(full[:, 4:], kmin)


def test_warm_page_scores_is_a_no_op_off_cuda() -> None:
    assert warm_page_scores(torch.device("cpu"), 4, 2, 8, 4096, (torch.float32,)) == 0


@pytest.mark.gpu
def test_warm_page_scores_compiles_every_variant_a_context_meets() -> None:
    """After the warm-up, scoring at any page count up to max_pages, in either query dtype, compiles nothing
    (the first decode re-selection of a fresh engine stalled every running sequence for ~2 s without it)."""
    from services.engine import kernels

    dev = device_or_skip("cuda")
    before_tier = kernels.active_tier()
    kernels.use_tier(kernels.select_tier(dev, "triton"))
    try:
        _warm_then_score(dev)
    finally:
        kernels.use_tier(before_tier)


def _warm_then_score(dev: torch.device) -> None:
    from services.engine.kernels.pages import summaries_triton as st

    calls = warm_page_scores(dev, 32, 8, 128, 2048, (torch.float32, torch.bfloat16))
    assert calls == 2 * 3  # 512, 1024, 2048 pages: PAGE_BLOCKS 16, 32, 64

    def compiled() -> int:
        kernels = (st._score_mass_kernel, st._score_stats_kernel)
        if not all(hasattr(k, "device_caches") for k in kernels):
            pytest.skip("this Triton keeps no device_caches")
        return sum(len(c[0]) for k in kernels for c in k.device_caches.values())

    before = compiled()
    for pages in (3, 300, 700, 1500, 2048):
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(1, 1024, 128, device=dev).to(dtype)
            kmin = torch.randn(pages, 256, 128, device=dev)
            out = page_scores(q, kmin, kmin + 1, 128**-0.5)
            assert out.shape == (pages,) and torch.isfinite(out).all()
    assert compiled() == before


# -- copy following (RingLimits.follow_copy) --------------------------------------------------------------------


def test_copy_source_finds_where_the_answer_copies_from() -> None:
    """The position after the answer's last tokens in the prompt: the first occurrence at or after where it last
    read, else the last one before; shorter tails when the longest occurs nowhere; none on disallowed pages."""
    import numpy as np

    from services.engine.ring.selection import PromptIndex, copy_source

    prompt = PromptIndex([9, 1, 2, 3, 4, 8, 8, 8, 1, 2, 3, 5, 8, 8, 8, 8])  # page_size 4: 4 pages
    every = np.ones(4, dtype=bool)
    assert copy_source(prompt, [1, 2, 3, 4], 4, -1, every, 4) == 5  # the only 4-token occurrence
    assert copy_source(prompt, [1, 2, 3], 4, -1, every, 4) == 4  # two occurrences: the first at or after -1
    assert copy_source(prompt, [1, 2, 3], 4, 6, every, 4) == 11  # the first at or after 6
    assert copy_source(prompt, [1, 2, 3], 4, 12, every, 4) == 11  # none after 12: the last before it
    assert copy_source(prompt, [7, 2, 3], 4, -1, every, 4) == 4  # [7, 2, 3] nowhere: the tail [2, 3]
    assert copy_source(prompt, [7, 6], 4, -1, every, 4) == -1  # not even 2 tokens occur
    assert copy_source(prompt, [1, 2, 3], 4, -1, np.array([True, False, True, True]), 4) == 11  # page 1 not allowed
    # [5, 8, 8, 8, 8] and [8, 8, 8, 8] occur only where the prompt ends (nothing after them to read): [8, 8, 8] at 5
    assert copy_source(prompt, [5, 8, 8, 8, 8], 5, -1, every, 4) == 8


def test_copy_source_through_the_index_equals_a_scan_of_the_prompt() -> None:
    """PromptIndex's lookups give what a plain scan of every occurrence gives, over random prompts from a small
    vocabulary (many repeats), tails copied from the prompt and made up, random `near` and disallowed pages."""
    import numpy as np

    from services.engine.ring.selection import PromptIndex, copy_source

    def scan(prompt: list[int], recent: list[int], longest: int, near: int, allowed: np.ndarray, size: int) -> int:
        for n in range(min(longest, len(recent)), 1, -1):
            tail = recent[-n:]
            after = [s + n for s in range(len(prompt) - n) if prompt[s : s + n] == tail]
            after = [a for a in after if allowed[min(a // size, len(allowed) - 1)]]
            if after:
                return next((a for a in after if a >= near), after[-1])
        return -1

    rng = np.random.default_rng(3)
    for case in range(60):
        prompt = [int(t) for t in rng.integers(0, 3 + case % 20, 200)]
        index = PromptIndex(prompt)
        allowed = rng.random(50) < 0.7
        for _ in range(10):
            start, n = int(rng.integers(0, 190)), int(rng.integers(2, 9))
            recent = prompt[start : start + n] if rng.random() < 0.6 else [int(t) for t in rng.integers(0, 25, n)]
            near = int(rng.integers(-1, 200))
            assert copy_source(index, recent, 6, near, allowed, 4) == scan(prompt, recent, 6, near, allowed, 4)


def test_follow_copy_leads_a_decode_reselection_with_the_pages_being_copied() -> None:
    """page_size 4, prefetch 0, rescore every 4 steps: the answer copies from position 41 (page 10), so the lead
    is pages 10..12 (to where the copy is once the next re-selection is in effect, one page beyond), then the
    anchor, then the decode step's best; without follow_copy the decode step's scores alone."""
    import numpy as np

    from services.engine.ring.selection import PromptIndex

    prompt = PromptIndex(np.arange(100, 100 + 120))  # distinct tokens: token 100 + i sits at position i
    for follow, expected in ((0, {5, 25, 26, 27}), (3, {10, 11, 12, 5})):
        manager, ring = _manager(anchor_pages=1, follow_copy=follow, rescore_interval=4)
        scores = torch.zeros(30)
        scores[[5, 9, 12, 20]] = torch.tensor([4.0, 3, 2, 1])
        manager.add_scores(ring, scores, 1)
        ring.final_scored = True
        manager.select(ring, 30, "r", 0)
        assert ring.follow_at == 20  # the prompt's best page's start: where a copy most likely begins
        decode = torch.zeros(30)
        decode[[25, 26, 27, 28]] = torch.tensor([4.0, 3, 2, 1])
        manager.add_scores(ring, decode, 1)
        manager.select(ring, 30, "r", 1, prompt=prompt, recent=[137, 138, 139, 140])
        assert ring.evidence == expected
        assert ring.follow_at == (41 if follow else 20)


def test_taking_turns_merges_two_rankings_each_page_once() -> None:
    assert taking_turns([4, 2, 9], [2, 7, 4]) == [4, 2, 7, 9]
    assert taking_turns([1, 2], [3, 4, 5, 6]) == [1, 3, 2, 4, 5, 6]  # the longer one's tail in its order
    assert taking_turns([], [3]) == [3]


def test_a_question_replays_best_page_leads_the_prompts_selection() -> None:
    """A question replay's masses and the query span's rank the candidates by turns, the replay's best first
    (its best page is the anchor, and read-ahead follows it); both are used once."""
    manager, ring = _manager(head_fusion="sum")
    span = torch.zeros(2, 20)
    span[:, 15], span[:, 14], span[:, 5] = 0.5, 0.3, 0.01  # the query span (the template's last tokens) reads late
    replay = torch.zeros(2, 20)
    replay[:, 5], replay[:, 9] = 0.6, 0.2  # the question, read again after the document, finds page 5
    ring.replay_scores = replay
    manager.add_scores(ring, span, 2)
    ring.final_scored = True
    manager.select(ring, num_candidate_pages=20, request_id="r", step=0)
    assert ring.anchor[0] == 5 and 15 in ring.anchor and ring.replay_scores is None and ring.scores is None
    manager, ring = _manager(head_fusion="sum")
    ring.replay_scores, ring.question_alone = replay, True  # alone: the query span's ranking is not used
    manager.add_scores(ring, span, 2)
    ring.final_scored = True
    manager.select(ring, num_candidate_pages=20, request_id="r", step=0)
    assert ring.anchor[:2] == [5, 9] and 15 not in ring.anchor


@pytest.mark.gpu
def test_exact_attention_on_the_tensor_cores_matches_float32() -> None:
    """bf16 inputs on CUDA: grouped_attention_lse's scores and weighted sum and page_mass's logits multiply on the
    tensor cores (float32 out): the float32 CPU forms' values, within the weights' rounding to bf16."""
    from services.engine.ring import exact_attention as ea

    dev = device_or_skip("cuda")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(64, 8, 128, generator=g).bfloat16()
    k, v = (torch.randn(2, 700, 128, generator=g).bfloat16() for _ in range(2))
    allowed = torch.rand(4 * 64, 700, generator=g) > 0.3
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    out_c, lse_c = ea.grouped_attention_lse(q, k, v, mask, 0.088)
    out_g, lse_g = ea.grouped_attention_lse(q.to(dev), k.to(dev), v.to(dev), mask.to(dev), 0.088)
    assert ea._tensor_cores[0]  # the tensor-core path ran, not the float32 fallback
    assert out_g.dtype == torch.float32 and (out_g.cpu() - out_c).norm() / out_c.norm() < 1e-2
    assert (lse_g.cpu() - lse_c).abs().max() < 1e-3
    pos = torch.arange(700)
    mass_c = ea.page_mass(q[-16:], [(k, pos, None)], 0.088, 10, 64)
    mass_g = ea.page_mass(q[-16:].to(dev), [(k.to(dev), pos.to(dev), None)], 0.088, 10, 64)
    assert (mass_g.cpu() - mass_c).abs().max() < 1e-4


def test_grouped_attention_lse_is_softmax_attention_and_its_logsumexp() -> None:
    """The partial attention of the exact policy: each row's softmax over its visible keys times V and the
    log-sum-exp of its scores; a row with no visible key gives 0 and -inf (merge_partials weighs it 0)."""
    from services.engine.ring.exact_attention import grouped_attention_lse

    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 4, 8, generator=g)  # 5 tokens, 4 query heads over 2 KV heads
    k, v = torch.randn(2, 9, 8, generator=g), torch.randn(2, 9, 8, generator=g)
    allowed = torch.rand(2 * 5, 9, generator=g) > 0.4
    allowed[3] = False
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    out, lse = grouped_attention_lse(q, k, v, mask, 0.3)
    q_rows = q.view(5, 2, 2, 8).permute(1, 2, 0, 3).reshape(2, 10, 8)  # (KV head, group member, token)
    scores = q_rows @ k.transpose(1, 2) * 0.3 + mask
    want = torch.nan_to_num(torch.softmax(scores, dim=-1)) @ v
    want_lse = torch.logsumexp(scores, dim=-1)
    assert torch.allclose(out, want, atol=1e-6)
    assert torch.equal(out[:, 3], torch.zeros(2, 8)) and torch.isneginf(lse[:, 3]).all()
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.allclose(lse[finite], want_lse[finite], atol=1e-6)


def test_selection_takes_top_pages_and_their_neighbours(tmp_path) -> None:
    limits = ring_limits(budget_pages=12, evidence_pages=5, audit_dir=str(tmp_path))
    manager = RingManager(limits, SlotAllocator(4), pool=None, host=None)  # type: ignore[arg-type]
    ring = SeqRing(summaries=PageSummaries(1, 20, 1, 4, torch.device("cpu")), policy="sparse", query_start=70)
    ring.skeleton = {17}
    scores = torch.zeros(20)
    scores[[9, 0, 17, 3]] = torch.tensor([5.0, 4.0, 3.0, 2.0])
    manager.add_scores(ring, scores, num_query_tokens=4)
    manager.select(ring, num_candidate_pages=18, request_id="audit/me", step=7)
    # 9 then its neighbours 10, 8; 0 is protect, 17 is skeleton: skipped; then 3 and 4
    assert ring.evidence == {9, 10, 8, 3, 4}
    record = json.loads((tmp_path / "audit_me.jsonl").read_text().splitlines()[0])
    assert record["evidence"] == [3, 4, 8, 9, 10] and record["top"][0] == [9, 5.0] and record["step"] == 7


def test_negative_control_keeps_no_evidence() -> None:
    limits = ring_limits(budget_pages=12, retrieval=False)
    manager = RingManager(limits, SlotAllocator(4), pool=None, host=None)  # type: ignore[arg-type]
    ring = SeqRing(summaries=PageSummaries(1, 20, 1, 4, torch.device("cpu")), policy="sparse", query_start=0)
    manager.add_scores(ring, torch.arange(20.0), num_query_tokens=1)
    manager.select(ring, num_candidate_pages=20, request_id="r", step=0)
    assert ring.evidence == set()
