"""The text of an L3 refusal: what the client reads instead of a guess, with the reason and the numbers."""

from __future__ import annotations

import logging

from services.gateway.planner.plan import PlanReport, Refusal

logger = logging.getLogger(__name__)

PREFIX = "I could not answer this faithfully"


class Refused(Exception):
    """Raised inside a plan to end it with a refusal."""

    def __init__(self, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def refusal_text(report: PlanReport) -> str:
    """`I could not answer this faithfully: <why>.` followed by how the request was handled."""
    how = f"The prompt has {report.prompt_tokens} tokens; the device pool holds {report.pool_tokens}"
    if report.num_shards:
        how += f"; it was split into {report.num_shards} parts and {report.num_calls} model calls were made"
    return f"{PREFIX}: {report.refusal_message.rstrip('.')}.\n\n({how}.)"


def over_pool(prompt_tokens: int, reserve: int, pool: int) -> str:
    return (
        f"the prompt ({prompt_tokens} tokens) plus room for the answer ({reserve}) is more than the "
        f"device pool ({pool} tokens), and the over-pool policy is 'refuse'. Ask with "
        "kvmem.over_pool_policy 'shard' to have it answered in parts, or shorten it"
    )


def not_splittable(why: str) -> str:
    return f"the prompt is larger than the device pool and cannot be answered in parts: {why}"


def frame_too_large(base_tokens: int, limit: int, answer_tokens: int) -> str:
    return (
        f"the instructions, the question and the rest of the conversation already take {base_tokens} "
        f"tokens of the {limit} a call may use (with {answer_tokens} kept for the answer), leaving no "
        "room for a part of the document"
    )


def no_evidence(num_shards: int, num_dropped: int) -> str:
    dropped = (
        f"; {num_dropped} answers were dropped because the text of their part did not bear them out"
        if num_dropped
        else ""
    )
    return f"none of the {num_shards} parts of the document gave an answer that its text supports{dropped}"


def disagreement(candidates: list[tuple[int, str, str]]) -> str:
    """candidates: (shard index, answer, quote) of each distinct answer."""
    listed = "; ".join(f'part {k + 1} says "{answer}" (text: "{quote}")' for k, answer, quote in candidates)
    return f"parts of the document give different answers and nothing in the text decides between them: {listed}"


def budget_exhausted(needed: int, max_calls: int, what: str) -> str:
    return f"{what} needs at least {needed} model calls, more than this request's budget of {max_calls}"
