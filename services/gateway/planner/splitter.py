"""Structural splitting of a document into shards (DESIGN.md §5, L2).

A document is first cut into **units** that follow its structure: top-level JSON items, CSV/log
lines, and for markdown or prose: headings, paragraphs, fenced code blocks, list items and table
rows. Units are contiguous spans covering the whole text (blank lines stay with the unit before
them), so joining the shards gives the input back, character for character.

Units are packed greedily into shards of at most `max_size` (measured by a caller-given additive
size function, tokens in the planner). A unit is only cut when it alone is over `max_size`, and
then along its own structure: a JSON container into its items, a code block into lines, a
paragraph into sentences, then words, then characters. A heading is never left as the last unit
of a shard, and a shard that is already well filled ends before a heading.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

logger = logging.getLogger(__name__)

Size = Callable[[str], int]


class UnitKind(str, Enum):
    HEADING = "heading"
    PARAGRAPH = "paragraph"
    CODE = "code"
    LIST_ITEM = "list_item"
    TABLE_ROW = "table_row"
    LINE = "line"  # one CSV/log record
    JSON_ITEM = "json_item"
    SENTENCE = "sentence"  # a piece of an oversized unit, cut at a sentence or line end
    WORD = "word"
    CHARS = "chars"


class DocFormat(str, Enum):
    JSON = "json"
    LINES = "lines"  # CSV or log: one record per line
    MARKDOWN = "markdown"  # markdown or plain prose


class Unit(NamedTuple):
    """text[start:end] is one structural unit."""

    start: int
    end: int
    kind: UnitKind


@dataclass(frozen=True)
class Shard:
    """One piece of the document: text == document[start:end]. `context` is what the model needs
    to read it (the CSV header, the headings above it) and is not part of the partition."""

    index: int
    start: int
    end: int
    text: str
    context: str
    size: int


# ---------------------------------------------------------------- format and units

_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")
_HEADING = re.compile(r" {0,3}#{1,6}(\s|$)")
_LIST_ITEM = re.compile(r"\s*([-*+]|\d{1,9}[.)])\s+\S")
_TABLE_ROW = re.compile(r"\s*\|")
_SENTENCE_END = re.compile(r"(?<=[.!?;])[\"')\]]*\s+|\n+")
_WORD = re.compile(r"\S+\s*|\s+")


def detect_format(text: str) -> DocFormat:
    """JSON when the whole text parses as a JSON array or object; LINES for CSV/log-like text
    (many short lines, no blank-line paragraphs, no markdown); MARKDOWN otherwise."""
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            json.loads(stripped)
            return DocFormat.JSON
        except ValueError:
            pass
    lines = text.splitlines()
    non_blank = [ln for ln in lines if ln.strip()]
    if len(non_blank) >= 8 and len(lines) - len(non_blank) <= max(1, len(lines) // 20):
        markdown = sum(1 for ln in non_blank if _FENCE.match(ln) or _HEADING.match(ln) or _LIST_ITEM.match(ln))
        if markdown <= len(non_blank) // 10:
            return DocFormat.LINES
    return DocFormat.MARKDOWN


def units_of(text: str, fmt: DocFormat | None = None) -> list[Unit]:
    """The structural units of `text`, contiguous and covering it."""
    if not text:
        return []
    fmt = fmt or detect_format(text)
    if fmt is DocFormat.JSON:
        items = json_children(text, 0, len(text))
        units = (
            [Unit(a, b, UnitKind.JSON_ITEM) for a, b in items] if items else [Unit(0, len(text), UnitKind.JSON_ITEM)]
        )
    elif fmt is DocFormat.LINES:
        units = [Unit(a, b, UnitKind.LINE) for a, b in _line_spans(text, 0, len(text))]
    else:
        units = _markdown_units(text)
    _check_cover(units, 0, len(text))
    return units


def _line_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    """Lines of text[start:end], each with its newline; blank lines join the line before."""
    spans: list[tuple[int, int]] = []
    pos = start
    while pos < end:
        nl = text.find("\n", pos, end)
        stop = end if nl < 0 else nl + 1
        if spans and not text[pos:stop].strip():
            spans[-1] = (spans[-1][0], stop)
        else:
            spans.append((pos, stop))
        pos = stop
    return spans


def _markdown_units(text: str) -> list[Unit]:
    lines = text.splitlines(keepends=True)
    units: list[Unit] = []
    pos = 0
    k = 0
    while k < len(lines):
        line = lines[k]
        start = pos
        pos += len(line)
        k += 1
        if not line.strip():  # blank lines belong to the unit before (or open the first one)
            if units:
                units[-1] = units[-1]._replace(end=pos)
            else:
                units.append(Unit(start, pos, UnitKind.PARAGRAPH))
            continue
        fence = _FENCE.match(line)
        if fence:
            marker = fence.group(1)
            while k < len(lines):
                closing = lines[k].strip()
                pos += len(lines[k])
                k += 1
                if closing.startswith(marker) and not closing.strip(marker[0]):
                    break
            kind = UnitKind.CODE
        elif _HEADING.match(line):
            kind = UnitKind.HEADING
        elif _TABLE_ROW.match(line):
            kind = UnitKind.TABLE_ROW
        else:  # a paragraph or a list item, with its continuation lines
            kind = UnitKind.LIST_ITEM if _LIST_ITEM.match(line) else UnitKind.PARAGRAPH
            while k < len(lines) and lines[k].strip() and not _starts_block(lines[k]):
                pos += len(lines[k])
                k += 1
        if len(units) == 1 and not text[: units[0].end].strip():
            units[0] = Unit(0, pos, kind)  # leading blank lines join the first real unit
        else:
            units.append(Unit(start, pos, kind))
    return units


def _starts_block(line: str) -> bool:
    return bool(_FENCE.match(line) or _HEADING.match(line) or _LIST_ITEM.match(line) or _TABLE_ROW.match(line))


# ---------------------------------------------------------------- JSON items


def json_children(text: str, start: int, end: int) -> list[tuple[int, int]] | None:
    """The items of the outermost JSON container in text[start:end] that has at least two items
    and closes inside the span (brackets of an enclosing container that the span only opens or
    closes are skipped, as are containers of one item). The first item's span starts at `start`
    and the last one ends at `end`, so they carry the brackets and keys around them; separators
    stay with the item before them. None when there is no such container."""
    k = start
    in_string = False
    while k < end:
        ch = text[k]
        if in_string:
            if ch == "\\":
                k += 1
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            cuts = _container_cuts(text, k, end)
            if cuts:
                bounds = [start, *cuts, end]
                return list(zip(bounds, bounds[1:], strict=False))
        k += 1
    return None


def _container_cuts(text: str, open_pos: int, end: int) -> list[int] | None:
    """Where the 2nd, 3rd, ... items of the container opened at open_pos start; None when it has
    fewer than two items or does not close before `end`."""
    depth = 0
    in_string = False
    after_comma = False
    cuts: list[int] = []
    k = open_pos + 1
    while k < end:
        ch = text[k]
        if in_string:
            if ch == "\\":
                k += 1
            elif ch == '"':
                in_string = False
        elif after_comma and not ch.isspace():
            cuts.append(k)
            after_comma = False
            continue
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            if depth == 0:
                return cuts or None
            depth -= 1
        elif ch == "," and depth == 0:
            after_comma = True
        k += 1
    return None


# ---------------------------------------------------------------- cutting oversized units


def sub_units(text: str, unit: Unit) -> list[Unit]:
    """The pieces of a unit that is too big: JSON items, then lines/sentences, words, characters.
    Returns [unit] when it cannot be cut finer than it is."""
    a, b = unit.start, unit.end
    if unit.kind is UnitKind.JSON_ITEM:
        items = json_children(text, a, b)
        if items:
            return [Unit(x, y, UnitKind.JSON_ITEM) for x, y in items]
    if unit.kind in (UnitKind.CODE, UnitKind.LINE, UnitKind.TABLE_ROW) or unit.kind is UnitKind.JSON_ITEM:
        lines = _line_spans(text, a, b)
        if len(lines) > 1:
            return [Unit(x, y, UnitKind.SENTENCE) for x, y in lines]
    if unit.kind not in (UnitKind.WORD, UnitKind.CHARS):
        sentences = _sentence_spans(text, a, b)
        if len(sentences) > 1:
            return [Unit(x, y, UnitKind.SENTENCE) for x, y in sentences]
        words = _word_spans(text, a, b)
        if len(words) > 1:
            return [Unit(x, y, UnitKind.WORD) for x, y in words]
    if b - a > 1:
        mid = a + (b - a) // 2
        return [Unit(a, mid, UnitKind.CHARS), Unit(mid, b, UnitKind.CHARS)]
    return [unit]


def _sentence_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    cuts = [m.end() for m in _SENTENCE_END.finditer(text, start, end) if start < m.end() < end]
    bounds = [start, *cuts, end]
    return [(x, y) for x, y in zip(bounds, bounds[1:], strict=False) if y > x]


def _word_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    spans = [(m.start(), m.end()) for m in _WORD.finditer(text, start, end)]
    if len(spans) > 1 and not text[spans[0][0] : spans[0][1]].strip():  # leading space joins the first word
        spans[1] = (spans[0][0], spans[1][1])
        spans.pop(0)
    return spans


# ---------------------------------------------------------------- packing


def split(text: str, max_size: int, size: Size = len, fmt: DocFormat | None = None) -> list[Shard]:
    """Shards of `text`, each of size <= max_size (sizes are summed over units), joined == text."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    fmt = fmt or detect_format(text)
    structure = units_of(text, fmt)
    groups = _pack(text, list(_fitting_units(text, structure, max_size, size)), max_size, size)
    starts = [group[0][0].start for group in groups]
    contexts = _contexts(text, starts, fmt, structure)
    shards: list[Shard] = []
    for k, group in enumerate(groups):
        a, b = group[0][0].start, group[-1][0].end
        shards.append(Shard(k, a, b, text[a:b], contexts[k], sum(s for _, s in group)))
    assert "".join(s.text for s in shards) == text
    return shards


