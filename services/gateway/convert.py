"""OpenAI requests (schemas.py) to the cache guard's protos: sampling parameters, grammars of response_format and
forced tool calls, chat and completion requests, one request per choice, planner and token-count requests. The way
back is responses.py (the pieces of a response), choices.py (choices with tool calls and logprobs) and builders.py
(the response and chunk objects of one request)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import schemas, tools
from services.gateway.errors import invalid_request
from services.gateway.planner.plan import PlannerSettings, PlanRequest
from services.gateway.planner.task import Message

logger = logging.getLogger(__name__)

UINT64_MASK = 2**64 - 1
_TOKEN_ID = re.compile(r"[0-9]+")

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
