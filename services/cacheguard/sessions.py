"""SessionTable: what each session sent last, and how a new prompt compares with it.

A session is keyed by (tenant, session_id). The table keeps the last prompt's token ids and the
token range of each of its chat messages, bounded by max_sessions (least recently used dropped).
`observe` compares a new prompt with the stored one: the longest common token prefix, whether the
new prompt extends the old one, and if not, which message diverged and why.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

logger = logging.getLogger(__name__)

DERIVED_PREFIX = "auto-"
_PROMPT_ID_TOKENS = 64  # a derived id of a non-chat prompt hashes its first page of tokens
_COMPARE_CHUNK = 4096


class MessageSpan(NamedTuple):
    """One chat message of a prompt: what it said and its token range [token_start, token_end)."""

    role: str
    content: str
    token_start: int
    token_end: int


class PrefixReport(NamedTuple):
    """How a session's new prompt relates to its previous one (mirrors cacheguard.v1.PrefixReport)."""

    session_id: str
    previous_tokens: int  # 0: new session
    common_prefix_tokens: int
    diverged: bool  # the new prompt does not extend the previous one
    divergence_message_index: int  # -1 when not diverged or not a chat prompt
    divergence_reason: str  # "" when not diverged


class _Entry(NamedTuple):
    token_ids: array[int]
    spans: tuple[MessageSpan, ...]


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

    def observe(
        self,
        session_id: str,
        token_ids: Sequence[int],
        message_spans: Sequence[MessageSpan] = (),
        tenant: str = "",
    ) -> PrefixReport:
        """Compare `token_ids` with the session's previous prompt, then remember them as its last."""
        key = (tenant, session_id)
        new = _Entry(array("i", token_ids), tuple(message_spans))
        with self._lock:
            previous = self._table.pop(key, None)
            self._table[key] = new
            while len(self._table) > self.max_sessions:
                self._table.popitem(last=False)
        if previous is None:
            return PrefixReport(session_id, 0, 0, False, -1, "")
        common = common_prefix_len(previous.token_ids, new.token_ids)
        num_previous = len(previous.token_ids)
        if common == num_previous:
            return PrefixReport(session_id, num_previous, common, False, -1, "")
        index, reason = _divergence(previous.spans, new.spans, common)
        logger.debug("session %s diverged at token %d of %d: %s", session_id, common, num_previous, reason)
        return PrefixReport(session_id, num_previous, common, True, index, reason)


def _divergence(old: tuple[MessageSpan, ...], new: tuple[MessageSpan, ...], common: int) -> tuple[int, str]:
    """(message index, reason) for prompts that first differ at token `common` of the old one."""
    if not old or not new:
        return -1, f"prompt changed at token {common}"
    # The message whose old token range holds the first differing token (len(old): the generation prompt).
    at = next((k for k, span in enumerate(old) if span.token_end > common), len(old))
    # A message whose role or content changed is named first, if it starts at or before that token
    # (this also covers unknown message boundaries, which leave earlier messages with empty ranges).
    changed = next(
        (k for k in range(min(len(old), len(new))) if (old[k].role, old[k].content) != (new[k].role, new[k].content)),
        None,
    )
    if changed is not None and old[changed].token_start <= common:
        return changed, _change_reason(old, new, changed)
    if at < len(old) and at >= len(new):
        return at, f"history truncated ({len(old)} -> {len(new)} messages)"
    if at < len(old):
        return at, f"message {at} ({new[at].role}) rendered differently with the same role and content"
    if len(new) > len(old):
        return at, f"message {at} ({new[at].role}) does not extend the previous generation prompt"
    return at, "generation prompt changed"


def _change_reason(old: tuple[MessageSpan, ...], new: tuple[MessageSpan, ...], k: int) -> str:
    for num_removed in range(1, len(old) - k):
        overlap = min(len(new) - k, len(old) - k - num_removed)
        if _same_messages(new[k : k + overlap], old[k + num_removed : k + num_removed + overlap]):
            return f"history truncated: {num_removed} message(s) removed at message {k}"
    if old[k].role != new[k].role:
        return f"message {k} role changed ({old[k].role} -> {new[k].role})"
    char = len(_common_text_prefix(old[k].content, new[k].content))
    return f"message {k} ({new[k].role}) content changed at char {char}"


def _same_messages(a: Sequence[MessageSpan], b: Sequence[MessageSpan]) -> bool:
    return len(a) == len(b) > 0 and all((x.role, x.content) == (y.role, y.content) for x, y in zip(a, b, strict=True))


def _common_text_prefix(a: str, b: str) -> str:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return a[:i]
