"""Work: what one sequence runs in a forward step (the scheduler's output, the runners' input), and Switch: a ring
sequence's read set changing inside a decode burst."""

from __future__ import annotations

from typing import NamedTuple

from services.engine.step.sequence import Sequence


class Switch(NamedTuple):
    """A ring sequence's read set changing inside a decode burst (a decode re-selection taking effect on the
    device, scheduler._burst): the burst's steps before position `pos` read the sequence's resident pages without
    `joining`, its steps from `pos` on read them without `leaving` (both sets of page numbers, resident)."""

    pos: int
    leaving: frozenset[int]
    joining: frozenset[int]


class Work(NamedTuple):
    """`num_new` tokens of `seq` starting at position `start` go through the model this step."""

    seq: Sequence
    start: int
    num_new: int
    score_tokens: int = 0  # trailing tokens of this work whose queries score pages (ring)
    score_only: bool = False  # a scoring pass: nothing is kept but the scores
    num_steps: int = 1  # a decode burst: this many greedy decode steps in a row (num_new == 1)
    on_device: bool = False  # its input token is the last step's argmax, not read by the host yet
    device_argmax: bool = False  # its tokens are each step's argmax, chosen on the device (a greedy decode burst)
    # the step attends every earlier page, host-only ones streamed in, and its scoring tokens rank the pages by
    # their real attention mass (RingLimits.query_pass "attention" and "exact"): the prompt's final selection
    exact_query: bool = False
    # a question replay (RingLimits.question_replay; score_only): its tokens are the prompt's from this index on,
    # at positions [start, start + num_new) past what the sequence has computed, attending it; -1: the sequence's own
    replay_from: int = -1
    # a decode burst that scores (score_tokens): the position of the step whose query scores the pages; -1: the
    # burst's last step
    score_pos: int = -1
    switch: Switch | None = None  # a re-selection taking effect inside this burst (Switch)

    @property
    def samples(self) -> bool:
        """The step reaches the end of the sequence, so its last logits give the next token."""
        return not self.score_only and self.start + self.num_new == self.seq.num_tokens
