"""The cache guard's core (no grpc): input -> prompt token ids, with a prefix report per session.

0. A chat is normalised with the session's memory (normalize.Normalizer; off per request or by
   configuration), so that what the session already sent renders the same bytes again.
1. A chat is rendered with the model's template (renderer.ChatRenderer), which also says where
   each message starts in the text; a text prompt is taken as is; token ids pass through.
2. The whole text is tokenized once: these are the ids the engine gets (equal to transformers'
   `apply_chat_template(..., tokenize=True)`). To know which message each token belongs to, every
   message's text is tokenized on its own too and matched against the whole: exact whenever the
   pieces tokenize the same as the whole (chat templates put special tokens at message borders);
   from the first piece that does not match on, message ranges are estimates (logged).
3. The session table compares the ids with what the session sent last (sessions.SessionTable) and
   keeps the normalisations' memory for the next request.
A chat without a session id is identified by its opening messages, with the system message's
date/time lines taken out (a clock in the system prompt does not make every request a new session).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.cacheguard.normalize import NORMALIZATIONS, Normalized, Normalizer, SessionMemory, tool_name
from services.cacheguard.renderer import ChatRenderer
from services.cacheguard.sessions import (
    MESSAGE_FIELDS,
    MessageSpan,
    PrefixReport,
    SessionTable,
    ToolSpec,
    derive_chat_session_id,
    derive_prompt_session_id,
)
from services.cacheguard.volatile import split_volatile
from services.common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot be turned into a prompt (no input, empty prompt, bad token id)."""


@dataclass(frozen=True)
class PromptRequest:
    """One request's input: exactly one of `messages`, `prompt_text`, `prompt_token_ids`.

    messages and tools are plain dicts (renderer.chat_message / renderer.tool_definition).
    """

    session_id: str = ""
    tenant: str = ""
    messages: Sequence[Mapping[str, Any]] | None = None
    tools: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    prompt_text: str | None = None
    prompt_token_ids: Sequence[int] | None = None
    normalizations_off: bool = False


class PromptTokens(NamedTuple):
    """A tokenized prompt and the token range of each chat message (empty for non-chat input)."""

    token_ids: list[int]
    message_spans: tuple[MessageSpan, ...]


class Prepared(NamedTuple):
    """What the engine gets and what the client is told about the session's prefix."""

    token_ids: list[int]
    session_id: str
    report: PrefixReport
    query_start: int | None = None  # token index where the last user message starts (the ring's query)
    question: tuple[int, int] | None = None  # tokens the engine's ring reads again at the end (question_span)
    question_alone: bool = False  # the question replay alone ranks pages (the query span asks nothing)


