"""Which pages become a ring sequence's evidence: pure functions over page scores and token ids, no state.

`page_ranking` turns accumulated scores (or per-head attention masses) into one score a page, `taking_turns` merges
the rankings of two queries (a question replay's and the query span's), `pick_pages` walks
a ranking into the evidence budget with seam neighbours and read-ahead, and `copy_source` finds where an answer
that copies the prompt reads next (copy following) in the prompt's `PromptIndex`. RingManager.select (ring.py)
composes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from services.engine.ring.summaries import fuse_heads


def page_ranking(scores: torch.Tensor, num_pages: int, excluded: set[int], head_fusion: str) -> torch.Tensor:
    """Page scores [num_pages] to rank candidates by: accumulated scores as they are, or per-head masses
    [heads, pages] (an attention query pass) fused over the candidate pages only (summaries.fuse_heads)."""
    if scores.dim() == 1:
        return scores[:num_pages]
    mass = scores[:, :num_pages]
    candidate = torch.ones(mass.shape[-1], dtype=torch.bool)
    candidate[[p for p in excluded if p < mass.shape[-1]]] = False
    return fuse_heads(mass, candidate, head_fusion)


def taking_turns(*rankings: Sequence[int]) -> list[int]:
    """Rankings merged by turns (the first's best, the second's best, the first's second...), each page once:
    two queries that rank pages on unrelated scales (a question replay and the query span) share the evidence."""
    out: list[int] = []
    seen: set[int] = set()
    for tier in zip(*rankings, strict=False):
        for page in tier:
            if page not in seen:
                seen.add(page)
                out.append(page)
    longest = max(rankings, key=len, default=[])
    out.extend(p for p in longest if p not in seen)  # (rankings of one sequence's pages are the same length)
    return out


def pick_pages(
    order: Iterable[int],
    num_pages: int,
    excluded: set[int],
    room: int,
    reach: int,
    anchored: Sequence[int] = (),
    ahead: int = 0,
) -> list[int]:
    """Evidence in `order` (best first): each page with `reach` seam neighbours either side and at least `ahead`
    pages after it (anchored pages without either: they came with theirs already), skipping excluded ones and
    pages past num_pages, up to `room`."""
    chosen: list[int] = []
    for p in order:
        r = 0 if p in anchored else reach
        a = 0 if p in anchored else max(reach, ahead)
        for q in [p, *range(p + 1, p + 1 + a), *range(p - 1, p - 1 - r, -1)]:
            if len(chosen) >= room:
                return chosen
            if 0 <= q < num_pages and q not in excluded and q not in chosen:
                chosen.append(q)
    return chosen


class PromptIndex:
    """A prompt's token ids and where each id occurs: copy_source's occurrences of a tail's first token by a binary
    search instead of a scan of the whole prompt per tail length (a decode re-selection's share of the engine thread
    at batch: ~150 us a scan of 12K tokens on the CPU). Made once per sequence, at admission."""

    def __init__(self, prompt: Sequence[int] | np.ndarray) -> None:
        self.tokens = np.asarray(prompt, dtype=np.int64)
        self._order = np.argsort(self.tokens, kind="stable")  # positions by id, ascending within one id
        self._sorted = self.tokens[self._order]

    def positions(self, token: int) -> np.ndarray:
        """Where `token` occurs, ascending."""
        lo = int(self._sorted.searchsorted(token))
        return self._order[lo : int(self._sorted.searchsorted(token, side="right"))]


def copy_source(
    prompt: PromptIndex, recent: Sequence[int], longest: int, near: int, allowed: np.ndarray, page_size: int
) -> int:
    """Where an answer that copies the prompt reads next: the position after an occurrence of its last `longest`
    tokens in `prompt` (the last 2 at the shortest, when no longer tail occurs), the first at or after `near` (where it
    last read), else the last one before it; only positions on pages `allowed` [pages] marks (the prompt's other
    pages are resident anyway). -1 when the tail occurs nowhere allowed."""
    tokens = prompt.tokens
    for n in range(min(longest, len(recent)), 1, -1):
        tail = recent[-n:]
        starts = prompt.positions(int(tail[0]))
        if not len(starts):
            continue  # the tail's first token is nowhere in the prompt (no numpy work for it)
        starts = starts[starts < len(tokens) - n]  # an occurrence with a token after it
        for i in range(1, n):
            if not len(starts):
                break
            starts = starts[tokens[starts + i] == int(tail[i])]
        after = starts + n
        after = after[allowed[np.minimum(after // page_size, len(allowed) - 1)]]
        if len(after):
            ahead = after[after >= near]
            return int(ahead[0] if len(ahead) else after[-1])
    return -1
