"""The normalisations one by one: what each does, what it remembers, and when it must not apply."""

from __future__ import annotations

from typing import Any

import pytest

from services.cacheguard.normalize import (
    NORMALIZATIONS,
    REASONING,
    TOOL_ORDER,
    VOLATILE_LINES,
    Normalized,
    Normalizer,
    Placement,
    SessionMemory,
    message_key,
)
from services.cacheguard.renderer import chat_message, tool_call, tool_definition

ALL = Normalizer(NORMALIZATIONS, inner_system=True)


def tools(*names: str) -> list[dict[str, Any]]:
    return [tool_definition(n, f"does {n}", "") for n in names]


def names(result: Normalized) -> list[str]:
    return [t["function"]["name"] for t in result.tools]


def contents(result: Normalized) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in result.messages]


USER = [chat_message("user", "hi")]

# ---------------------------------------------------------------- tool order


def test_tools_keep_their_first_seen_order() -> None:
    first = ALL.apply(USER, tools("a", "b", "c"), SessionMemory())
    assert names(first) == ["a", "b", "c"] and first.applied == ()
    assert first.memory.tool_names == ("a", "b", "c")
    second = ALL.apply(USER, tools("c", "a", "b"), first.memory)
    assert names(second) == ["a", "b", "c"] and second.applied == (TOOL_ORDER,)
    # A tool new to the session comes after the known ones, wherever the client put it.
    third = ALL.apply(USER, tools("b", "d", "a", "c"), second.memory)
    assert names(third) == ["a", "b", "c", "d"]
    assert third.memory.tool_names == ("a", "b", "c", "d")
    # A dropped tool that comes back takes its first-seen place again.
    fourth = ALL.apply(USER, tools("d", "c", "b"), third.memory)
    assert names(fourth) == ["b", "c", "d"]
    fifth = ALL.apply(USER, tools("d", "a", "c", "b"), fourth.memory)
    assert names(fifth) == ["a", "b", "c", "d"]


def test_tool_definitions_themselves_are_not_touched() -> None:
    sent = tools("b", "a")
    sent[0]["function"]["description"] = "changed"
    result = ALL.apply(USER, sent, SessionMemory(tool_names=("a", "b")))
    assert result.tools == [sent[1], sent[0]]


def test_tool_order_does_not_apply_to_tools_sharing_a_name() -> None:
    memory = SessionMemory(tool_names=("a", "b"))
    result = ALL.apply(USER, tools("b", "a", "b"), memory)
    assert names(result) == ["b", "a", "b"] and result.applied == ()
    assert result.memory.tool_names == ("a", "b")


# ---------------------------------------------------------------- reasoning