class GuardCore:
    """Normalises, renders, tokenizes and tracks sessions; thread-safe (called from worker threads)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_sessions: int,
        normalizations: Sequence[str] = NORMALIZATIONS,
        chat_template: str | None = None,
        query_span: str = "question",
    ) -> None:
        """chat_template: replaces the model's own template (None: the model's); query_span: "question"
        (question_start) or "turn" (the start of the last user message) is where the ring's query starts."""
        self.tokenizer = tokenizer
        self.query_span = query_span
        info = tokenizer.info
        if chat_template is not None:
            info = dataclasses.replace(info, chat_template=chat_template)
        self.renderer = ChatRenderer(info)
        self.normalizer = Normalizer(normalizations, inner_system=self.renderer.support.inner_system)
        self.sessions = SessionTable(max_sessions)

    def prepare(self, request: PromptRequest) -> Prepared:
        """Prompt token ids for the engine, the session id, and the prefix report of this request."""
        _check_input(request)
        session_id = request.session_id
        if not session_id and request.messages is not None:
            session_id = self._derive_chat_session_id(request.tenant, request.messages)
        memory = self.sessions.memory(session_id, request.tenant) if session_id else SessionMemory()
        prompt, chat = self._prompt(request, memory)
        session_id = session_id or derive_prompt_session_id(request.tenant, prompt.token_ids)
        report = self.sessions.observe(
            session_id,
            prompt.token_ids,
            prompt.message_spans,
            tenant=request.tenant,
            tools=self._tool_specs(chat.tools) if chat is not None else (),
            memory=chat.memory if chat is not None and not request.normalizations_off else None,
        )
        applied = chat.applied if chat is not None else ()
        users = [m for m in prompt.message_spans if m.role == "user"]
        query_start = None
        question = None
        alone = False
        if users and users[-1].token_start < len(prompt.token_ids):
            last = users[-1]
            query_start = question_start(last, self.tokenizer) if self.query_span == "question" else last.token_start
            if self.query_span == "question":
                question = question_span(last, self.tokenizer, query_start)
                # the query span at the message's end: the question came first (question_start), only it asks
                alone = question is not None and query_start >= message_end(last)
        elif request.prompt_text is not None and self.query_span == "question":
            query_start = text_question_start(request.prompt_text, len(prompt.token_ids), self.tokenizer)
        report = report._replace(normalizations=applied)
        return Prepared(prompt.token_ids, session_id, report, query_start, question, alone)

    def count_tokens(self, request: PromptRequest) -> int:
        """Number of prompt tokens `prepare` would send now (the session is read, never changed)."""
        return len(self.tokenize(request).token_ids)

    def tokenize(self, request: PromptRequest) -> PromptTokens:
        """Normalise (chat; with the session's memory when a session id is given), render and tokenize;
        raises InvalidRequestError / renderer.RenderError."""
        _check_input(request)
        memory = self.sessions.memory(request.session_id, request.tenant) if request.session_id else SessionMemory()
        return self._prompt(request, memory)[0]

    def _prompt(self, request: PromptRequest, memory: SessionMemory) -> tuple[PromptTokens, Normalized | None]:
        chat = None
        if request.messages is not None:
            chat = self.normalizer.apply(request.messages, request.tools, memory, off=request.normalizations_off)
            prompt = self._tokenize_chat(chat.messages, chat.tools, chat.origins)
        elif request.prompt_text is not None:
            prompt = PromptTokens(self.tokenizer.encode(request.prompt_text, add_special_tokens=True), ())
        else:
            assert request.prompt_token_ids is not None
            prompt = PromptTokens(self._checked_token_ids(request.prompt_token_ids), ())
        if not prompt.token_ids:
            raise InvalidRequestError("the prompt has 0 tokens")
        return prompt, chat

    def _tool_specs(self, tools: Sequence[Mapping[str, Any]]) -> tuple[ToolSpec, ...]:
        """The tools as the session table compares them (none when the template does not render tools)."""
        if not self.renderer.support.tools:
            return ()
        return tuple(ToolSpec(tool_name(t), json.dumps(t, sort_keys=True, ensure_ascii=False)) for t in tools)

    def _tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        origins: Sequence[int] | None = None,
    ) -> PromptTokens:
        rendered = self.renderer.render_with_boundaries(messages, tools or None)
        # A template writes its own BOS; the plain fallback format gets the tokenizer's.
        add_special = not self.renderer.has_template
        token_ids = self.tokenizer.encode(rendered.text, add_special_tokens=add_special)
        char_starts = (*rendered.message_starts, rendered.messages_end, len(rendered.text))
        pieces = [self.tokenizer.encode(rendered.text[a:b]) for a, b in zip(char_starts, char_starts[1:], strict=False)]
        token_starts = _token_starts(token_ids, pieces, self.tokenizer.info.bos_token_id)
        spans = tuple(
            MessageSpan(
                str(m["role"]),
                str(m.get("content", "")),
                0 if k == 0 else token_starts[k],
                token_starts[k + 1],
                _message_fields(m),
                origins[k] if origins is not None else None,
            )
            for k, m in enumerate(messages)
        )
        return PromptTokens(token_ids, spans)

    def _checked_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        vocab_size = self.tokenizer.vocab_size
        for k, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(f"prompt token {k} is {token_id}, outside the vocabulary [0, {vocab_size})")
        return list(token_ids)

    @staticmethod
    def _derive_chat_session_id(tenant: str, messages: Sequence[Mapping[str, Any]]) -> str:
        opening = [(str(m["role"]), str(m.get("content", ""))) for m in messages[:2]]
        if opening[0][0] == "system":
            opening[0] = ("system", split_volatile(opening[0][1]).stable)
        return derive_chat_session_id(tenant, opening)


def _check_input(request: PromptRequest) -> None:
    """Exactly one input kind; a chat has messages, each with a role; a prompt text is not empty."""
    kinds = [x is not None for x in (request.messages, request.prompt_text, request.prompt_token_ids)]
    if sum(kinds) != 1:
        raise InvalidRequestError(f"exactly one of chat, prompt_text, prompt_tokens must be set, got {sum(kinds)}")
    if request.messages is not None:
        if not request.messages:
            raise InvalidRequestError("chat has no messages")
        for k, message in enumerate(request.messages):
            if not message.get("role"):
                raise InvalidRequestError(f"message {k} has no role")
    if request.prompt_text is not None and not request.prompt_text:
        raise InvalidRequestError("prompt_text is empty")


QUESTION_MIN_TOKENS = 512  # a last user message shorter than this is the question itself
QUESTION_MAX_CHARS = 1200  # a trailing paragraph longer than this is document, not a question


