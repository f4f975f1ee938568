"""Recognising current date/time lines: what is moved, and what must never be."""

from __future__ import annotations

import pytest

from services.cacheguard.volatile import VolatileSplit, is_volatile_line, split_volatile, volatile_line_at


@pytest.mark.parametrize(
    "line",
    [
        "Current date: 2026-11-29",
        "Current date and time: 2026-11-29 14:03:22 UTC",
        "Today is Friday, November 29, 2026.",
        "Today: Sat 29 Nov 2026",
        "The current time is 14:03:22 UTC",
        "It is 2:03 pm.",
        "- Date/time: 2026-11-29T14:03:22Z",
        "Date: 29/11/2026",
        "Timestamp: 1764424800",
        "  2026-11-29  ",
        "As of 2026-11-29 08:00 UTC",
    ],
)
def test_date_and_time_lines_are_volatile(line: str) -> None:
    assert is_volatile_line(line)


@pytest.mark.parametrize(
    "line",
    [
        "Deadline: 2026-12-01",  # a date that means something else
        "Never mention 2026-11-29 to users.",
        "Knowledge cutoff: 2024-06",
        "Current date: unknown",  # no date in it
        "Call me at 10:30",
        "You have 12:00 to finish",
        "Version 1.2.3",
        "1764424800",  # a bare number is not a timestamp without the label
        "Today is Friday",  # a weekday alone
        "Current date: 2026-11-29. Answer in French.",  # an instruction on the same line
        "",
        "Date: 2026-11-29 " + "x" * 120,  # too long to be a clock line
    ],
)
def test_lines_that_say_more_are_not_volatile(line: str) -> None:
    assert not is_volatile_line(line)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Current date: 2026-11-29\n\nYou are terse.", VolatileSplit("You are terse.", "Current date: 2026-11-29")),
        ("You are terse.\n\nCurrent date: 2026-11-29", VolatileSplit("You are terse.", "Current date: 2026-11-29")),
        ("You are terse.\nDate: 2026-11-29\nBe nice.", VolatileSplit("You are terse.\nBe nice.", "Date: 2026-11-29")),
        ("A\n\nDate: 2026-11-29\n\nB", VolatileSplit("A\n\nB", "Date: 2026-11-29")),
        (
            "Date: 2026-11-29\nTime: 14:03 UTC\n\nRules:\n\n\n- be brief",
            VolatileSplit("Rules:\n\n\n- be brief", "Date: 2026-11-29\nTime: 14:03 UTC"),
        ),
        ("No clock here.\n\n\nTwo blank lines kept.", VolatileSplit("No clock here.\n\n\nTwo blank lines kept.", "")),
        ("Current date: 2026-11-29", VolatileSplit("", "Current date: 2026-11-29")),
    ],
)
def test_split_takes_out_whole_lines_and_keeps_the_rest_byte_for_byte(text: str, expected: VolatileSplit) -> None:
    assert split_volatile(text) == expected


def test_volatile_line_at_a_character() -> None:
    text = "You are terse.\nCurrent date: 2026-11-29\nBe nice."
    assert volatile_line_at(text, text.index("2026"))
    assert not volatile_line_at(text, text.index("terse"))
    assert not volatile_line_at(text, len(text))
