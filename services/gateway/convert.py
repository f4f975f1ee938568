"""Conversions between the OpenAI shapes (schemas.py) and the cache guard protos, both directions."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

from pydantic import BaseModel

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import schemas
from services.gateway.errors import invalid_request
from services.gateway.planner.plan import Level, PlannedAnswer, PlannerSettings, PlanReport, PlanRequest, Progress
from services.gateway.planner.task import Message

logger = logging.getLogger(__name__)

UINT64_MASK = 2**64 - 1
_TOKEN_ID = re.compile(r"[0-9]+")

FINISH_REASONS: dict[int, str] = {
    engine_pb2.FINISH_REASON_UNSPECIFIED: "stop",
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}
PREFILL_POLICIES: dict[str, int] = {
    "": engine_pb2.PREFILL_POLICY_UNSPECIFIED,
    "exact": engine_pb2.PREFILL_POLICY_EXACT,
    "sparse": engine_pb2.PREFILL_POLICY_SPARSE,
}

# ---------------------------------------------------------------- requests


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """logit_bias keys are token ids written as decimal strings; anything else is a 400."""
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key) or int(key) > schemas.INT32_MAX:
            raise invalid_request(
                f"Invalid value for 'logit_bias': key {key!r} is not a token id (a non-negative integer).",
                "logit_bias",
            )
        parsed[int(key)] = value
    return parsed


def sampling_params(
    req: schemas.ChatCompletionRequest | schemas.CompletionRequest,
) -> engine_pb2.SamplingParams:
    """Sampling fields of a request; unset optional fields stay unset (the engine's defaults apply)."""
    params = engine_pb2.SamplingParams(
        top_k=max(req.top_k or 0, 0),
        max_tokens=req.max_new_tokens or 0,
        stop=req.stop_list,
        stop_token_ids=req.stop_token_ids or [],
        logit_bias=parse_logit_bias(req.logit_bias),
        ignore_eos=req.ignore_eos,
    )
    if req.temperature is not None:
        params.temperature = req.temperature
    if req.top_p is not None:
        params.top_p = req.top_p
    if req.seed is not None:
        params.seed = req.seed & UINT64_MASK  # negative seeds wrap, as two's complement
    return params


def _chat_message(msg: schemas.ChatMessage) -> cacheguard_pb2.ChatMessage:
    return cacheguard_pb2.ChatMessage(
        role="system" if msg.role == "developer" else msg.role,
        content=msg.content or "",
        name=msg.name or "",
        tool_call_id=msg.tool_call_id or "",
        reasoning_content=msg.reasoning_content or "",
        tool_calls=[
            cacheguard_pb2.ToolCall(id=tc.id, name=tc.function.name, arguments_json=tc.function.arguments)
            for tc in msg.tool_calls or []
        ],
    )


def _tool(tool: schemas.ToolDef) -> cacheguard_pb2.ToolDefinition:
    fn = tool.function
    params = json.dumps(fn.parameters) if fn.parameters is not None else ""
    return cacheguard_pb2.ToolDefinition(name=fn.name, description=fn.description, parameters_json=params)


def chat_input(req: schemas.ChatCompletionRequest) -> cacheguard_pb2.ChatInput:
    """Messages and tools as the guard renders them (developer is sent as system)."""
    return cacheguard_pb2.ChatInput(
        messages=[_chat_message(m) for m in req.messages],
        tools=[_tool(t) for t in req.tools or []],
    )


def chat_request(
    req: schemas.ChatCompletionRequest, *, request_id: str, session_id: str, tenant: str
) -> cacheguard_pb2.GuardGenerateRequest:
    """A chat completions request as a GuardGenerateRequest with ChatInput."""
    return cacheguard_pb2.GuardGenerateRequest(
        request_id=request_id,
        session_id=session_id,
        tenant=tenant,
        chat=chat_input(req),
        sampling=sampling_params(req),
    )


def completion_request(
    req: schemas.CompletionRequest, *, request_id: str, session_id: str, tenant: str
) -> cacheguard_pb2.GuardGenerateRequest:
    """A completions request: a prompt string -> prompt_text, a token list -> prompt_tokens."""
    out = cacheguard_pb2.GuardGenerateRequest(
        request_id=request_id, session_id=session_id, tenant=tenant, sampling=sampling_params(req)
    )
    if isinstance(req.prompt, str):
        out.prompt_text = req.prompt
    else:
        out.prompt_tokens.token_ids.extend(req.prompt)
    return out


def plan_request(
    req: schemas.ChatCompletionRequest | schemas.CompletionRequest, settings: PlannerSettings
) -> PlanRequest:
    """The request as the segment planner sees it, with the server defaults filled in."""
    options = req.kvmem or schemas.KvmemOptions()
    common: dict[str, Any] = {
        "policy": options.over_pool_policy or settings.over_pool_policy,
        "max_calls": options.max_calls or settings.max_calls,
        "max_tokens": req.max_new_tokens,
    }
    if isinstance(req, schemas.ChatCompletionRequest):
        calls = [c for m in req.messages for c in m.tool_calls or []]
        common["has_tools"] = bool(req.tools or calls)
        common["extra_chars"] = (
            len(json.dumps([t.model_dump() for t in req.tools or []]).encode())
            + sum(len(c.function.name) + len(c.function.arguments.encode()) + 32 for c in calls)
            + sum(len((m.reasoning_content or "").encode()) + len((m.name or "").encode()) for m in req.messages)
        )
        messages = tuple(Message(m.role if m.role != "developer" else "system", m.content or "") for m in req.messages)
        return PlanRequest(messages=messages, **common)
    if isinstance(req.prompt, str):
        return PlanRequest(prompt_text=req.prompt, **common)
    return PlanRequest(num_prompt_token_ids=len(req.prompt), **common)


def count_request(greq: cacheguard_pb2.GuardGenerateRequest) -> cacheguard_pb2.CountTokensRequest:
    """The CountTokens request of a Generate request's input."""
    out = cacheguard_pb2.CountTokensRequest()
    kind = greq.WhichOneof("input")
    if kind == "chat":
        out.chat.CopyFrom(greq.chat)
    elif kind == "prompt_text":
        out.prompt_text = greq.prompt_text
    elif kind == "prompt_tokens":
        out.prompt_tokens.CopyFrom(greq.prompt_tokens)
    out.session_id, out.tenant, out.normalizations_off = greq.session_id, greq.tenant, greq.normalizations_off
    return out


def prefill_policy(name: str) -> int:
    """The engine's PrefillPolicy of a planner decision ("" = the engine's default)."""
    return PREFILL_POLICIES[name]


# ---------------------------------------------------------------- responses


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


class ResponseBuilder:
    """Builds the response objects of one request; ChatBuilder and CompletionBuilder fill in the shapes."""

    def __init__(self, response_id: str, created: int, model: str) -> None:
        self.id = response_id
        self.created = created
        self.model = model
        self.plan: PlanReport | None = None  # set by the planner; sent as kvmem.plan

    def progress(self, progress: Progress) -> dict[str, Any]:
        """A streamed chunk with no choices carrying the planner's progress under kvmem.progress."""
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "kvmem": {"progress": progress._asdict()},
        }

    chunk_object = ""

    def opening(self) -> BaseModel | None:
        """The chunk sent before any text (chat: the role), or None."""
        return None

    def delta(self, text: str) -> BaseModel:
        """A streamed chunk carrying a text delta."""
        raise NotImplementedError

    def closing(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        """The streamed chunk carrying finish_reason and the kvmem object."""
        raise NotImplementedError

    def usage_chunk(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        """The stream_options.include_usage chunk: no choices, usage only."""
        raise NotImplementedError

    def whole(self, text: str, done: cacheguard_pb2.GuardDone) -> BaseModel:
        """The non-streamed response."""
        raise NotImplementedError


class ChatBuilder(ResponseBuilder):
    """chat.completion and chat.completion.chunk objects."""

    chunk_object = "chat.completion.chunk"

    def _chunk(
        self, delta: schemas.Delta, reason: str | None = None, kvmem: schemas.KvmemInfo | None = None
    ) -> BaseModel:
        choice = schemas.ChunkChoice(delta=delta, finish_reason=reason)
        return schemas.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice], kvmem=kvmem
        )

    def opening(self) -> BaseModel:
        return self._chunk(schemas.Delta(role="assistant", content=""))

    def delta(self, text: str) -> BaseModel:
        return self._chunk(schemas.Delta(content=text))

    def closing(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        reason = finish_reason(done.engine_done.finish_reason)
        return self._chunk(schemas.Delta(), reason, kvmem=kvmem_info(done, self.plan))

    def usage_chunk(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        return schemas.ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage_of(done.engine_done.usage),
        )

    def whole(self, text: str, done: cacheguard_pb2.GuardDone) -> BaseModel:
        choice = schemas.ChatChoice(
            message=schemas.AssistantMessage(content=text),
            finish_reason=finish_reason(done.engine_done.finish_reason),
        )
        return schemas.ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=usage_of(done.engine_done.usage),
            kvmem=kvmem_info(done, self.plan),
        )


class CompletionBuilder(ResponseBuilder):
    """text_completion objects (streamed chunks have the same shape)."""

    chunk_object = "text_completion"

    def _completion(
        self,
        choices: list[schemas.CompletionChoice],
        usage: schemas.Usage | None = None,
        kvmem: schemas.KvmemInfo | None = None,
    ) -> BaseModel:
        return schemas.Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage, kvmem=kvmem
        )

    def delta(self, text: str) -> BaseModel:
        return self._completion([schemas.CompletionChoice(text=text)])

    def closing(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        choice = schemas.CompletionChoice(text="", finish_reason=finish_reason(done.engine_done.finish_reason))
        return self._completion([choice], kvmem=kvmem_info(done, self.plan))

    def usage_chunk(self, done: cacheguard_pb2.GuardDone) -> BaseModel:
        return self._completion([], usage=usage_of(done.engine_done.usage))

    def whole(self, text: str, done: cacheguard_pb2.GuardDone) -> BaseModel:
        choice = schemas.CompletionChoice(text=text, finish_reason=finish_reason(done.engine_done.finish_reason))
        return self._completion([choice], usage=usage_of(done.engine_done.usage), kvmem=kvmem_info(done, self.plan))
