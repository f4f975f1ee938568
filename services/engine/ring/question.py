"""The question of a question-first chat as a query of the prompt's final selection (RingLimits.question_pass).

A chat whose last user message puts the question before a long document gets the query span of the message's
end (the cache guard's question_start): the last chunk's scoring tokens are then the generation prompt's few
tokens, which read the document weakly, and the question's own tokens never saw the document (it came after
them: causal). Here the question's queries are kept, per scoring layer, when its chunk runs (the forward itself
stays causal: nothing the model computes changes), and the last prompt chunk, which attends every page anyway
(query_pass attention / exact: paged_attention._exact), also scores every page with them, the pages after the
question included: their mass is added to the tail's ("add") or ranks alone ("only").

The kept queries carry RoPE at the question's positions, so a page after the question is scored at a negative
relative distance, which the model never saw in training; the "_end" modes rotate them on to the prompt's end first
(`realign`: RoPE rotations compose), where every page lies at a distance the model knows. Which of these ranks best
is for bench/longeval's tuning split to say (bench/RESULTS.md); every mode is off by default.
Memory: question tokens x query heads x head dim floats per scoring layer, until the final selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.models.llama import RotaryEmbedding, apply_rope
from services.engine.ring.exact_attention import page_mass

QUESTION_MODES = ("add", "only", "add_end", "only_end")


@dataclass
class QuestionQuery:
    """A question's token span [start, end) before the query span, and its queries computed so far."""

    start: int
    end: int
    mode: str  # QUESTION_MODES
    upto: int = -1  # the queries of positions [start, upto) are kept (a chunk computed again keeps nothing new)
    queries: dict[int, list[torch.Tensor]] = field(default_factory=dict, repr=False)  # layer -> [n, Hq, D] parts

    def __post_init__(self) -> None:
        assert self.mode in QUESTION_MODES, self.mode
        assert 0 <= self.start < self.end, (self.start, self.end)
        self.upto = self.start

    @property
    def fusion(self) -> str:
        """How the question's mass joins the tail's: "add" or "only" (fuse_question)."""
        return self.mode.removesuffix("_end")

    @property
    def realigned(self) -> bool:
        """Whether the kept queries are rotated to the prompt's end (`realign`) before they are kept."""
        return self.mode.endswith("_end")

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """Offsets [lo, hi) in a chunk over positions [start, end) of the question tokens it computes first."""
        lo, hi = max(start, self.upto), min(end, self.end)
        return (lo - start, hi - start) if lo < hi else None

    def keep(self, kept: dict[int, torch.Tensor], chunk_start: int, offsets: tuple[int, int]) -> None:
        """A chunk's queries of the question (layer -> [hi - lo, Hq, D])."""
        for layer, q in kept.items():
            self.queries.setdefault(layer, []).append(q)
        self.upto = chunk_start + offsets[1]

    def stacked(self) -> dict[int, torch.Tensor]:
        """Per layer, every kept query [n, Hq, D]; empty until the question's chunk ran."""
        return {layer: parts[0] if len(parts) == 1 else torch.cat(parts) for layer, parts in self.queries.items()}

    def release(self) -> None:
        self.queries.clear()


def question_mass(
    q: torch.Tensor,
    keys: list[tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """The question's mean attention mass per head over pages [0, num_pages): [Hq, num_pages] float32.

    q: [n, Hq, D] the question's kept queries; keys: (k [Hkv, T_i, D], positions [T_i]) over disjoint key sets
    that together are every key of the prompt read so far: every key is visible (no causal mask: the pages after
    the question are what it is asked about)."""
    return page_mass(q, [(k, pos, None) for k, pos in keys], scale, num_pages, page_size).mean(dim=0)


def fuse_question(tail: torch.Tensor, question: torch.Tensor | None, mode: str) -> torch.Tensor:
    """One layer's page masses [Hq, Np]: the tail's, with the question's added ("add") or alone ("only"; either
    with "_end"); the tail's where the layer kept no question queries."""
    if question is None:
        return tail
    return question if mode.removesuffix("_end") == "only" else tail + question


def realign(q: torch.Tensor, positions: torch.Tensor, target: int, rotary: RotaryEmbedding) -> torch.Tensor:
    """Queries q [n, Hq, D] that carry RoPE at `positions` [n], rotated on to position `target` (RoPE rotates each
    pair of dims by position x frequency, so rotating by target - position composes to the rotation at target): a
    key at any position before target is then scored at the non-negative distance it would have from there."""
    cos, sin = rotary(target - positions, q.dtype).rows
    return apply_rope(q, cos, sin)
