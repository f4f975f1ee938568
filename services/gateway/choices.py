"""The choices of a response (n per prompt, batched prompts), each with its tool calls (parsed whole or as they
stream, the malformed tool-call guard's 422) and its logprobs, as chat and completion objects."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pydantic import BaseModel

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway import schemas, tools
from services.gateway.errors import GatewayError
from services.gateway.planner.plan import PlanReport
from services.gateway.responses import finish_reason, kvmem_info
from services.gateway.tools import Tool

logger = logging.getLogger(__name__)


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
    tools: list[Tool] = []
    tool_format = ""
    choices: list[ChoiceState]

    def setup(self, num_choices: int, n: int, want_logprobs: bool, tool_mode: str = "",
              tool_list: list[Tool] | None = None, tool_format: str = "") -> None:  # fmt: skip
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
            if parsed.calls and reason != "length":  # a call the budget closed stays "length": not to be run as is
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
                    reason = "tool_calls" if reason != "length" else reason  # closed by the budget: "length"
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
