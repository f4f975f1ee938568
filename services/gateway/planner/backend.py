"""The planner's view of the model: count tokens, run one greedy call. GuardBackend implements it
over the cache guard; tests give the planner a scripted one."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from services.common.protos import cacheguard_pb2, engine_pb2
from services.gateway.errors import internal_error, map_stream_error
from services.gateway.guard_client import GuardClient
from services.gateway.planner.task import Message

logger = logging.getLogger(__name__)


class CallResult(NamedTuple):
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    prefill_policy: str
    unverified: bool
    engine_replica: str


class Backend(Protocol):
    async def count_prompt(self) -> int:
        """Tokens of the client's own prompt, as the engine would get it."""
        ...

    async def count_chat(self, messages: Sequence[Message]) -> int:
        """Tokens of a chat the planner built."""
        ...

    async def count_text(self, text: str) -> int:
        """Tokens of a plain text."""
        ...

    async def complete(self, messages: Sequence[Message], max_tokens: int, call_id: str) -> CallResult:
        """One greedy chat call; raises GatewayError on failures."""
        ...


class GuardBackend:
    """Backend over the cache guard. Calls are tagged `<request_id>:<call_id>` and belong to the
    client's tenant (their pages are shared only inside it)."""

    def __init__(
        self, guard: GuardClient, request_id: str, tenant: str, prompt: cacheguard_pb2.CountTokensRequest
    ) -> None:
        self.guard = guard
        self.request_id = request_id
        self.tenant = tenant
        self.prompt = prompt

    async def count_prompt(self) -> int:
        return await self.guard.count_tokens(self.prompt)

    async def count_chat(self, messages: Sequence[Message]) -> int:
        return await self.guard.count_tokens(cacheguard_pb2.CountTokensRequest(chat=_chat(messages)))

    async def count_text(self, text: str) -> int:
        return await self.guard.count_tokens(cacheguard_pb2.CountTokensRequest(prompt_text=text))

    async def complete(self, messages: Sequence[Message], max_tokens: int, call_id: str) -> CallResult:
        call_name = f"{self.request_id}:{call_id}"
        req = cacheguard_pb2.GuardGenerateRequest(
            request_id=call_name,
            session_id=call_name,
            tenant=self.tenant,
            chat=_chat(messages),
            sampling=engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens),
        )
        texts: list[str] = []
        events = self.guard.generate(req)
        try:
            async for event in events:
                kind = event.WhichOneof("event")
                if kind == "chunk":
                    texts.append(event.chunk.text)
                elif kind == "error":
                    raise map_stream_error(event.error)
                elif kind == "done":
                    d = event.done.engine_done
                    return CallResult(
                        "".join(texts),
                        d.usage.prompt_tokens,
                        d.usage.completion_tokens,
                        d.usage.cached_tokens,
                        d.prefill_policy,
                        d.unverified,
                        event.done.engine_replica,
                    )
        finally:
            await events.aclose()
        logger.error("call %s: guard stream ended without done", call_name)
        raise internal_error()


def _chat(messages: Sequence[Message]) -> cacheguard_pb2.ChatInput:
    return cacheguard_pb2.ChatInput(
        messages=[cacheguard_pb2.ChatMessage(role=m.role, content=m.content) for m in messages]
    )
