"""SessionTable: exact prefix lengths, divergence index and reason, LRU bound, derived session ids."""

from __future__ import annotations

import threading

import pytest

from services.cacheguard.sessions import (
    MessageSpan,
    PrefixReport,
    SessionTable,
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
        "s", 23, 7, True, 0, "message 0 (system) content changed at char 18"
    )  # "You are a helpful " is 18


def test_later_message_change_is_named_even_when_boundaries_are_coarse() -> None:
    table = SessionTable(max_sessions=4)
    # Unknown boundaries: messages 0 and 1 have empty ranges, message 2 holds everything.
    coarse = (MessageSpan("system", "a", 0, 0), MessageSpan("user", "b", 0, 0), MessageSpan("user", "c", 0, 9))
    table.observe("s", list(range(9)), coarse)
    new = (MessageSpan("system", "a", 0, 0), MessageSpan("user", "B", 0, 0), MessageSpan("user", "c", 0, 9))
    report = table.observe("s", [0, 1, 2, 7, 7, 7, 7, 7, 7], new)
    assert report == PrefixReport("s", 9, 3, True, 1, "message 1 (user) content changed at char 0")


def test_role_change() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:10] + [1, 2, 3, 4, 5] + OLD_IDS[15:]
    report = table.observe("s", new_ids, spans(SYS, ("assistant", "hi", 5), A1))
    assert report == PrefixReport("s", 23, 10, True, 1, "message 1 role changed (user -> assistant)")


def test_history_truncated_at_the_end() -> None:
    table = table_with_old()
    # New request: system + user only; its generation prompt matches 2 tokens of the old assistant message.
    new_ids = OLD_IDS[:17] + [7]
    report = table.observe("s", new_ids, spans(SYS, U1))
    assert report == PrefixReport("s", 23, 17, True, 2, "history truncated (3 -> 2 messages)")


def test_history_truncated_in_the_middle() -> None:
    table = SessionTable(max_sessions=4)
    u3 = ("user", "third", 5)
    table.observe("s", list(range(30)), spans(SYS, U1, A1, u3))
    # Sliding window: the first user/assistant pair dropped, the system message kept.
    report = table.observe("s", list(range(10)) + [80, 81, 82, 83, 84], spans(SYS, u3))
    assert report == PrefixReport("s", 30, 10, True, 1, "history truncated: 2 message(s) removed at message 1")


def test_same_messages_rendered_differently() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:12] + [0] + OLD_IDS[13:]  # tokens differ inside message 1, same role and content
    report = table.observe("s", new_ids, spans(SYS, U1, A1))
    assert report == PrefixReport(
        "s", 23, 12, True, 1, "message 1 (user) rendered differently with the same role and content"
    )


def test_new_message_does_not_extend_generation_prompt() -> None:
    table = table_with_old()
    new_ids = OLD_IDS[:21] + [0, 0, 0, 0, 0]  # the old 3-token generation prompt 20..23 broken at 21
    report = table.observe("s", new_ids, spans(SYS, U1, A1, U2))
    assert report == PrefixReport(
        "s", 23, 21, True, 3, "message 3 (user) does not extend the previous generation prompt"
    )


def test_same_messages_generation_prompt_changed() -> None:
    table = table_with_old()
    report = table.observe("s", OLD_IDS[:22] + [1], OLD_SPANS)
    assert report == PrefixReport("s", 23, 22, True, 3, "generation prompt changed")


def test_non_chat_prompt_divergence() -> None:
    table = SessionTable(max_sessions=2)
    table.observe("p", [5, 6, 7, 8])
    assert table.observe("p", [5, 6, 7, 9, 10]) == PrefixReport("p", 4, 3, True, -1, "prompt changed at token 3")
    assert table.observe("p", [5, 6]) == PrefixReport("p", 5, 2, True, -1, "prompt changed at token 2")


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
