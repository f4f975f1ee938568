"""Volatile content: recognising current date/time lines in a system prompt.

A line is volatile when, once its date and time expressions are taken out, nothing but label words
and punctuation is left ("Current date: 2026-11-29", "Today is Friday, November 29, 2026.",
"The current time is 14:03:22 UTC", "- Date/time: 2026-11-29T14:03:22Z"). A line that also says
something else ("Deadline: 2026-12-01", "Never mention 2026-11-29 to users", "Knowledge cutoff:
2024-06") is not volatile: moving it could change what the prompt means. Only whole lines count.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAX_LINE_CHARS = 120  # longer lines are prose, never moved

_MONTHS = (
    r"(?:jan(?:uary)?|feb(?:ruary)?|mar(?:ch)?|apr(?:il)?|may|june?|july?|aug(?:ust)?|"
    r"sep(?:t(?:ember)?)?|oct(?:ober)?|nov(?:ember)?|dec(?:ember)?)\.?"
)
_WEEKDAYS = r"(?:mon|tue|tues|wed|thu|thur|thurs|fri|sat|sun)(?:day|nesday|sday|rsday|urday)?\.?"
_ZONE = r"(?:utc|gmt|z|[a-z]{2,4}t|[+-]\d{2}:?\d{2})"
_TIME = rf"\d{{1,2}}:\d{{2}}(?::\d{{2}}(?:\.\d+)?)?(?:\s*[ap]\.?m\.?)?(?:\s*{_ZONE})?"
_DATE_EXPRESSIONS = (
    rf"\d{{4}}-\d{{2}}-\d{{2}}(?:[t ]{_TIME})?",  # ISO date, optionally with a time
    r"\d{4}/\d{1,2}/\d{1,2}",
    r"\d{1,2}[/.]\d{1,2}[/.]\d{4}",
    rf"{_MONTHS}\s+\d{{1,2}}(?:st|nd|rd|th)?,?\s+\d{{4}}",  # November 29, 2026
    rf"\d{{1,2}}(?:st|nd|rd|th)?\s+(?:of\s+)?{_MONTHS},?\s+\d{{4}}",  # 29 November 2026
    _TIME,
    r"\d{10}(?:\.\d+)?",  # unix seconds (only when labelled, see _LABELS)
)
_DATE = re.compile(r"\b(?:" + "|".join(_DATE_EXPRESSIONS) + r")(?![\w:])", re.IGNORECASE)
_WEEKDAY = re.compile(rf"\b{_WEEKDAYS}(?!\w)", re.IGNORECASE)
_LABELS = frozenset(
    "current currently today today's todays now it is it's its the date time datetime timestamp day "
    "local utc gmt timezone zone as of at on right and system clock unix epoch seconds".split()
)
_UNIX_LABELS = frozenset({"timestamp", "unix", "epoch"})
_WORD = re.compile(r"[a-z']+")


class VolatileSplit(NamedTuple):
    """A text with its volatile lines taken out, and those lines (joined by newlines, in order)."""

    stable: str
    volatile: str


def is_volatile_line(line: str) -> bool:
    """True when `line` only states the current date and/or time (see the module docstring)."""
    text = line.strip()
    if not text or len(text) > MAX_LINE_CHARS:
        return False
    found = _DATE.findall(text)
    if not found:
        return False
    rest = _WEEKDAY.sub(" ", _DATE.sub(" ", text)).lower()
    words = _WORD.findall(rest)
    if all(x.isdigit() for x in found) and not _UNIX_LABELS & set(words):
        return False  # a bare 10-digit number is a date only when labelled as a timestamp
    if any(w not in _LABELS for w in words):
        return False
    leftover = _WORD.sub("", rest)
    return all(not c.isalnum() for c in leftover)


def split_volatile(text: str) -> VolatileSplit:
    """Take the volatile lines out of `text`; every other line keeps its bytes and order.

    The blank line that separated a removed line from the text is removed with it, so
    "Current date: X\n\nYou are terse." becomes "You are terse." (and not "\nYou are terse.").
    """
    lines = text.split("\n")
    kept: list[str] = []
    moved: list[str] = []
    i = 0
    while i < len(lines):
        if not is_volatile_line(lines[i]):
            kept.append(lines[i])
            i += 1
            continue
        moved.append(lines[i].strip())
        i += 1
        if i < len(lines) and not lines[i].strip() and (not kept or not kept[-1].strip()):
            i += 1  # the blank line after a removed line at the start or after a blank line
    if not moved:
        return VolatileSplit(text, "")
    if is_volatile_line(lines[-1]):
        while kept and not kept[-1].strip():
            kept.pop()  # the blank line before a removed last line
    return VolatileSplit("\n".join(kept), "\n".join(moved))


def volatile_line_at(text: str, char: int) -> bool:
    """True when character `char` of `text` lies on a volatile line (for divergence reasons)."""
    start = text.rfind("\n", 0, char) + 1
    end = text.find("\n", char)
    return is_volatile_line(text[start : end if end >= 0 else len(text)])
