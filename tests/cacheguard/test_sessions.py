"""SessionTable: exact prefix lengths, divergence index and reason, LRU bound, derived session ids."""

from __future__ import annotations

import threading

import pytest

from services.cacheguard.normalize import SessionMemory
from services.cacheguard.sessions import (
    MessageSpan,
    PrefixReport,
    SessionTable,
    ToolSpec,
    common_prefix_len,
    derive_chat_session_id,
    derive_prompt_session_id,
)


def spans(*messages: tuple[str, str, int]) -> tuple[MessageSpan, ...]:
    """Consecutive spans from (role, content, num_tokens)."""
    out: list[MessageSpan] = []
    start = 0
    for role, content, num_tokens in messages:
        out.append(MessageSpan(role, content, start, start + num_tokens))
        start += num_tokens
    return tuple(out)


# A 3-message chat: system 0..10, user 10..15, assistant 15..20, then a 3-token generation prompt.
SYS = ("system", "You are a helpful bot.", 10)
U1 = ("user", "hi", 5)
A1 = ("assistant", "hello", 5)
U2 = ("user", "bye", 4)
OLD_IDS = list(range(100, 123))  # 23 tokens
OLD_SPANS = spans(SYS, U1, A1)


def table_with_old(session: str = "s") -> SessionTable:
    table = SessionTable(max_sessions=8)
    first = table.observe(session, OLD_IDS, OLD_SPANS)
    assert first == PrefixReport(session, 0, 0, False, -1, "")
    return table


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [], 0),
        ([1, 2, 3], [], 0),
        ([1, 2, 3], [1, 2, 3], 3),
        ([1, 2, 3], [1, 2, 3, 4], 3),
        ([1, 2, 3], [1, 9, 3], 1),
        ([0] * 4096, [0] * 4096, 4096),
        ([0] * 4096 + [1], [0] * 4096 + [2], 4096),
        ([0] * 4095 + [1], [0] * 4096, 4095),
        ([0] * 8193 + [1], [0] * 8193 + [2, 3], 8193),
        ([0] * 10000, [0] * 9000, 9000),
    ],
)
def test_common_prefix_len(a: list[int], b: list[int], expected: int) -> None:
    assert common_prefix_len(a, b) == expected


def test_new_session_then_extension_reports_full_prefix() -> None:
    table = table_with_old()
    new_ids = OLD_IDS + [500, 501, 502, 503]
    report = table.observe("s", new_ids, spans(SYS, U1, A1, U2))
    assert report == PrefixReport("s", 23, 23, False, -1, "")
    # The stored prompt is now the extended one.
    assert table.observe("s", new_ids, spans(SYS, U1, A1, U2)) == PrefixReport("s", 27, 27, False, -1, "")


def test_system_content_change_names_message_and_char() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:7] + [999] + OLD_IDS[8:]
    changed = ("system", "You are a helpful cat.", 10)
    report = table.observe("s", new_ids, spans(changed, U1, A1))
    assert report == PrefixReport(
        "s", 23, 7, True, 0, "message 0 (system) content changed at char 18", "content"
    )  # "You are a helpful " is 18


def test_later_message_change_is_named_even_when_boundaries_are_coarse() -> None:
    table = SessionTable(max_sessions=4)
    # Unknown boundaries: messages 0 and 1 have empty ranges, message 2 holds everything.
    coarse = (MessageSpan("system", "a", 0, 0), MessageSpan("user", "b", 0, 0), MessageSpan("user", "c", 0, 9))
    table.observe("s", list(range(9)), coarse)
    new = (MessageSpan("system", "a", 0, 0), MessageSpan("user", "B", 0, 0), MessageSpan("user", "c", 0, 9))
    report = table.observe("s", [0, 1, 2, 7, 7, 7, 7, 7, 7], new)
    assert report == PrefixReport("s", 9, 3, True, 1, "message 1 (user) content changed at char 0", "content")


def test_role_change() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:10] + [1, 2, 3, 4, 5] + OLD_IDS[15:]
    report = table.observe("s", new_ids, spans(SYS, ("assistant", "hi", 5), A1))
    assert report == PrefixReport("s", 23, 10, True, 1, "message 1 role changed (user -> assistant)", "role")


def test_history_truncated_at_the_end() -> None:
    table = table_with_old()
    # New request: system + user only; its generation prompt matches 2 tokens of the old assistant message.
    new_ids = OLD_IDS[:17] + [7]
    report = table.observe("s", new_ids, spans(SYS, U1))
    assert report == PrefixReport("s", 23, 17, True, 2, "history truncated (3 -> 2 messages)", "messages")


def test_history_truncated_in_the_middle() -> None:
    table = SessionTable(max_sessions=4)
    u3 = ("user", "third", 5)
    table.observe("s", list(range(30)), spans(SYS, U1, A1, u3))
    # Sliding window: the first user/assistant pair dropped, the system message kept.
    report = table.observe("s", list(range(10)) + [80, 81, 82, 83, 84], spans(SYS, u3))
    assert report == PrefixReport(
        "s", 30, 10, True, 1, "history truncated: 2 message(s) removed at message 1", "messages"
    )


