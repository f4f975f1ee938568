"""Conversions between the OpenAI shapes (schemas.py) and the cache guard protos, both directions."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

from pydantic import BaseModel

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import schemas, tools
from services.gateway.errors import GatewayError, invalid_request
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


def request_tools(req: schemas.ChatCompletionRequest) -> list[tools.Tool]:
    return [tools.Tool(t.function.name, t.function.parameters or {}) for t in req.tools or []]


def tool_mode(req: schemas.ChatCompletionRequest, fmt: str) -> str:
    """ "" (no tools, or tool_choice none: output is text), "auto" (parsed) or "forced" (constrained decoding);
    a model whose template renders no tool calls cannot take tools: a 400, never tools silently dropped."""
    if not req.tools or req.tool_choice == "none":
        return ""
    if fmt not in tools.FORMATS:
        raise invalid_request(
            "This model's chat template renders no tool calls (use a template that does, e.g. the cache guard's "
            "--chat-template deploy/templates/smollm2-agent.jinja).",
            "tools",
            "tools_not_supported",
        )
    return "forced" if req.forces_tool_call else "auto"


def grammar_of(req: schemas.ChatCompletionRequest, fmt: str) -> engine_pb2.Grammar | None:
    """The engine grammar of response_format json_object / json_schema, or of a forced tool call."""
    if req.forces_tool_call and tool_mode(req, fmt) == "forced":
        chosen = request_tools(req)
        if isinstance(req.tool_choice, schemas.ToolChoiceNamed):
            chosen = [t for t in chosen if t.name == req.tool_choice.function.name]
        g = tools.forced_grammar(chosen, fmt, req.parallel_tool_calls is not False and len(chosen) >= 1)
        return engine_pb2.Grammar(
            kind="json_schema", text=json.dumps(g.schema), prefix=g.prefix, suffix=g.suffix,
            separator=g.separator, max_repeats=g.max_calls,
        )  # fmt: skip
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return engine_pb2.Grammar(kind="json_object")
    assert rf.json_schema is not None and rf.json_schema.schema_ is not None
    return engine_pb2.Grammar(kind="json_schema", text=json.dumps(rf.json_schema.schema_))


def sampling_params(
    req: schemas.ChatCompletionRequest | schemas.CompletionRequest, tool_format: str = ""
) -> engine_pb2.SamplingParams:
    """Sampling fields of a request; unset optional fields stay unset (the engine's defaults apply)."""
    params = engine_pb2.SamplingParams(
        top_k=max(req.top_k or 0, 0),
        max_tokens=req.max_new_tokens or 0,
        stop=req.stop_list,
        stop_token_ids=req.stop_token_ids or [],
        logit_bias=parse_logit_bias(req.logit_bias),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )
    if req.repetition_penalty is not None:
        params.repetition_penalty = req.repetition_penalty
    if isinstance(req, schemas.ChatCompletionRequest):
        params.logprobs = bool(req.logprobs)
        params.top_logprobs = req.top_logprobs or 0
        grammar = grammar_of(req, tool_format)
        if grammar is not None:
            params.grammar.CopyFrom(grammar)
    elif req.logprobs is not None:
        params.logprobs = True
        params.top_logprobs = req.logprobs
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
    req: schemas.ChatCompletionRequest, *, request_id: str, session_id: str, tenant: str, tool_format: str = ""
) -> cacheguard_pb2.GuardGenerateRequest:
    """A chat completions request as a GuardGenerateRequest with ChatInput."""
    return cacheguard_pb2.GuardGenerateRequest(
        request_id=request_id,
        session_id=session_id,
        tenant=tenant,
        chat=chat_input(req),
        sampling=sampling_params(req, tool_format),
    )


