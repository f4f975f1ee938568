"""Pydantic models of the OpenAI request and response shapes the gateway supports.

Requests ignore unknown fields (as OpenAI does) and are strict about types ("0.5" is not a number).
Fields we accept but cannot honour are refused with a 400 naming them, never silently ignored.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from services.common.limits import MAX_STOP_STRINGS  # the engine's limit too, checked here first: a 400 naming it

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
MAX_STOP_BYTES = 1024  # one stop string, UTF-8 bytes
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_unicode(value: Any) -> None:
    """ValueError when a string in `value` (nested lists and dicts too) holds a surrogate code point: JSON
    can spell one (a lone \\ud800 escape) but it is not Unicode text, and the guard call's UTF-8 cannot carry it."""
    if isinstance(value, str):
        if _SURROGATE.search(value):
            raise ValueError("text holds a lone surrogate code point (not valid Unicode)")
    elif isinstance(value, list):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:  # nested models check their own fields
        _check_unicode(value)
        return value


class FunctionCall(_Request):
    name: str
    arguments: str = ""  # JSON text, as OpenAI sends it

    @field_validator("arguments", mode="before")
    @classmethod
    def _arguments_text(cls, value: Any) -> Any:
        return json.dumps(value) if isinstance(value, dict) else value


class ToolCallIn(_Request):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # list-of-parts content is joined into one string here
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        """Content may be a string or a list of text parts ({"type": "text", "text": ...})."""
        if not isinstance(value, list):
            return value
        texts: list[str] = []
        for part in value:
            if not isinstance(part, dict):
                raise ValueError("a content part must be an object {'type': 'text', 'text': <string>}")
            kind = part.get("type", "text")
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported; only 'text'")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return "".join(texts)

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        """Only an assistant message that calls tools may go without content (OpenAI's rule)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role!r} message needs 'content' (only an assistant message with tool_calls may omit it)"
            )
        return self


class FunctionDef(_Request):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None


class ToolDef(_Request):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str = Field(default="response", max_length=64)
    description: str = ""
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        return self


class NamedFunction(_Request):
    name: str


class ToolChoiceNamed(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class KvmemOptions(_Request):
    """Extension `kvmem` of a request: how a prompt over the device pool is handled."""

    model_config = ConfigDict(strict=True, extra="forbid")  # a misspelt option is a 400, not ignored

    over_pool_policy: Literal["shard", "sparse", "exact", "refuse"] | None = None
    max_calls: int | None = Field(default=None, ge=1, le=1024)  # model calls the planner may make


class _SamplingRequest(_Request):
    """Fields shared by chat and completions requests."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)  # extension; -1 and 0: off
    n: int | None = Field(default=None, ge=1, le=16)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)  # extension (vLLM's)
    ignore_eos: bool = False  # extension
    kvmem: KvmemOptions | None = None  # extension

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else value or []
        if any(s == "" for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
        longest = max((len(s.encode()) for s in items), default=0)
        if longest > MAX_STOP_BYTES:
            raise ValueError(f"a stop string may be at most {MAX_STOP_BYTES} bytes, got one of {longest}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value and any(not 0 <= t <= INT32_MAX for t in value):
            raise ValueError("stop_token_ids must be token ids >= 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias[{key!r}] = {bias} is outside [-100, 100]")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[ToolDef] | None) -> list[ToolDef] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("tools hold two functions of the same name")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value not in (None, "none", "auto") and not tools:  # "auto" without tools: nothing to call
            raise ValueError("tool_choice needs tools")
        if isinstance(value, ToolChoiceNamed) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"tool_choice names function {value.function.name!r}, which is not in tools")
        return value

    @field_validator("response_format")
    @classmethod
    def _not_with_forced_call(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        choice = info.data.get("tool_choice")
        if value is not None and value.type != "text" and (choice == "required" or isinstance(choice, ToolChoiceNamed)):
            raise ValueError("response_format and a forced tool call (tool_choice required/named) exclude each other")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, ToolChoiceNamed)

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens."""
        return self.max_completion_tokens or self.max_tokens


MAX_PROMPTS = 32  # prompts in one batched /v1/completions request


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # a list of one string / one token list is unwrapped here
    logprobs: int | None = Field(default=None, ge=0, le=5)  # top alternatives per token (OpenAI's completions form)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"a batch of {len(value)} prompts; at most {MAX_PROMPTS}")
            if any(isinstance(v, list) and not v for v in value) or any(v == "" for v in value):
                raise ValueError("prompt must not hold an empty prompt")
            return value[0] if len(value) == 1 else value
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("prompt")
    @classmethod
    def _token_ids(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        lists = [v for v in value if isinstance(v, list)] if isinstance(value, list) and value else []
        if lists:
            ids = [t for v in lists for t in v]
        else:
            ids = [t for t in value if isinstance(t, int)] if isinstance(value, list) else []
        if any(not 0 <= t <= INT32_MAX for t in ids):
            raise ValueError("prompt token ids must be >= 0")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts (one, or a batch)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)  # type: ignore[arg-type]
        return [p]  # type: ignore[list-item]

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo=true is not supported")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of={value} is not supported; only 1")
        return value

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens


# ---------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _OptionalExtras(_Response):
    """Leaves `usage` and `kvmem` out of a chunk that does not carry them (most stream chunks)."""

    @model_serializer(mode="wrap")
    def _drop_absent_extras(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for key in ("usage", "kvmem"):
            if data.get(key, 0) is None:
                del data[key]
        return data


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class PrefixInfo(_Response):
    session_id: str
    previous_tokens: int
    common_prefix_tokens: int
    diverged: bool
    divergence_message_index: int
    divergence_reason: str
    divergence_field: str = ""  # content, role, reasoning_content, tool_calls, tools, volatile, ...
    normalizations: list[str] = []  # cache-guard normalisations that changed this request


class PlanEvidence(_Response):
    shard: int  # 0-based index of the shard the quote comes from
    quote: str


class PlanRefusal(_Response):
    reason: str  # over_pool, not_splittable, frame_too_large, no_evidence, disagreement, budget_exhausted, ...
    message: str


class PlanInfo(_Response):
    """How the segment planner produced the answer (DESIGN.md §5)."""

    level: str  # L1 (one engine call), L2 (shards, reduced), L2z (reduce re-sharded), L3 (refused)
    over_pool_policy: str  # shard, sparse, exact, refuse
    over_pool: bool  # the prompt plus the answer's reserve is over the device pool
    prompt_tokens: int
    pool_tokens: int
    answer_reserve_tokens: int
    prefill_policy: str  # resident, sparse, exact (as the engine reported); "" when no call was made
    unverified: list[str]  # why the answer is not verified (sparse_prefill, free_text, model_reduce, ...)
    num_shards: int
    shard_tokens: int
    num_calls: int  # model calls made
    max_calls: int
    map: str  # model, extract, literal ("" at L1)
    reduce: str  # single, agreement, model, count, sum, list, min, max
    num_rounds: int
    num_dropped: int  # partial answers the shard text did not bear out
    evidence: list[PlanEvidence]
    aggregate: dict[str, str | int] | None = None
    refusal: PlanRefusal | None = None


class KvmemInfo(_Response):
    """Extension object: what the cache guard reported about how the answer was produced."""

    engine_replica: str
    prefix: PrefixInfo
    matched_stop: str = ""
    plan: PlanInfo | None = None
    routing: str = ""  # affinity, least_loaded, moved
    moved_from: str = ""  # the engine replica the session left (routing "moved")


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvmem: KvmemInfo


class _DropNone(_Response):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_DropNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_DropNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(_DropNone):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Response):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_OptionalExtras):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    kvmem: KvmemInfo | None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_OptionalExtras):
    """A text_completion object: the whole answer, or one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kvmem: KvmemInfo | None = None


class ModelKvmem(_Response):
    architecture: str
    max_context: int
    kv_capacity: int
    page_size: int
    kv_format: str


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "kvmem"
    kvmem: ModelKvmem


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(_Response):
    error: ErrorDetail
