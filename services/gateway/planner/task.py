"""What an over-pool request asks: the frame (messages kept in every call), the document (the part
that is split into shards) and the question.

The document is the longest message. When it is also the last user message, its trailing short
paragraph is the question (or its leading one, when the question comes first); otherwise the
question is the last user message. Everything else is the frame, sent unchanged with every
shard.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAX_QUESTION_CHARS = 1000
MAX_PREAMBLE_CHARS = 300  # a short first paragraph before the document is read as part of the question
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n\s*")


class Message(NamedTuple):
    role: str  # system, user, assistant, tool
    content: str


@dataclass(frozen=True)
class Task:
    """An over-pool request taken apart; `frame` + a shard + `question` make one map call."""

    frame: tuple[Message, ...]
    document: str
    question: str

    @property
    def ask(self) -> str:
        """The question's last paragraph: the question proper, without a preamble before it."""
        return _PARAGRAPH_BREAK.split(self.question.strip())[-1]


class NotSplittable(ValueError):
    """The request has no document/question shape the planner can shard; the message says why."""


def task_from_messages(messages: Sequence[Message]) -> Task:
    """Take a chat apart; raises NotSplittable."""
    if not messages:
        raise NotSplittable("the request has no messages")
    users = [k for k, m in enumerate(messages) if m.role == "user"]
    if not users:
        raise NotSplittable("the request has no user message to take the question from")
    last_user = users[-1]
    doc_index = max(range(len(messages)), key=lambda k: len(messages[k].content))
    if doc_index == last_user:
        document, question = split_question(messages[last_user].content)
        frame = tuple(m for k, m in enumerate(messages) if k != last_user)
    else:
        question = messages[last_user].content.strip()
        if len(question) > MAX_QUESTION_CHARS:
            raise NotSplittable(
                f"the question (last user message) has {len(question)} characters; at most {MAX_QUESTION_CHARS}"
            )
        document = messages[doc_index].content
        frame = tuple(m for k, m in enumerate(messages) if k not in (doc_index, last_user))
    if not question:
        raise NotSplittable("the question is empty")
    return Task(frame, document, question)


def task_from_text(text: str) -> Task:
    """A completions prompt: the document and its question in one text."""
    document, question = split_question(text)
    return Task((), document, question)


def split_question(text: str) -> tuple[str, str]:
    """(document, question) of one text: the question is the last paragraph when it is short
    (with a short first paragraph, the preamble, in front of it), else the first paragraph; raises
    NotSplittable when neither is short or there is only one paragraph."""
    body = text.rstrip()
    breaks = list(_PARAGRAPH_BREAK.finditer(body))
    if not breaks:
        raise NotSplittable(
            "could not tell the question from the document: put the question in its own paragraph "
            "(after a blank line) or in its own message"
        )
    last, first = breaks[-1], breaks[0]
    tail = body[last.end() :].strip()
    if tail and len(tail) <= MAX_QUESTION_CHARS:
        head = body[: first.start()].strip()
        if len(breaks) >= 2 and len(head) <= MAX_PREAMBLE_CHARS and not head.startswith(("```", "~~~", "{", "[")):
            # "Here is a log. Find X.\n\n<document>\n\nWhat is X?": the preamble is part of the ask
            return body[first.end() : last.start()] + "\n", f"{head}\n\n{tail}"
        return body[: last.start()] + "\n", tail
    head = body[: first.start()].strip()
    if head and len(head) <= MAX_QUESTION_CHARS:
        return body[first.end() :] + "\n", head
    raise NotSplittable(
        f"neither the first nor the last paragraph is a question of at most {MAX_QUESTION_CHARS} characters"
    )


def upper_bound_tokens(messages: Sequence[Message], extra_chars: int = 0) -> int:
    """More tokens than the rendered chat can have, without tokenizing: a byte-level tokenizer
    never makes more tokens than UTF-8 bytes. `TEMPLATE_MARGIN` covers role markers and a default
    system prompt a chat template may add."""
    content = sum(len(m.content.encode()) + len(m.role) + 8 for m in messages)
    return content + extra_chars + TEMPLATE_MARGIN


TEMPLATE_MARGIN = 256