def completion_request(
    req: schemas.CompletionRequest, *, request_id: str, session_id: str, tenant: str, prompt_index: int = 0
) -> cacheguard_pb2.GuardGenerateRequest:
    """A completions request (its `prompt_index`-th prompt): a string -> prompt_text, a token list -> prompt_tokens."""
    out = cacheguard_pb2.GuardGenerateRequest(
        request_id=request_id, session_id=session_id, tenant=tenant, sampling=sampling_params(req)
    )
    prompt = req.prompts[prompt_index]
    if isinstance(prompt, str):
        out.prompt_text = prompt
    else:
        out.prompt_tokens.token_ids.extend(prompt)
    return out


def choice_requests(
    greqs: list[cacheguard_pb2.GuardGenerateRequest], n: int
) -> list[cacheguard_pb2.GuardGenerateRequest]:
    """n copies of each prompt's request, choice index prompt * n + j; a seeded request's copies get seeds
    seed + j (the same seed would give n equal samples)."""
    out = []
    for greq in greqs:
        for j in range(n):
            copy = cacheguard_pb2.GuardGenerateRequest()
            copy.CopyFrom(greq)
            if n > 1:
                copy.request_id = f"{greq.request_id}-{j}"
                if copy.sampling.HasField("seed"):
                    copy.sampling.seed = (copy.sampling.seed + j) & UINT64_MASK
            out.append(copy)
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
    prompt = req.prompts[0]
    if isinstance(prompt, str):
        return PlanRequest(prompt_text=prompt, **common)
    return PlanRequest(num_prompt_token_ids=len(prompt), **common)


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


# ---------------------------------------------------------------- choices (n, batched prompts, tools, logprobs)


class ToolCallError(GatewayError):
    """The answer was a broken tool-call shell (tools.MalformedToolCall): a 422 whose body also names the function
    the model meant and shows a correct call of it (under `kvmem`), never the shell as text or as a call."""

    def __init__(self, exc: tools.MalformedToolCall) -> None:
        message = f"The model answered with a malformed tool call: {exc.reason}."
        if exc.example:
            message += f" A correct call looks like: {exc.example}"
        super().__init__(422, "invalid_response_error", message, "tools", "malformed_tool_call")
        self.function = exc.function
        self.example = exc.example
        self.reason = exc.reason
        self.raw = exc.raw

    def body(self) -> dict[str, Any]:
        body = super().body()
        body["error"]["kvmem"] = {
            "function": self.function, "reason": self.reason, "example": self.example, "output": self.raw,
        }  # fmt: skip
        return body


def _bytes(b: bytes) -> list[int]:
    return list(b)


def chat_logprobs(items: list[engine_pb2.TokenLogprob]) -> schemas.ChoiceLogprobs:
    return schemas.ChoiceLogprobs(
        content=[
            schemas.TokenLogprob(
                token=i.token, logprob=i.logprob, bytes=_bytes(i.token_bytes),
                top_logprobs=[schemas.TopLogprob(token=t.token, logprob=t.logprob, bytes=_bytes(t.token_bytes))
                              for t in i.top],
            )
            for i in items
        ]
    )  # fmt: skip


def completion_logprobs(items: list[engine_pb2.TokenLogprob], offset: int = 0) -> schemas.CompletionLogprobs:
    offsets, at = [], offset
    for i in items:
        offsets.append(at)
        at += len(i.token)
    return schemas.CompletionLogprobs(
        tokens=[i.token for i in items],
        token_logprobs=[i.logprob for i in items],
        top_logprobs=[{t.token: t.logprob for t in i.top} for i in items],
        text_offset=offsets,
    )


@dataclasses.dataclass
class ChoiceState:
    """One choice being built: its text, logprobs and (tools) its stream parser."""

    parts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[engine_pb2.TokenLogprob] = dataclasses.field(default_factory=list)
    parser: tools.StreamParser | None = None
    sent_chars: int = 0  # completions: text offset of the next token

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _sum_usage(dones: list[cacheguard_pb2.GuardDone], n: int) -> schemas.Usage:
    """Prompts counted once (the first choice of each prompt), completions over all choices."""
    firsts = [d.engine_done.usage for k, d in enumerate(dones) if k % n == 0]
    prompt = sum(u.prompt_tokens for u in firsts)
    completion = sum(d.engine_done.usage.completion_tokens for d in dones)
    return schemas.Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in firsts)),
    )  # fmt: skip