def assistant(content: str, reasoning: str = "", calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return chat_message("assistant", content, reasoning_content=reasoning, tool_calls=calls or [])


CALL = [tool_call("c1", "read_file", '{"path": "a.py"}')]


def turn(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [chat_message("user", "fix it"), *extra]


def test_dropped_reasoning_is_put_back() -> None:
    first = ALL.apply(
        turn(assistant("", "I should read a.py", CALL), chat_message("tool", "x = 1")), [], SessionMemory()
    )
    assert first.applied == ()
    dropped = turn(
        assistant("", "", CALL), chat_message("tool", "x = 1"), assistant("done"), chat_message("user", "ok")
    )
    second = ALL.apply(dropped, [], first.memory)
    assert second.applied == (REASONING,)
    assert second.messages[1]["reasoning_content"] == "I should read a.py"
    assert "reasoning_content" not in second.messages[3]  # never had any


@pytest.mark.parametrize(
    "later",
    [
        turn(assistant("", "", [tool_call("c1", "read_file", '{"path": "b.py"}')])),  # other tool call
        turn(assistant("I read it.", "", CALL)),  # other content
        [chat_message("user", "fix it"), chat_message("user", "again"), assistant("", "", CALL)],  # moved
        [chat_message("user", "fix it"), chat_message("user", "more")],  # the message is gone
    ],
)
def test_reasoning_is_not_put_back_on_another_message(later: list[dict[str, Any]]) -> None:
    first = ALL.apply(turn(assistant("", "I should read a.py", CALL)), [], SessionMemory())
    second = ALL.apply(later, [], first.memory)
    assert second.applied == ()
    assert all(not m.get("reasoning_content") for m in second.messages)


def test_reasoning_the_client_sends_wins_and_is_remembered() -> None:
    first = ALL.apply(turn(assistant("", "old thought", CALL)), [], SessionMemory())
    second = ALL.apply(turn(assistant("", "new thought", CALL)), [], first.memory)
    assert second.applied == () and second.messages[1]["reasoning_content"] == "new thought"
    third = ALL.apply(turn(assistant("", "", CALL)), [], second.memory)
    assert third.messages[1]["reasoning_content"] == "new thought"


def test_reasoning_memory_is_per_session() -> None:
    first = ALL.apply(turn(assistant("", "I should read a.py", CALL)), [], SessionMemory())
    other_session = ALL.apply(turn(assistant("", "", CALL)), [], SessionMemory())
    assert other_session.applied == () and not other_session.messages[1].get("reasoning_content")
    assert first.memory.reasoning  # remembered only in the first session's memory


# ---------------------------------------------------------------- volatile lines

SYSTEM = "Current date: 2026-11-29\n\nYou are a careful agent."
STABLE = "You are a careful agent."


def test_clock_line_moves_from_the_system_prompt_to_before_the_newest_input() -> None:
    first = ALL.apply([chat_message("system", SYSTEM), chat_message("user", "hi")], [], SessionMemory())
    assert contents(first) == [("system", STABLE), ("system", "Current date: 2026-11-29"), ("user", "hi")]
    assert first.origins == (0, -1, 1) and first.applied == (VOLATILE_LINES,)
    assert first.memory.placements == (
        Placement(1, message_key(1, chat_message("user", "hi")), "Current date: 2026-11-29"),
    )


def test_without_a_system_message_slot_the_lines_open_the_input_message() -> None:
    prepend = Normalizer(NORMALIZATIONS, inner_system=False)
    result = prepend.apply([chat_message("system", SYSTEM), chat_message("user", "hi")], [], SessionMemory())
    assert contents(result) == [("system", STABLE), ("user", "Current date: 2026-11-29\n\nhi")]
    assert result.origins == (0, 1)


def conversation(clock: str, *rest: dict[str, Any]) -> list[dict[str, Any]]:
    return [chat_message("system", f"{clock}\n\n{STABLE}"), chat_message("user", "fix it"), *rest]


STEP = [assistant("", "read", CALL), chat_message("tool", "x = 1", tool_call_id="c1")]


def test_earlier_placements_stay_and_a_changed_clock_goes_before_the_newest_input() -> None:
    r0 = ALL.apply(conversation("Time: 10:00 UTC"), [], SessionMemory())
    # Same clock in the tool loop: the earlier placement stays, nothing new is placed.
    r1 = ALL.apply(conversation("Time: 10:00 UTC", *STEP), [], r0.memory)
    assert contents(r1)[:3] == contents(r0)
    assert len(r1.messages) == 5 and r1.memory.placements == r0.memory.placements
    # The clock moved on: the old line stays where it was sent, the new one precedes the tool result.
    r2 = ALL.apply(conversation("Time: 10:01 UTC", *STEP), [], r1.memory)
    assert contents(r2) == [
        ("system", STABLE),
        ("system", "Time: 10:00 UTC"),
        ("user", "fix it"),
        ("assistant", ""),
        ("system", "Time: 10:01 UTC"),
        ("tool", "x = 1"),
    ]
    assert r2.origins == (0, -1, 1, 2, -1, 3)
    # What was sent before is a prefix of what is sent now: the point of the normalisation.
    r3 = ALL.apply(
        conversation("Time: 10:01 UTC", *STEP, assistant("done"), chat_message("user", "thanks")), [], r2.memory
    )
    assert contents(r3)[:6] == contents(r2) and len(r3.messages) == 8


def test_a_retried_request_with_another_clock_replaces_its_own_placement() -> None:
    r0 = ALL.apply(conversation("Time: 10:00 UTC"), [], SessionMemory())
    retry = ALL.apply(conversation("Time: 10:02 UTC"), [], r0.memory)
    assert contents(retry) == [("system", STABLE), ("system", "Time: 10:02 UTC"), ("user", "fix it")]
    assert len(retry.memory.placements) == 1


def test_a_placement_is_dropped_when_its_message_changed() -> None:
    r0 = ALL.apply(conversation("Time: 10:00 UTC"), [], SessionMemory())
    edited = [chat_message("system", f"Time: 10:00 UTC\n\n{STABLE}"), chat_message("user", "fix it, please")]
    r1 = ALL.apply(edited, [], r0.memory)
    assert contents(r1) == [("system", STABLE), ("system", "Time: 10:00 UTC"), ("user", "fix it, please")]
    assert r1.memory.placements[0].anchor_key == message_key(1, edited[1])


@pytest.mark.parametrize(
    "messages",
    [
        [chat_message("user", "Current date: 2026-11-29\n\nhi")],  # no system message
        [chat_message("system", "You are terse. Today is 2026-11-29, be brief."), chat_message("user", "hi")],  # prose
        [chat_message("system", "Deadline: 2026-12-01\nYou are terse."), chat_message("user", "hi")],  # not a clock
        [chat_message("system", SYSTEM)],  # no input after the system message
        [chat_message("system", SYSTEM), assistant("hello")],  # no user or tool message
        [chat_message("user", "hi"), chat_message("system", SYSTEM), chat_message("user", "ok")],  # not first
    ],
)
def test_volatile_lines_must_not_apply(messages: list[dict[str, Any]]) -> None:
    result = ALL.apply(messages, [], SessionMemory())
    assert result.messages == messages and result.applied == ()
    assert result.origins == tuple(range(len(messages)))


# ---------------------------------------------------------------- switches


def test_off_and_disabled_leave_the_request_and_the_memory_alone() -> None:
    memory = SessionMemory(tool_names=("a", "b"))
    messages = conversation("Time: 10:00 UTC", assistant("", "", CALL))
    off = ALL.apply(messages, tools("b", "a"), memory, off=True)
    assert (off.messages, names(off), off.applied, off.memory) == (messages, ["b", "a"], (), memory)
    only_tools = Normalizer([TOOL_ORDER], inner_system=True).apply(messages, tools("b", "a"), memory)
    assert only_tools.messages == messages and names(only_tools) == ["a", "b"]
    assert only_tools.applied == (TOOL_ORDER,)
    none = Normalizer([], inner_system=True).apply(messages, tools("b", "a"), memory)
    assert none.messages == messages and none.applied == ()


def test_no_text_is_lost() -> None:
    """Every non-blank line the client sent is in the normalised chat, once."""
    client = conversation("Current date: 2026-11-29\nTime: 10:00 UTC", *STEP)
    result = ALL.apply(client, tools("b", "a"), SessionMemory(tool_names=("a", "b")))
    sent = [line for m in client for line in m["content"].split("\n") if line.strip()]
    kept = [line for m in result.messages for line in m["content"].split("\n") if line.strip()]
    assert sorted(sent) == sorted(kept)
