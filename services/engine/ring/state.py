"""The ring's state: RingLimits (the frozen limits every ring sequence runs under), SeqRing (one sequence's ring:
its evidence, scores, clocks, pins and pages fetched ahead) and PendingEvidence (a decode re-selection waiting to
take effect). RingManager (ring.py) acts on them."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from services.engine.ring.buckets import BucketPlan
from services.engine.ring.selection import PromptIndex
from services.engine.ring.summaries import PageSummaries


@dataclass(frozen=True)
class RingLimits:
    page_size: int
    budget_pages: int  # resident pages one ring sequence may hold
    protect_pages: int
    recent_pages: int
    skeleton_pages: int
    evidence_pages: int  # retrieval budget
    neighbor_pages: int  # seam completion reach (0 = off, the negative control for seams)
    query_tail: int  # query tokens when no query span is given
    max_query: int  # cap on scored query tokens
    rescore_interval: int  # decode steps between re-selections (0 = never during decode)
    retrieval: bool  # False = the negative control: evidence stays empty
    audit_dir: str = ""
    # a decode re-selection takes effect this many steps later, its host pages fetched in the background
    # meanwhile (0: at the next step, restored inside it); a function of steps only, never of timing
    prefetch_steps: int = 0
    # with prefetch_steps, a decode burst may contain a sequence's re-selection step and the step where its last
    # re-selection takes effect (scheduler._burst, Switch): the burst keeps both read sets and switches on the device
    switch_in_burst: bool = True
    # page scoring: 0 sums every (token, head, layer)'s mass over pages (summaries.page_scores); k > 0: each
    # head votes its top k pages (summaries.page_votes); bench/longeval measured both (bench/RESULTS.md)
    vote_top: int = 0
    # a decode re-selection keeps this many of the prompt's evidence pages (the question's best, in its
    # order) and fills the rest from the decode step's scores: an answer that drifts keeps what the question
    # needed (0: a decode re-selection replaces the whole set, as before)
    anchor_pages: int = 0
    # read-ahead: the prompt's final selection takes this many pages after its best page (where an answer that
    # continues the context starts), and a decode re-selection as many after each page it picks from the decode
    # step's scores (not after the anchors): an answer that reads the context in order (a copy, a list) reaches the
    # next page before the next re-selection is in effect
    read_ahead: int = 0
    # copy following: a decode re-selection finds the answer's last `follow_copy` tokens in the prompt (fewer, down to
    # 2, when those do not occur) and leads with the pages from there to where the copy will be when the next
    # re-selection is in effect: an answer that copies the context (a quote, a listing, code) reads its source page
    # by token identity, which a one-token query's Quest bound does not find (0: off)
    follow_copy: int = 0
    # question replay: a sequence's question span (Sequence.question) is read again at the prompt's end, before its
    # final selection, by a scoring pass that keeps nothing; its ranking takes turns with the query span's, or
    # replaces it (Sequence.question_alone)
    question_replay: bool = False
    exclude_recent: bool = False  # selection skips pages the recent window keeps resident anyway
    # the prompt's selection: "bound" (a scoring pass over the Quest bound), "attention" (a scoring pass that
    # attends every page, host ones streamed, ranked by its real attention mass), "exact" (the last chunk itself
    # attends every page and ranks them by its attention; no scoring pass)
    query_pass: str = "bound"
    score_from: float = 0.0  # layers below this fraction of the model's depth score no pages (PageSummaries)
    head_fusion: str = "sum"  # how per-head attention masses (query_pass attention / exact) rank pages: fuse_heads


@dataclass
class PendingEvidence:
    """A decode re-selection waiting to take effect: its evidence, the decode step it applies at, and the
    background fetch of the pages it needs from the host (their hashes and bytes on the device)."""

    evidence: set[int]
    apply_at: int
    fetch: Future[tuple[list[bytes], torch.Tensor]] | None


@dataclass
class SeqRing:
    """Ring state of one sequence."""

    summaries: PageSummaries
    policy: str  # "sparse" or "exact"
    query_start: int  # token index where the query (last user turn) starts
    evidence: set[int] = field(default_factory=set)
    skeleton: set[int] = field(default_factory=set)
    scores: torch.Tensor | None = None  # accumulated over the current scoring window
    scored_tokens: int = 0
    final_scored: bool = False  # the query has been read and scored (retrieval may run)
    replayed: bool = False  # the question replay has run (question_replay: once, before the final selection)
    replay_scores: torch.Tensor | None = None  # its page scores, ranked beside the query span's (taking_turns)
    question_alone: bool = False  # ... or alone (the query span asks nothing: the generation prompt's tokens)
    decode_steps: int = 0
    scored_at: int | None = None  # decode_steps at the last decode re-selection's scoring step (the prefetch counts
    # from it)
    # the scoring steps' clocks of decode re-selections launched and not selected yet, oldest first (with a burst in
    # flight, the next one may be launched before the host selects from the last one's scores)
    unselected: deque[int] = field(default_factory=deque)
    pinned: list[bytes] = field(default_factory=list)  # host pages pinned for this sequence (unpinned in this order)
    pinned_set: set[bytes] = field(default_factory=set)  # the same hashes, for membership (demote asks per victim)
    num_restores: int = 0
    pending: PendingEvidence | None = None  # a decode re-selection not in effect yet (prefetch_steps)
    # pages fetched ahead: by hash, the row of `prefetched_data` (uint8 [P, slot bytes] on the device) that holds
    # its bytes (one tensor as fetched, not a tensor per page: a restore of all of them in order writes it as is)
    prefetched: dict[bytes, int] = field(default_factory=dict)
    prefetched_data: torch.Tensor | None = None
    # a prompt selection's host-only pages (a chunk's, or the final one), fetched in the background
    # (RingManager.prefetch_selection): the next materialize takes them in (the next chunk's step, or the first decode
    # step)
    fetch_ahead: Future[tuple[list[bytes], torch.Tensor]] | None = None
    restored_bytes: int = 0
    num_demotions: int = 0
    num_adopted: int = 0  # prefix pages taken from the host store (never resident before)
    hidden_pages: int = 0  # pages a sparse step could not see (over the whole request)
    anchor: list[int] = field(default_factory=list)  # the prompt's final evidence, best first (anchor_pages)
    follow_at: int = -1  # follow_copy: the prompt position the answer was last found copying from (-1: not yet)
    prompt_tokens: PromptIndex | None = field(default=None, repr=False)  # follow_copy: the prompt's ids, searched
    # RingManager.plan's last plans by page count, each with the evidence and skeleton it was planned from: the
    # scheduler and the ring snapshot ask for the same plan many times per step, and it changes only when
    # one of the three does (a new page, a re-selection)
    plans: dict[int, tuple[frozenset[int], frozenset[int], BucketPlan]] = field(default_factory=dict, repr=False)

    @property
    def outgrew_device(self) -> bool:
        """Some of the context lived only on the host at some point (the prefill policy applied)."""
        return self.num_demotions > 0 or self.num_adopted > 0

    @property
    def unverified(self) -> bool:
        return self.policy == "sparse" and self.hidden_pages > 0
