"""Normalisations: rewrite a chat so that what a session already sent renders byte-identically.

Each one is switched by name (CacheGuardConfig.normalizations; a request may turn all of them off)
and none changes what the conversation says:

- `tool_order`: tool definitions keep the order in which the session first sent them; tools new to
  the session follow in the client's order. Tool order carries no meaning for the model's choice
  of a tool (every definition is visible). Not applied when two tools share a name.
- `volatile_lines`: whole lines of the first (system) message that only state the current date or
  time (volatile.is_volatile_line) leave the system message, which then stays identical from
  request to request. They are placed just before the newest client input (the last user or tool
  message): as a system message of their own when the template renders one there, else at the start
  of that message's content. A placement made earlier in the session stays where it was (the
  history renders as it was sent); a new one is made only when the lines changed since the last
  placement. So the model still reads the current date/time, stated after everything older.
  Not applied without a system message first, without a user/tool message after it, or to lines
  that say anything besides a date/time.
- `reasoning`: when an assistant message comes back without the reasoning_content the session
  earlier sent for it (same position, same content and tool calls), the remembered reasoning is put
  back. The model's own earlier reasoning is restored, nothing else. Never overrides reasoning the
  client sent, and never applies to a message whose content or tool calls changed.

What a session needs to remember lives in SessionMemory (kept by sessions.SessionTable, bounded).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from services.cacheguard.volatile import split_volatile

logger = logging.getLogger(__name__)

TOOL_ORDER = "tool_order"
VOLATILE_LINES = "volatile_lines"
REASONING = "reasoning"
NORMALIZATIONS = (TOOL_ORDER, VOLATILE_LINES, REASONING)

MAX_TOOL_NAMES = 1024  # per session
MAX_PLACEMENTS = 256  # per session
MAX_REASONING_ENTRIES = 512  # per session
_INPUT_ROLES = ("user", "tool")


@dataclass(frozen=True)
class Placement:
    """Volatile lines the guard put before one client message (by index and fingerprint)."""

    anchor_index: int
    anchor_key: str
    lines: str


@dataclass(frozen=True)
class SessionMemory:
    """What the normalisations remember about one session."""

    tool_names: tuple[str, ...] = ()  # first-seen order
    placements: tuple[Placement, ...] = ()  # by anchor_index
    reasoning: tuple[tuple[str, str], ...] = ()  # (assistant message key, reasoning), oldest first


class Normalized(NamedTuple):
    """The messages and tools to render, and what was done to them."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    origins: tuple[int, ...]  # the client's index of each message; -1: placed by the guard
    applied: tuple[str, ...]  # names of the normalisations that changed something
    memory: SessionMemory


def message_key(index: int, message: Mapping[str, Any]) -> str:
    """Fingerprint of a client message by position, role, content and tool calls (not reasoning)."""
    data = json.dumps(
        [index, message.get("role", ""), message.get("content", ""), message.get("tool_calls") or []],
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(data.encode()).hexdigest()[:24]


def tool_name(tool: Mapping[str, Any]) -> str:
    """The name of an OpenAI-style tool definition."""
    return str(tool.get("function", {}).get("name", ""))


class Normalizer:
    """Applies the enabled normalisations; stateless (the session memory goes in and comes out)."""

    def __init__(self, enabled: Sequence[str], inner_system: bool) -> None:
        unknown = set(enabled) - set(NORMALIZATIONS)
        assert not unknown, unknown
        self.enabled = frozenset(enabled)
        self.inner_system = inner_system  # volatile lines as a message of their own (else in the content)

    def apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        memory: SessionMemory,
        off: bool = False,
    ) -> Normalized:
        """The chat to render for this request and the session memory after it."""
        msgs = [dict(m) for m in messages]
        tool_list = [dict(t) for t in tools]
        origins = tuple(range(len(msgs)))
        if off or not self.enabled:
            return Normalized(msgs, tool_list, origins, (), memory)
        applied: list[str] = []
        tool_names, reasoning, placements = memory.tool_names, memory.reasoning, memory.placements
        if TOOL_ORDER in self.enabled:
            tool_list, tool_names, changed = order_tools(tool_list, tool_names)
            applied += [TOOL_ORDER] if changed else []
        if REASONING in self.enabled:
            msgs, reasoning, changed = restore_reasoning(msgs, reasoning)
            applied += [REASONING] if changed else []
        if VOLATILE_LINES in self.enabled:
            msgs, origins, placements, changed = place_volatile(msgs, placements, self.inner_system)
            applied += [VOLATILE_LINES] if changed else []
        return Normalized(msgs, tool_list, origins, tuple(applied), SessionMemory(tool_names, placements, reasoning))


