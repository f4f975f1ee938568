"""SessionTable: what each session sent last, and how a new prompt compares with it.

A session is keyed by (tenant, session_id). The table keeps the last prompt's token ids, the
token range and fields of each of its chat messages, its tool definitions and the normalisations'
memory, bounded by max_sessions (least recently used dropped).
`observe` compares a new prompt with the stored one: the longest common token prefix, whether the
new prompt extends the old one, and if not, which message and which field diverged, and why.
Message indices in reports are the client's (a message the guard placed is reported by the index of
the client message it precedes).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from services.cacheguard.normalize import SessionMemory
from services.cacheguard.volatile import volatile_line_at

logger = logging.getLogger(__name__)

DERIVED_PREFIX = "auto-"
_PROMPT_ID_TOKENS = 64  # a derived id of a non-chat prompt hashes its first page of tokens
_COMPARE_CHUNK = 4096


# The optional message fields compared after role and content, in this order.
MESSAGE_FIELDS = ("name", "tool_call_id", "reasoning_content", "tool_calls")


class MessageSpan(NamedTuple):
    """One chat message of a prompt: what it said and its token range [token_start, token_end).

    fields: (name, value) of the MESSAGE_FIELDS that are set (tool_calls as canonical JSON).
    client_index: the client's index of the message; -1 when the guard placed it; None: its position.
    """

    role: str
    content: str
    token_start: int
    token_end: int
    fields: tuple[tuple[str, str], ...] = ()
    client_index: int | None = None


class PrefixReport(NamedTuple):
    """How a session's new prompt relates to its previous one (mirrors cacheguard.v1.PrefixReport)."""

    session_id: str
    previous_tokens: int  # 0: new session
    common_prefix_tokens: int
    diverged: bool  # the new prompt does not extend the previous one
    divergence_message_index: int  # -1 when not diverged or not a chat prompt
    divergence_reason: str  # "" when not diverged
    divergence_field: str = ""  # bounded set (see cacheguard.proto); "" when not diverged
    normalizations: tuple[str, ...] = ()  # filled in by the core


class ToolSpec(NamedTuple):
    """A tool definition as rendered: its name and its canonical JSON."""

    name: str
    json: str


class _Entry(NamedTuple):
    token_ids: array[int]
    spans: tuple[MessageSpan, ...]
    tools: tuple[ToolSpec, ...]
    memory: SessionMemory


def derive_chat_session_id(tenant: str, messages: Sequence[tuple[str, str]]) -> str:
    """Session id of a chat without one: a hash of the tenant and the opening (role, content) pairs.

    The opening is the first two messages, cut after the first user message: [system, user, ...]
    and [user, assistant, ...] keep the id they had in their first turn.
    """
    opening = list(messages[:2])
    if opening and opening[0][0] == "user":
        opening = opening[:1]
    h = hashlib.sha256()
    for part in (tenant, *(field for role_content in opening for field in role_content)):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return DERIVED_PREFIX + h.hexdigest()[:24]