def test_same_messages_rendered_differently() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:12] + [0] + OLD_IDS[13:]  # tokens differ inside message 1, same role and content
    report = table.observe("s", new_ids, spans(SYS, U1, A1))
    assert report == PrefixReport(
        "s", 23, 12, True, 1, "message 1 (user) rendered differently with the same role and content", "rendering"
    )


def test_new_message_does_not_extend_generation_prompt() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:21] + [0, 0, 0, 0, 0]  # the old 3-token generation prompt 20..23 broken at 21
    report = table.observe("s", new_ids, spans(SYS, U1, A1, U2))
    assert report == PrefixReport(
        "s", 23, 21, True, 3, "message 3 (user) does not extend the previous generation prompt", "generation_prompt"
    )


def test_same_messages_generation_prompt_changed() -> None:
    table = table_with_old()
    report = table.observe("s", OLD_IDS[:22] + [1], OLD_SPANS)
    assert report == PrefixReport("s", 23, 22, True, 3, "generation prompt changed", "generation_prompt")


def test_non_chat_prompt_divergence() -> None:
    table = SessionTable(max_sessions=2)
    table.observe("p", [5, 6, 7, 8])
    report = table.observe("p", [5, 6, 7, 9, 10])
    assert report == PrefixReport("p", 4, 3, True, -1, "prompt changed at token 3", "tokens")
    report = table.observe("p", [5, 6])
    assert report == PrefixReport("p", 5, 2, True, -1, "prompt changed at token 2", "tokens")


def test_lru_bound_evicts_least_recently_used() -> None:
    table = SessionTable(max_sessions=3)
    for name in ("a", "b", "c"):
        table.observe(name, [1, 2])
    table.observe("a", [1, 2, 3])  # touch a: b is now the least recently used
    table.observe("d", [4])
    assert len(table) == 3
    assert ("", "b") not in table
    assert table.observe("b", [1, 2]).previous_tokens == 0
    # b's return evicted c (the oldest now); a and d are kept with their last prompts.
    assert ("", "c") not in table
    assert table.observe("a", [1, 2, 3, 4]).previous_tokens == 3
    assert table.observe("d", [4, 5]).common_prefix_tokens == 1


def test_sessions_are_scoped_by_tenant() -> None:
    table = SessionTable(max_sessions=4)
    table.observe("same", [1, 2, 3], tenant="t1")
    assert table.observe("same", [1, 2, 3], tenant="t2").previous_tokens == 0
    assert table.observe("same", [1, 2, 3, 4], tenant="t1") == PrefixReport("same", 3, 3, False, -1, "")


