"""The planner's vocabulary: settings, limits, the request as the planner sees it, the decision,
and the report that tells the client how its answer was produced."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from services.gateway.planner.task import Message, Task

logger = logging.getLogger(__name__)

OVER_POOL_POLICIES = ("shard", "sparse", "exact", "refuse")


class Level(str, Enum):
    L1 = "L1"  # one engine call (the prompt fits the pool, or the engine's ring prefills it: sparse/exact)
    L2 = "L2"  # shards mapped to partial answers, reduced
    L2Z = "L2z"  # the reduce input itself was over the pool: re-sharded and reduced again
    L3 = "L3"  # a visible refusal


class Refusal(str, Enum):
    OVER_POOL = "over_pool"  # policy `refuse`
    NOT_SPLITTABLE = "not_splittable"  # no document/question shape, tools, token ids
    FRAME_TOO_LARGE = "frame_too_large"  # instructions + question leave no room for a shard
    NO_EVIDENCE = "no_evidence"  # no shard gave an answer that checks against its text
    DISAGREEMENT = "disagreement"  # shards give different checked answers
    BUDGET_EXHAUSTED = "budget_exhausted"  # more model calls needed than max_calls
    FIELD_MISSING = "field_missing"  # an aggregation's field is missing from matching records


@dataclass(frozen=True)
class PlannerSettings:
    """Server-side defaults (GatewayConfig) of the planner."""

    over_pool_policy: str = "shard"
    max_calls: int = 32  # model calls one request may make
    map_concurrency: int = 4  # map calls in flight at once (also capped by what the pool holds)
    answer_reserve: int = 128  # tokens kept for the answer when the request sets no max_tokens
    map_max_tokens: int = 48
    extract_max_tokens: int = 160
    reduce_max_tokens: int = 128


class Limits(NamedTuple):
    """From the engine's model info."""

    kv_capacity: int  # device pool, tokens
    max_context: int  # one sequence's logical context, tokens

    @property
    def call_limit(self) -> int:
        """What one map or reduce call (prompt + answer) may take."""
        return min(self.kv_capacity, self.max_context)


@dataclass(frozen=True)
class PlanRequest:
    """One client request as the planner sees it; exactly one of messages / prompt_text /
    num_prompt_token_ids is set."""

    policy: str
    max_calls: int
    max_tokens: int | None = None
    messages: tuple[Message, ...] | None = None
    prompt_text: str | None = None
    num_prompt_token_ids: int | None = None
    extra_chars: int = 0  # text rendered besides message contents (tool definitions and calls, reasoning)
    has_tools: bool = False  # tools or tool calls: not split (a tool call needs the whole context)


@dataclass
class Evidence:
    shard: int
    quote: str


@dataclass
class PlanReport:
    """How an answer was produced; filled in while planning, sent as `kvmem.plan`."""

    level: Level
    over_pool_policy: str
    pool_tokens: int
    answer_reserve_tokens: int
    max_calls: int
    prompt_tokens: int = 0  # the client's prompt; 0 until known (an L1 prompt is counted by the engine)
    over_pool: bool = False
    prefill_policy: str = ""  # resident / sparse / exact, as the engine reported; "" without calls
    unverified: list[str] = field(default_factory=list)
    num_shards: int = 0
    shard_tokens: int = 0  # the shard size budget
    num_calls: int = 0
    map: str = ""  # model, extract, literal
    reduce: str = ""  # single, agreement, model, count, sum, list, min, max
    num_rounds: int = 0  # reduce rounds (more than 1: L2z)
    num_dropped: int = 0  # partial answers or items dropped because the shard text did not bear them out
    evidence: list[Evidence] = field(default_factory=list)
    aggregate: dict[str, str | int] | None = None
    refusal: Refusal | None = None
    refusal_message: str = ""

    def flag(self, reason: str) -> None:
        """Mark the answer unverified for `reason` (once)."""
        if reason not in self.unverified:
            self.unverified.append(reason)

    def note_policy(self, policy: str, unverified: bool) -> None:
        """Record an engine call's prefill policy; a sparse prefill flags the answer."""
        if policy and (not self.prefill_policy or self.prefill_policy == "resident"):
            self.prefill_policy = policy
        if unverified:
            self.flag(f"{policy or 'engine'}_prefill")


class Decision(NamedTuple):
    """The level chosen for a request, before any model call."""

    level: Level
    report: PlanReport
    task: Task | None = None  # L2
    prefill_policy: str = ""  # L1: "" (engine default), "sparse" or "exact"


class Usage(NamedTuple):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class PlannedAnswer(NamedTuple):
    """The result of an L2/L2z/L3 plan: the text the client reads and how it was made."""

    text: str
    report: PlanReport
    usage: Usage
    engine_replica: str  # of the last call ("" without calls)


class Progress(NamedTuple):
    """Sent while a plan runs (streamed to the client as a kvmem.progress chunk)."""

    phase: str  # map, reduce
    done: int
    total: int
    num_calls: int