def message_end(message: MessageSpan) -> int:
    """Where a message's content ends: before the template's end-of-message tokens (two for ChatML; a seam either
    way)."""
    return message.token_end - 2


def question_start(message: MessageSpan, tokenizer: Tokenizer) -> int:
    """Where the question of a chat's last user message starts (the ring's query span runs from here to
    the prompt's end). A short message is the question itself (the document came before it). In a long one
    the question is a short paragraph (blank-line separated) at one end: the last when it asks ("?"), else
    the first when that asks, else the last when short (an instruction). A question first, then the
    document: the message's end, so the scored query is the generation prompt's tokens, which read the
    question from the protected head of the prompt. A paragraph's tokens are counted by tokenizing it alone
    (off by a token or two at the seam: a query span's edge)."""
    if message.token_end - message.token_start < QUESTION_MIN_TOKENS:
        return message.token_start
    content = message.content.strip()
    head, sep, last = content.rpartition("\n\n")
    head, last, first = head.strip(), last.strip(), content.partition("\n\n")[0].strip()
    end = message_end(message)
    short_last = bool(sep and head) and 0 < len(last) <= QUESTION_MAX_CHARS
    if short_last and (last.endswith("?") or not (first.endswith("?") and len(first) <= QUESTION_MAX_CHARS)):
        return max(message.token_start, end - len(tokenizer.encode(last)))
    return max(message.token_start, end)


def question_span(message: MessageSpan, tokenizer: Tokenizer, query_start: int) -> tuple[int, int] | None:
    """The first paragraph of a long last user message, when it may be a question asked before the document:
    tokens [start, end), which the engine reads again after the document to rank the prompt's pages (the
    ring's question replay). It is sent when that paragraph is short and the message's last paragraph does not
    ask ("?": the question is last and the query span holds it). An instruction first ("Find the value of X and
    state it.") reads like any other paragraph, so the first short paragraph is sent unless the question is
    plainly last; the engine ranks by this span and the query span together. The content's start is estimated
    as the message's end less the content's own tokens (a seam either way); None for any other message."""
    end = message_end(message)
    if end - message.token_start < QUESTION_MIN_TOKENS:
        return None  # a short message is the question itself
    content = message.content.strip()
    first, sep, rest = content.partition("\n\n")
    first = first.strip()
    if not sep or not rest.strip() or not first or len(first) > QUESTION_MAX_CHARS:
        return None
    if rest.rpartition("\n\n")[2].strip().endswith("?"):
        return None  # the question last: the query span is it
    start = max(message.token_start, end - len(tokenizer.encode(content)))
    stop = min(start + len(tokenizer.encode(first)), query_start, end)
    return (start, stop) if stop > start else None


def text_question_start(text: str, num_tokens: int, tokenizer: Tokenizer) -> int | None:
    """A raw prompt's question: its last paragraph when the prompt is long and that paragraph short
    (None otherwise: the engine scores the prompt's last tokens)."""
    if num_tokens < QUESTION_MIN_TOKENS:
        return None
    head, sep, tail = text.rstrip().rpartition("\n\n")
    if not sep or not head.strip() or not 0 < len(tail.strip()) <= QUESTION_MAX_CHARS:
        return None
    return max(0, num_tokens - len(tokenizer.encode(tail.strip())) - 1)


def _message_fields(message: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The MESSAGE_FIELDS a message sets, as text (tool calls as canonical JSON)."""
    out = []
    for name in MESSAGE_FIELDS:
        value = message.get(name)
        if not value:
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)
        out.append((name, text))
    return tuple(out)


def _token_starts(token_ids: Sequence[int], pieces: Sequence[Sequence[int]], bos_token_id: int | None) -> list[int]:
    """Where each piece starts in `token_ids` (plus the end), matching pieces in order.

    A leading BOS that no piece holds is skipped. Exact while every piece equals its slice of the
    whole; after the first mismatch, starts are estimated from piece lengths.
    """
    first = list(pieces[0]) if pieces else []
    pos = 1 if token_ids and token_ids[0] == bos_token_id and list(token_ids[: len(first)]) != first else 0
    starts: list[int] = []
    exact = True
    for piece in pieces:
        starts.append(pos)
        if exact and list(token_ids[pos : pos + len(piece)]) == list(piece):
            pos += len(piece)
            continue
        if exact:
            logger.debug("message tokens differ from the whole prompt's at token %d: ranges estimated", pos)
        exact = False
        pos = min(pos + len(piece), len(token_ids))
    starts.append(len(token_ids) if exact else pos)
    return starts