def test_concurrent_observes_keep_the_bound() -> None:
    table = SessionTable(max_sessions=50)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(300):
                table.observe(f"w{worker}-{i % 70}", [worker, i, i + 1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(table) == 50


def test_derived_chat_session_ids() -> None:
    opening = [("system", "You are terse."), ("user", "hi")]
    sid = derive_chat_session_id("t", opening)
    assert sid.startswith("auto-") and len(sid) == len("auto-") + 24
    assert derive_chat_session_id("t", opening) == sid
    # Only the first two messages count: later turns keep the id.
    assert derive_chat_session_id("t", [*opening, ("assistant", "hello"), ("user", "more")]) == sid
    # A chat opened by a user message is identified by that message alone (turn 2 adds an assistant reply).
    user_first = derive_chat_session_id("t", [("user", "hi")])
    assert derive_chat_session_id("t", [("user", "hi"), ("assistant", "hello"), ("user", "more")]) == user_first
    assert user_first != sid
    others = {
        derive_chat_session_id("u", opening),
        derive_chat_session_id("t", [("system", "You are terse."), ("user", "hi!")]),
        derive_chat_session_id("t", [("developer", "You are terse."), ("user", "hi")]),
        derive_chat_session_id("t", [("system", "You are terse.")]),
        # Field boundaries are part of the hash: ("ab", "c") is not ("a", "bc").
        derive_chat_session_id("t", [("system", "You are terse.u"), ("ser", "hi")]),
    }
    assert sid not in others and len(others) == 5


def test_derived_prompt_session_ids() -> None:
    ids = list(range(100))
    sid = derive_prompt_session_id("t", ids)
    assert sid.startswith("auto-p") and len(sid) == len("auto-") + 24
    assert derive_prompt_session_id("t", ids[:64] + [7, 7]) == sid  # only the first 64 tokens count
    assert derive_prompt_session_id("t", [1] + ids[1:]) != sid
    assert derive_prompt_session_id("u", ids) != sid


# ---------------------------------------------------------------- which field diverged


def fielded(*messages: tuple[str, str, int, tuple[tuple[str, str], ...]]) -> tuple[MessageSpan, ...]:
    """Consecutive spans from (role, content, num_tokens, fields)."""
    out: list[MessageSpan] = []
    start = 0
    for role, content, num_tokens, fields in messages:
        out.append(MessageSpan(role, content, start, start + num_tokens, fields, len(out)))
        start += num_tokens
    return tuple(out)


CALLS = ("tool_calls", '[{"function": {"arguments": {"path": "a.py"}, "name": "read_file"}}]')
THOUGHT = ("reasoning_content", "I should read a.py")


@pytest.mark.parametrize(
    ("new_fields", "field", "reason"),
    [
        ((CALLS,), "reasoning_content", "message 2 (assistant) reasoning_content removed"),
        ((("reasoning_content", "I should read b.py"), CALLS), "reasoning_content",
         "message 2 (assistant) reasoning_content changed at char 14"),
        ((THOUGHT,), "tool_calls", "message 2 (assistant) tool_calls removed"),
        ((("name", "bot"), THOUGHT, CALLS), "name", "message 2 (assistant) name added"),
    ],
)  # fmt: skip
def test_a_changed_message_field_is_named(new_fields: tuple[tuple[str, str], ...], field: str, reason: str) -> None:
    table = SessionTable(max_sessions=2)
    old = fielded(("system", "s", 10, ()), ("user", "u", 5, ()), ("assistant", "", 20, (THOUGHT, CALLS)))
    table.observe("s", list(range(38)), old)
    new = fielded(("system", "s", 10, ()), ("user", "u", 5, ()), ("assistant", "", 8, new_fields))
    report = table.observe("s", list(range(17)) + [0] * 10, new)
    assert report == PrefixReport("s", 38, 17, True, 2, reason, field)


def tool(name: str, description: str = "") -> ToolSpec:
    return ToolSpec(name, f'{{"name": "{name}", "description": "{description}"}}')


@pytest.mark.parametrize(
    ("new_tools", "reason"),
    [
        ((tool("b"), tool("a")), "tool definitions reordered (a, b -> b, a)"),
        ((tool("a"), tool("c")), "tool definitions changed (added: c; removed: b)"),
        ((tool("a"), tool("b", "now described")), "tool definitions changed (changed: b)"),
    ],
)
def test_changed_tool_definitions_are_named(new_tools: tuple[ToolSpec, ...], reason: str) -> None:
    table = SessionTable(max_sessions=2)
    table.observe("s", OLD_IDS, OLD_SPANS, tools=(tool("a"), tool("b")))
    # Tools render inside the system message: same messages, tokens differ at token 4.
    report = table.observe("s", OLD_IDS[:4] + [0] + OLD_IDS[5:], OLD_SPANS, tools=new_tools)
    assert report == PrefixReport("s", 23, 4, True, 0, reason, "tools")


def test_guard_placed_messages_are_reported_by_the_client_message_they_precede() -> None:
    table = SessionTable(max_sessions=2)
    placed = ("system", "Time: 10:00 UTC", 4, ())
    old = fielded(("system", "s", 10, ()), placed, ("user", "u", 5, ()))
    old = (old[0], old[1]._replace(client_index=-1), old[2]._replace(client_index=1))
    table.observe("s", list(range(19)), old)
    new = (old[0], old[1]._replace(content="Time: 10:05 UTC"), old[2])
    report = table.observe("s", list(range(12)) + [0] * 7, new)
    assert report == PrefixReport(
        "s", 19, 12, True, 1, "the date/time lines placed before message 1 changed", "volatile"
    )
    # A later message is reported by the client's index, not its position in the rendered chat.
    edited = (*new[:2], new[2]._replace(content="v"))
    report = table.observe("s", list(range(12)) + [0, 0, 0, 5, 0, 0, 0], edited)
    assert (report.divergence_message_index, report.divergence_field) == (1, "content")


def test_a_clock_line_edit_in_the_system_prompt_is_pointed_out() -> None:
    table = SessionTable(max_sessions=2)
    table.observe("s", OLD_IDS, spans(("system", "Be terse.\nDate: 2026-11-29", 10), U1, A1))
    report = table.observe("s", OLD_IDS[:6] + [0] * 17, spans(("system", "Be terse.\nDate: 2026-11-30", 10), U1, A1))
    assert report.divergence_reason == "message 0 (system) content changed at char 24 (a date/time line)"


def test_memory_is_kept_with_the_session_and_replaced_only_when_given() -> None:
    table = SessionTable(max_sessions=1)
    assert table.memory("s") == SessionMemory()
    table.observe("s", [1, 2], memory=SessionMemory(tool_names=("a",)))
    table.observe("s", [1, 2, 3])  # no memory given: kept
    assert table.memory("s") == SessionMemory(tool_names=("a",))
    assert table.memory("s", tenant="other") == SessionMemory()
    table.observe("t", [1])  # evicts s
    assert table.memory("s") == SessionMemory()