class MultiChoice:
    """The per-choice side of a builder (mixed into ChatBuilder and CompletionBuilder)."""

    n = 1  # choices per prompt
    want_logprobs = False
    tool_mode = ""  # "", "auto", "forced" (convert.tool_mode)
    tools: list[tools.Tool] = []
    tool_format = ""
    choices: list[ChoiceState]

    def setup(self, num_choices: int, n: int, want_logprobs: bool, tool_mode: str = "",
              tool_list: list[tools.Tool] | None = None, tool_format: str = "") -> None:  # fmt: skip
        self.n, self.want_logprobs = n, want_logprobs
        self.tool_mode, self.tools, self.tool_format = tool_mode, tool_list or [], tool_format
        self.choices = [
            ChoiceState(parser=tools.StreamParser(self.tools, tool_format) if tool_mode else None)
            for _ in range(num_choices)
        ]


class ChatChoices(MultiChoice):
    """chat.completion(.chunk) objects of several choices, with tool calls and logprobs."""

    id: str
    created: int
    model: str
    plan: PlanReport | None

    def _choice_chunk(self, k: int, delta: schemas.Delta, reason: str | None = None,
                      kvmem: schemas.KvmemInfo | None = None,
                      logprobs: schemas.ChoiceLogprobs | None = None) -> BaseModel:  # fmt: skip
        choice = schemas.ChunkChoice(index=k, delta=delta, finish_reason=reason, logprobs=logprobs)
        return schemas.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice], kvmem=kvmem
        )

    def choice_opening(self, k: int) -> BaseModel:
        return self._choice_chunk(k, schemas.Delta(role="assistant", content=""))

    def _events(self, k: int, events: list[tools.StreamEvent]) -> list[schemas.Delta]:
        deltas = []
        for ev in events:
            if ev.index < 0:
                if ev.content:
                    deltas.append(schemas.Delta(content=ev.content))
                continue
            fn = schemas.FunctionDelta(name=ev.name, arguments="") if ev.name else schemas.FunctionDelta(
                arguments=ev.arguments)  # fmt: skip
            deltas.append(schemas.Delta(tool_calls=[schemas.ToolCallDelta(
                index=ev.index, id=ev.id or None, type="function" if ev.id else None, function=fn)]))  # fmt: skip
        return deltas

    def choice_delta(self, k: int, chunk: engine_pb2.TokenChunk) -> list[BaseModel]:
        state = self.choices[k]
        state.parts.append(chunk.text)
        lp = list(chunk.logprobs) if self.want_logprobs else []
        state.logprobs.extend(lp)
        if state.parser is not None:
            deltas = self._events(k, state.parser.feed(chunk.text))
        else:
            deltas = [schemas.Delta(content=chunk.text)] if chunk.text else []
        if lp and not deltas:
            deltas = [schemas.Delta()]
        out = []
        for i, d in enumerate(deltas):
            out.append(self._choice_chunk(k, d, logprobs=chat_logprobs(lp) if lp and i == 0 else None))
        return out

    def choice_closing(self, k: int, done: cacheguard_pb2.GuardDone) -> list[BaseModel]:
        """The last chunks of choice k; raises ToolCallError for a malformed tool-call shell."""
        state = self.choices[k]
        reason = finish_reason(done.engine_done.finish_reason)
        out: list[BaseModel] = []
        if state.parser is not None:
            try:
                parsed, events = state.parser.finish(truncated=reason == "length")
            except tools.MalformedToolCall as exc:
                raise ToolCallError(exc) from None
            out = [self._choice_chunk(k, d) for d in self._events(k, events)]
            if parsed.calls:
                reason = "tool_calls"
        out.append(self._choice_chunk(k, schemas.Delta(), reason, kvmem=kvmem_info(done, self.plan)))
        return out

    def usage_multi(self, dones: list[cacheguard_pb2.GuardDone]) -> BaseModel:
        return schemas.ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=_sum_usage(dones, self.n)
        )

    def whole_choices(self, dones: list[cacheguard_pb2.GuardDone]) -> BaseModel:
        """The non-streamed chat.completion of every choice; raises ToolCallError for a malformed shell."""
        choices = []
        for k, (state, done) in enumerate(zip(self.choices, dones, strict=True)):
            reason = finish_reason(done.engine_done.finish_reason)
            message = schemas.AssistantMessage(content=state.text)
            if self.tool_mode:
                try:
                    parsed = tools.parse(state.text, self.tools, self.tool_format, truncated=reason == "length")
                except tools.MalformedToolCall as exc:
                    raise ToolCallError(exc) from None
                if parsed.calls:
                    reason = "tool_calls"
                    message = schemas.AssistantMessage(content=parsed.content, tool_calls=[
                        schemas.ToolCallOut(
                            id=c.id, function=schemas.FunctionCallOut(name=c.name, arguments=c.arguments))
                        for c in parsed.calls])  # fmt: skip
            logprobs = chat_logprobs(state.logprobs) if self.want_logprobs else None
            choices.append(schemas.ChatChoice(index=k, message=message, finish_reason=reason, logprobs=logprobs))
        return schemas.ChatCompletion(
            id=self.id, created=self.created, model=self.model, choices=choices,
            usage=_sum_usage(dones, self.n), kvmem=kvmem_info(dones[0], self.plan),
        )  # fmt: skip