def _fitting_units(text: str, units: list[Unit], max_size: int, size: Size) -> Iterator[tuple[Unit, int]]:
    """Units with their sizes; a unit over max_size is replaced by its sub-units, recursively."""
    for unit in units:
        unit_size = size(text[unit.start : unit.end])
        if unit_size <= max_size:
            yield unit, unit_size
            continue
        pieces = sub_units(text, unit)
        if len(pieces) == 1:  # one character over the limit: nothing finer exists
            logger.warning("a unit of size %d cannot be cut below max_size %d", unit_size, max_size)
            yield unit, unit_size
            continue
        yield from _fitting_units(text, pieces, max_size, size)


def _pack(text: str, units: list[tuple[Unit, int]], max_size: int, size: Size) -> list[list[tuple[Unit, int]]]:
    groups: list[list[tuple[Unit, int]]] = []
    current: list[tuple[Unit, int]] = []
    filled = 0
    for unit, unit_size in units:
        full = filled + unit_size > max_size
        heading_break = unit.kind is UnitKind.HEADING and filled >= 0.6 * max_size
        if current and (full or heading_break):
            carried: list[tuple[Unit, int]] = []
            while len(current) > 1 and current[-1][0].kind is UnitKind.HEADING:
                carried.insert(0, current.pop())  # a heading opens the next shard, never ends one
            groups.append(current)
            current, filled = carried, sum(s for _, s in carried)
            if current and filled + unit_size > max_size:  # the carried heading does not fit with it
                groups.append(current)
                current, filled = [], 0
        current.append((unit, unit_size))
        filled += unit_size
    if current:
        groups.append(current)
    return groups


