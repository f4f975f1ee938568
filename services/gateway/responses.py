"""Engine and guard results to the pieces of an OpenAI response: finish_reason, usage, the `kvmem` object (prefix
report, routing, the plan) and the /v1/models card."""

from __future__ import annotations

import dataclasses
import logging

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import schemas
from services.gateway.planner.plan import Level, PlannedAnswer, PlanReport

logger = logging.getLogger(__name__)

FINISH_REASONS: dict[int, str] = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: "stop",
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


def finish_reason(reason: int) -> str:
    """OpenAI finish_reason of an engine FinishReason."""
    return FINISH_REASONS.get(reason, "stop")


def usage_of(u: engine_pb2.Usage) -> schemas.Usage:
    """OpenAI usage, with prompt_tokens_details.cached_tokens from the engine's reuse count."""
    return schemas.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


def plan_info(report: PlanReport, done: cacheguard_pb2.GuardDone) -> schemas.PlanInfo:
    """The `kvmem.plan` object; an L1 report is completed from the engine's done."""
    if report.level is Level.L1:  # the one call is the client's own: the engine's done says how it went
        d = done.engine_done
        report = dataclasses.replace(report, num_calls=1, unverified=list(report.unverified))
        report.prompt_tokens = report.prompt_tokens or d.usage.prompt_tokens
        report.note_policy(d.prefill_policy or "resident", d.unverified)
    return schemas.PlanInfo(
        level=report.level.value,
        over_pool_policy=report.over_pool_policy,
        over_pool=report.over_pool,
        prompt_tokens=report.prompt_tokens,
        pool_tokens=report.pool_tokens,
        answer_reserve_tokens=report.answer_reserve_tokens,
        prefill_policy=report.prefill_policy,
        unverified=list(report.unverified),
        num_shards=report.num_shards,
        shard_tokens=report.shard_tokens,
        num_calls=report.num_calls,
        max_calls=report.max_calls,
        map=report.map,
        reduce=report.reduce,
        num_rounds=report.num_rounds,
        num_dropped=report.num_dropped,
        evidence=[schemas.PlanEvidence(shard=e.shard, quote=e.quote) for e in report.evidence],
        aggregate=report.aggregate,
        refusal=schemas.PlanRefusal(reason=report.refusal.value, message=report.refusal_message)
        if report.refusal
        else None,
    )


def planned_done(answer: PlannedAnswer, session_id: str) -> cacheguard_pb2.GuardDone:
    """A GuardDone standing for a planned answer: usage summed over its calls, no prefix report."""
    u = answer.usage
    engine_done = engine_pb2.GenerateDone(
        finish_reason=engine_pb2.FINISH_REASON_STOP,
        usage=engine_pb2.Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens, cached_tokens=u.cached_tokens
        ),
        prefill_policy=answer.report.prefill_policy,
        unverified=bool(answer.report.unverified),
    )
    prefix = cacheguard_pb2.PrefixReport(session_id=session_id, divergence_message_index=-1)
    return cacheguard_pb2.GuardDone(engine_done=engine_done, prefix=prefix, engine_replica=answer.engine_replica)


def kvmem_info(done: cacheguard_pb2.GuardDone, plan: PlanReport | None = None) -> schemas.KvmemInfo:
    """The `kvmem` extension object: the guard's prefix report, the engine replica, the plan."""
    p = done.prefix
    return schemas.KvmemInfo(
        engine_replica=done.engine_replica,
        matched_stop=done.engine_done.matched_stop,
        plan=plan_info(plan, done) if plan is not None else None,
        prefix=schemas.PrefixInfo(
            session_id=p.session_id,
            previous_tokens=p.previous_tokens,
            common_prefix_tokens=p.common_prefix_tokens,
            diverged=p.diverged,
            divergence_message_index=p.divergence_message_index,
            divergence_reason=p.divergence_reason,
            divergence_field=p.divergence_field,
            normalizations=list(p.normalizations),
        ),
        routing=done.routing,
        moved_from=done.moved_from,
    )


def model_card(info: engine_pb2.GetModelInfoResponse) -> schemas.ModelCard:
    """One /v1/models entry, with the context and pool sizes under `kvmem`."""
    return schemas.ModelCard(
        id=info.model_id,
        kvmem=schemas.ModelKvmem(
            architecture=info.architecture,
            max_context=info.max_context,
            kv_capacity=info.kv_capacity,
            page_size=info.page_size,
            kv_format=info.kv_format,
        ),
    )