class CompletionChoices(MultiChoice):
    """text_completion objects of several choices (n per prompt, batched prompts), with logprobs."""

    id: str
    created: int
    model: str
    plan: PlanReport | None

    def _completion_of(self, choices: list[schemas.CompletionChoice], usage: schemas.Usage | None = None,
                       kvmem: schemas.KvmemInfo | None = None) -> BaseModel:  # fmt: skip
        return schemas.Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage, kvmem=kvmem
        )

    def choice_opening(self, k: int) -> BaseModel | None:
        return None

    def choice_delta(self, k: int, chunk: engine_pb2.TokenChunk) -> list[BaseModel]:
        state = self.choices[k]
        state.parts.append(chunk.text)
        lp = list(chunk.logprobs) if self.want_logprobs else []
        state.logprobs.extend(lp)
        if not chunk.text and not lp:
            return []
        logprobs = completion_logprobs(lp, state.sent_chars) if lp else None
        state.sent_chars += sum(len(i.token) for i in lp)
        return [self._completion_of([schemas.CompletionChoice(index=k, text=chunk.text, logprobs=logprobs)])]

    def choice_closing(self, k: int, done: cacheguard_pb2.GuardDone) -> list[BaseModel]:
        choice = schemas.CompletionChoice(index=k, text="", finish_reason=finish_reason(done.engine_done.finish_reason))
        return [self._completion_of([choice], kvmem=kvmem_info(done, self.plan))]

    def usage_multi(self, dones: list[cacheguard_pb2.GuardDone]) -> BaseModel:
        return self._completion_of([], usage=_sum_usage(dones, self.n))

    def whole_choices(self, dones: list[cacheguard_pb2.GuardDone]) -> BaseModel:
        choices = [
            schemas.CompletionChoice(
                index=k, text=state.text, finish_reason=finish_reason(done.engine_done.finish_reason),
                logprobs=completion_logprobs(state.logprobs) if self.want_logprobs else None,
            )
            for k, (state, done) in enumerate(zip(self.choices, dones, strict=True))
        ]  # fmt: skip
        return self._completion_of(choices, usage=_sum_usage(dones, self.n), kvmem=kvmem_info(dones[0], self.plan))


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


class ChatBuilder(ChatChoices, ResponseBuilder):
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


class CompletionBuilder(CompletionChoices, ResponseBuilder):
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