def _check_cover(units: list[Unit], start: int, end: int) -> None:
    pos = start
    for unit in units:
        assert unit.start == pos and unit.end > unit.start, f"units do not cover the text at {pos}: {unit}"
        pos = unit.end
    assert pos == end, f"units end at {pos}, text at {end}"


# ---------------------------------------------------------------- shard context


def _csv_header(text: str) -> str:
    """The first line when it looks like a CSV header (commas, no digits-only fields)."""
    first = text.split("\n", 1)[0]
    fields = [f.strip() for f in first.split(",")]
    if len(fields) >= 2 and all(f and not _is_number(f) for f in fields):
        return first.strip()
    return ""


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _contexts(text: str, starts: list[int], fmt: DocFormat, units: list[Unit]) -> list[str]:
    """What each shard (by its start) needs from before it: the CSV header, or the path of the
    headings above it (only the levels above its own heading when it opens with one)."""
    if fmt is DocFormat.LINES:
        header = _csv_header(text)
        return ["" if start == 0 else header for start in starts]
    if fmt is not DocFormat.MARKDOWN:
        return ["" for _ in starts]
    headings = [(u.start, text[u.start : u.end].strip()) for u in units if u.kind is UnitKind.HEADING]
    contexts = []
    path: dict[int, str] = {}
    k = 0
    for start in starts:
        while k < len(headings) and headings[k][0] < start:
            level = _heading_level(headings[k][1])
            path = {lv: h for lv, h in path.items() if lv < level}
            path[level] = headings[k][1]
            k += 1
        own = _heading_level(headings[k][1]) if k < len(headings) and headings[k][0] == start else 99
        contexts.append("\n".join(path[lv] for lv in sorted(path) if lv < own))
    return contexts


def _heading_level(line: str) -> int:
    return len(line) - len(line.lstrip("#"))