def derive_prompt_session_id(tenant: str, token_ids: Sequence[int]) -> str:
    """Session id of a non-chat prompt without one: a hash of the tenant and its first 64 tokens."""
    h = hashlib.sha256()
    data = tenant.encode()
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)
    h.update(array("i", token_ids[:_PROMPT_ID_TOKENS]).tobytes())
    return DERIVED_PREFIX + "p" + h.hexdigest()[:23]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences (chunked C-level compares)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + _COMPARE_CHUNK] == b[i : i + _COMPARE_CHUNK]:
        i += _COMPARE_CHUNK
    i = min(i, n)
    end = min(i + _COMPARE_CHUNK, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


class SessionTable:
    """LRU map (tenant, session_id) -> last prompt; thread-safe."""

    def __init__(self, max_sessions: int) -> None:
        assert max_sessions >= 1, max_sessions
        self.max_sessions = max_sessions
        self._table: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def __contains__(self, key: tuple[str, str]) -> bool:
        with self._lock:
            return key in self._table

    def memory(self, session_id: str, tenant: str = "") -> SessionMemory:
        """The normalisations' memory of a session (empty for an unknown one); does not touch the LRU order."""
        with self._lock:
            entry = self._table.get((tenant, session_id))
        return entry.memory if entry is not None else SessionMemory()

    def observe(
        self,
        session_id: str,
        token_ids: Sequence[int],
        message_spans: Sequence[MessageSpan] = (),
        tenant: str = "",
        tools: Sequence[ToolSpec] = (),
        memory: SessionMemory | None = None,
    ) -> PrefixReport:
        """Compare `token_ids` with the session's previous prompt, then remember them as its last.

        `memory` replaces the session's normalisation memory (None: kept as it was).
        """
        key = (tenant, session_id)
        with self._lock:
            previous = self._table.pop(key, None)
            if memory is None:
                memory = previous.memory if previous is not None else SessionMemory()
            new = _Entry(array("i", token_ids), tuple(message_spans), tuple(tools), memory)
            self._table[key] = new
            while len(self._table) > self.max_sessions:
                self._table.popitem(last=False)
        if previous is None:
            return PrefixReport(session_id, 0, 0, False, -1, "")
        common = common_prefix_len(previous.token_ids, new.token_ids)
        num_previous = len(previous.token_ids)
        if common == num_previous:
            return PrefixReport(session_id, num_previous, common, False, -1, "")
        index, field, reason = _divergence(previous, new, common)
        logger.debug("session %s diverged at token %d of %d: %s", session_id, common, num_previous, reason)
        return PrefixReport(session_id, num_previous, common, True, index, reason, field)


def _span_key(span: MessageSpan) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    return span.role, span.content, span.fields


def _client_index(spans: Sequence[MessageSpan], k: int) -> int:
    """The client's index of message k (a guard-placed message: the client message after it)."""
    for j in range(k, len(spans)):
        index = spans[j].client_index
        if index is None:
            return j
        if index >= 0:
            return index
    return len(spans)


def _divergence(old_entry: _Entry, new_entry: _Entry, common: int) -> tuple[int, str, str]:
    """(client message index, field, reason) for prompts that first differ at token `common` of the old one."""
    old, new = old_entry.spans, new_entry.spans
    if not old or not new:
        return -1, "tokens", f"prompt changed at token {common}"
    # The message whose old token range holds the first differing token (len(old): the generation prompt).
    at = next((k for k, span in enumerate(old) if span.token_end > common), len(old))
    # A message whose role, content or fields changed is named first, if it starts at or before that
    # token (this also covers unknown message boundaries, which leave earlier messages with empty ranges).
    changed = next((k for k in range(min(len(old), len(new))) if _span_key(old[k]) != _span_key(new[k])), None)
    if changed is not None and old[changed].token_start <= common:
        field, reason = _change_reason(old, new, changed)
        return _client_index(new, changed), field, reason
    if old_entry.tools != new_entry.tools:
        return _client_index(old, min(at, len(old) - 1)), "tools", _tools_reason(old_entry.tools, new_entry.tools)
    if at < len(old) and at >= len(new):
        return _client_index(old, at), "messages", f"history truncated ({len(old)} -> {len(new)} messages)"
    if at < len(old):
        k = _client_index(new, at)
        return k, "rendering", f"message {k} ({new[at].role}) rendered differently with the same role and content"
    if len(new) > len(old):
        k = _client_index(new, at)
        return k, "generation_prompt", f"message {k} ({new[at].role}) does not extend the previous generation prompt"
    return _client_index(new, at), "generation_prompt", "generation prompt changed"


def _change_reason(old: tuple[MessageSpan, ...], new: tuple[MessageSpan, ...], k: int) -> tuple[str, str]:
    """(field, reason) of message k, which differs between old and new."""
    index = _client_index(new, k)
    for num_removed in range(1, len(old) - k):
        overlap = min(len(new) - k, len(old) - k - num_removed)
        if _same_messages(new[k : k + overlap], old[k + num_removed : k + num_removed + overlap]):
            return "messages", f"history truncated: {num_removed} message(s) removed at message {index}"
    if old[k].client_index == -1 or new[k].client_index == -1:
        return "volatile", f"the date/time lines placed before message {index} changed"
    if old[k].role != new[k].role:
        return "role", f"message {index} role changed ({old[k].role} -> {new[k].role})"
    role = new[k].role
    if old[k].content != new[k].content:
        char = len(_common_text_prefix(old[k].content, new[k].content))
        hint = " (a date/time line)" if volatile_line_at(old[k].content, char) else ""
        return "content", f"message {index} ({role}) content changed at char {char}{hint}"
    old_fields, new_fields = dict(old[k].fields), dict(new[k].fields)
    for name in MESSAGE_FIELDS:
        a, b = old_fields.get(name, ""), new_fields.get(name, "")
        if a == b:
            continue
        if not b:
            return name, f"message {index} ({role}) {name} removed"
        if not a:
            return name, f"message {index} ({role}) {name} added"
        return name, f"message {index} ({role}) {name} changed at char {len(_common_text_prefix(a, b))}"
    return "content", f"message {index} ({role}) changed"  # not reached: the keys differ


def _tools_reason(old: tuple[ToolSpec, ...], new: tuple[ToolSpec, ...]) -> str:
    old_names, new_names = [t.name for t in old], [t.name for t in new]
    if sorted(old) == sorted(new):
        return f"tool definitions reordered ({', '.join(old_names)} -> {', '.join(new_names)})"
    old_table, new_table = dict(old), dict(new)
    parts = [
        ("added", [n for n in new_names if n not in old_table]),
        ("removed", [n for n in old_names if n not in new_table]),
        ("changed", [n for n in new_names if n in old_table and old_table[n] != new_table[n]]),
    ]
    described = "; ".join(f"{what}: {', '.join(names)}" for what, names in parts if names)
    return f"tool definitions changed ({described or 'order and content'})"


def _same_messages(a: Sequence[MessageSpan], b: Sequence[MessageSpan]) -> bool:
    return len(a) == len(b) > 0 and all(_span_key(x) == _span_key(y) for x, y in zip(a, b, strict=True))


def _common_text_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]
