"""Sequence: one request's tokens, page table, sampling state and outgoing events."""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass, field
from itertools import compress
from typing import TYPE_CHECKING, NamedTuple

import torch

from services.engine.step.detokenizer import Detokenizer
from services.engine.step.sampling import Sampled, SamplingParams

if TYPE_CHECKING:
    from services.engine.ring.state import SeqRing
    from services.engine.step.grammar import GrammarMatcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Chunk(NamedTuple):
    token_ids: list[int]
    text: str
    logprobs: tuple[Sampled, ...] = ()  # one per token when the request asked for logprobs


class Done(NamedTuple):
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    matched_stop: str
    prefill_policy: str = "resident"  # resident, exact or sparse
    unverified: bool = False


class Failed(NamedTuple):
    code: str  # "overloaded", "internal", "invalid_argument", "unavailable"
    message: str


Event = Chunk | Done | Failed

NOT_RESIDENT = -1
PENDING = -1  # an output token the device has chosen and the host has not read yet


@dataclass
class PageTable:
    """A sequence's logical pages in order: the slot of each (NOT_RESIDENT when only the host copy
    exists), and the hash of each finished (full) page."""

    slot_ids: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)

    def resident_pages(self) -> list[int]:
        """The pages with a slot, in order (compress and map run in C: a long context's table has hundreds
        of pages, walked per sequence and step)."""
        return list(compress(range(len(self.slot_ids)), map(NOT_RESIDENT.__ne__, self.slot_ids)))

    def resident_exactly(self, pages: frozenset[int]) -> bool:
        """Whether exactly `pages` have a slot: each of them has one and no other page does. The same answer
        as `set(resident_pages()) == pages` in O(len(pages)) Python steps (the count of slots runs in C), so
        that the scheduler can check its plan against the table on every room-making."""
        slot_ids = self.slot_ids
        n = len(slot_ids)
        for p in pages:
            if p >= n or slot_ids[p] == NOT_RESIDENT:
                return False
        return n - slot_ids.count(NOT_RESIDENT) == len(pages)


@dataclass(eq=False)  # identity: a sequence is one request
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    namespace: str
    max_tokens: int  # resolved: never past the context limit
    stop_token_ids: frozenset[int]
    detokenizer: Detokenizer
    generator: torch.Generator | None
    prefill_policy: str = "sparse"  # for the part of the context that outgrows the ring budget
    query_start: int = -1  # token index of the query (last user turn); -1: unknown
    question: tuple[int, int] | None = None  # tokens the ring reads again at the prompt's end (question replay)
    question_alone: bool = False  # that replay alone ranks the prompt's pages (the query span asks nothing)
    matcher: GrammarMatcher | None = None  # its grammar's state (constrained decoding), advanced by each token
    output_ids: list[int] = field(default_factory=list)  # the last num_pending are PENDING
    num_pending: int = 0  # output tokens of a decode burst in flight (engine.py: overlapped bursts)
    status: SeqStatus = SeqStatus.WAITING
    page_table: PageTable = field(default_factory=PageTable)
    ring: SeqRing | None = None  # set at admission when the engine runs a ring
    local_ring: int = -1  # its ring of the sliding-window layers (LocalRings), while admitted
    local_end: int = 0  # positions written into that ring (a decode burst cut short writes ahead of num_computed)
    state_slot: int = -1  # its slot of the linear-attention layers' states (RecurrentStates), while admitted
    num_computed: int = 0  # tokens whose K/V has been computed (resident or on the host)
    num_cached: int = 0  # prompt tokens reused from the prefix cache (first admission)
    admitted_once: bool = False
    finish_reason: FinishReason | None = None
    events: queue.Queue[Event] = field(default_factory=queue.Queue)
    arrival: float = field(default_factory=time.monotonic)

    @property
    def known_outputs(self) -> int:
        """Output tokens the host has read."""
        return len(self.output_ids) - self.num_pending

    def add_pending(self, count: int) -> None:
        """A burst of `count` steps was launched: its tokens hold places in the output until they are read."""
        self.output_ids.extend([PENDING] * count)
        self.num_pending += count

    def fill_pending(self, token: int) -> None:
        """The first pending token has been read."""
        self.output_ids[len(self.output_ids) - self.num_pending] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """Forget the tokens not read yet (a stop before them, a failure): the output ends at the last read
        token, and the K/V computed is the context before it."""
        if self.num_pending:
            del self.output_ids[-self.num_pending :]
            self.num_pending = 0
            self.num_computed = min(self.num_computed, self.num_tokens - 1)

    def token_at(self, pos: int) -> int:
        """The token at `pos` without building prompt + output (token_ids copies the whole context)."""
        prompt = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < prompt else self.output_ids[pos - prompt]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
