"""The response objects of one request, whole or streamed: chat.completion(.chunk) and text_completion, the
planner's progress chunks; the per-choice side (n, tools, logprobs) comes from choices.py."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from services.common.protos import cacheguard_pb2
from services.gateway import schemas
from services.gateway.choices import ChatChoices, CompletionChoices
from services.gateway.planner.plan import PlanReport, Progress
from services.gateway.responses import finish_reason, kvmem_info, usage_of

logger = logging.getLogger(__name__)


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