def order_tools(
    tools: list[dict[str, Any]], known: tuple[str, ...]
) -> tuple[list[dict[str, Any]], tuple[str, ...], bool]:
    """Tools in first-seen order (new ones after, in the client's order): (tools, known names, changed)."""
    names = [tool_name(t) for t in tools]
    if len(set(names)) != len(names):
        logger.debug("two tools share a name: tool order left as sent")
        return tools, known, False
    seen = set(known)
    known = (*known, *(n for n in names if n not in seen))[:MAX_TOOL_NAMES]
    rank = {name: k for k, name in enumerate(known)}
    ordered = sorted(tools, key=lambda t: rank.get(tool_name(t), len(rank)))  # stable: unranked keep order
    return ordered, known, [tool_name(t) for t in ordered] != names


def restore_reasoning(
    msgs: list[dict[str, Any]], remembered: tuple[tuple[str, str], ...]
) -> tuple[list[dict[str, Any]], tuple[tuple[str, str], ...], bool]:
    """Put back remembered reasoning of assistant messages sent without it: (messages, memory, changed)."""
    table = dict(remembered)
    changed = False
    for index, message in enumerate(msgs):
        if message.get("role") != "assistant":
            continue
        key = message_key(index, message)
        reasoning = message.get("reasoning_content") or ""
        if reasoning:
            table.pop(key, None)
            table[key] = reasoning  # the client's reasoning wins and is remembered (newest last)
        elif key in table:
            message["reasoning_content"] = table[key]
            changed = True
    entries = tuple(table.items())[-MAX_REASONING_ENTRIES:]
    return msgs, entries, changed


def place_volatile(
    msgs: list[dict[str, Any]], placements: tuple[Placement, ...], inner_system: bool
) -> tuple[list[dict[str, Any]], tuple[int, ...], tuple[Placement, ...], bool]:
    """Move date/time lines out of the system message: (messages, origins, placements, changed)."""
    origins = tuple(range(len(msgs)))
    if not msgs or msgs[0].get("role") != "system":
        return msgs, origins, placements, False
    split = split_volatile(str(msgs[0].get("content", "")))
    anchor = next((k for k in range(len(msgs) - 1, 0, -1) if msgs[k].get("role") in _INPUT_ROLES), None)
    if not split.volatile or anchor is None:
        return msgs, origins, placements, False
    kept = [
        p
        for p in placements
        if 0 < p.anchor_index <= anchor and message_key(p.anchor_index, msgs[p.anchor_index]) == p.anchor_key
    ]
    if kept and kept[-1].anchor_index == anchor and kept[-1].lines != split.volatile:
        kept.pop()  # the same newest input resent with other lines (a retry): replaced
    if not kept or kept[-1].lines != split.volatile:
        kept.append(Placement(anchor, message_key(anchor, msgs[anchor]), split.volatile))
    kept = kept[-MAX_PLACEMENTS:]
    msgs[0]["content"] = split.stable
    out: list[dict[str, Any]] = []
    out_origins: list[int] = []
    by_anchor = {p.anchor_index: p.lines for p in kept}
    for index, message in enumerate(msgs):
        lines = by_anchor.get(index)
        if lines is not None and inner_system:
            out.append({"role": "system", "content": lines})
            out_origins.append(-1)
        elif lines is not None:
            message["content"] = f"{lines}\n\n{message.get('content', '')}"
        out.append(message)
        out_origins.append(index)
    return out, tuple(out_origins), tuple(kept), True
