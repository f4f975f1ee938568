"""The segment planner behind the routes: the level of each request, and the answers of the
levels that are not one engine call (L2, L2z, L3) as one JSON body or as SSE with progress.

L1 requests go on through the route's usual Generate stream; only `kvmem.plan` is added to them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

from pydantic import BaseModel

from services.common.protos import cacheguard_pb2
from services.gateway import builders, convert, responses
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError, internal_error
from services.gateway.guard_client import GuardClient
from services.gateway.planner.backend import GuardBackend
from services.gateway.planner.plan import Decision, Limits, PlannedAnswer, PlanRequest, Progress

__all__ = ["Decision", "decide", "sse_body", "whole"]
from services.gateway.planner.planner import Planner

logger = logging.getLogger(__name__)

OnDone = Callable[[cacheguard_pb2.GuardDone], None]
OnStreamError = Callable[[str], None]


async def decide(
    guard: GuardClient, config: GatewayConfig, greq: cacheguard_pb2.GuardGenerateRequest, plan: PlanRequest
) -> tuple[Planner, Decision]:
    """The planner of this request and its decision (from the engine's model info and, when the
    prompt may be over the pool, the guard's token count)."""
    info = await guard.model_info()
    backend = GuardBackend(guard, greq.request_id, greq.tenant, convert.count_request(greq))
    planner = Planner(backend, config.planner, Limits(info.kv_capacity, info.max_context))
    decision = await planner.decide(plan)
    logger.info(
        "request %s: %s (policy %s, %d prompt tokens, pool %d)",
        greq.request_id, decision.level.value, plan.policy, decision.report.prompt_tokens, info.kv_capacity,
    )  # fmt: skip
    return planner, decision


async def whole(
    planner: Planner, decision: Decision, builder: builders.ResponseBuilder, session_id: str
) -> tuple[BaseModel, cacheguard_pb2.GuardDone]:
    """Run the plan; the non-streamed response and the done standing for it."""
    answer = await planner.run(decision)
    done = _finish(builder, answer, session_id)
    return builder.whole(answer.text, done), done


async def sse_body(
    planner: Planner,
    decision: Decision,
    builder: builders.ResponseBuilder,
    session_id: str,
    include_usage: bool,
    on_done: OnDone,
    on_error: OnStreamError,
) -> AsyncIterator[str]:
    """SSE of a planned answer: the opening chunk, a `kvmem.progress` chunk (no choices) per step
    of the plan, the answer as one delta, the closing chunk with `kvmem.plan`, usage if asked.
    Closing the iterator (the client went away) cancels the plan and its model calls."""
    steps: asyncio.Queue[Progress | None] = asyncio.Queue()

    async def progress(step: Progress) -> None:
        steps.put_nowait(step)

    task = asyncio.ensure_future(planner.run(decision, progress))
    task.add_done_callback(lambda _: steps.put_nowait(None))
    try:
        opening = builder.opening()
        if opening is not None:
            yield _sse(opening)
        while (step := await steps.get()) is not None:
            yield _sse(builder.progress(step))
        answer = task.result()
        done = _finish(builder, answer, session_id)
        on_done(done)
        yield _sse(builder.delta(answer.text))
        yield _sse(builder.closing(done))
        if include_usage:
            yield _sse(builder.usage_chunk(done))
    except GatewayError as err:
        on_error(err.type)
        yield _sse(err.body())
    except Exception:
        logger.exception("request %s: error while planning", builder.id)
        on_error("server_error")
        yield _sse(internal_error().body())
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    yield "data: [DONE]\n\n"


def _finish(builder: builders.ResponseBuilder, answer: PlannedAnswer, session_id: str) -> cacheguard_pb2.GuardDone:
    builder.plan = answer.report
    return responses.planned_done(answer, session_id)


def _sse(payload: BaseModel | dict[str, Any]) -> str:
    text = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {text}\n\n"
