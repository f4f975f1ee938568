"""Aggregations over records (count, sum, list, min, max), combined exactly in code.

Records are the document's CSV/log lines, the items of its main JSON array, or its markdown list
items and table rows, each with the fields it carries (CSV columns, JSON keys, `key=value` pairs).
A question is an aggregation when it asks how many / the sum or total / the min or max / to list.

Its criteria are **literal** when every word of the question is accounted for by the records:
`key=value` pairs, quoted strings, field names, values some record carries (`failed` ~
`status=FAILED`), or words most records share. Then the per-shard map is done here, exactly, and
the answer names the criteria it applied. When a word is left over (`slow`, `recent`) or the
question negates or compares (`not`, `more than`), the criteria are semantic: the model extracts
the matching records per shard (map), the records it returns are checked against the shard, and
the combination is still done here; such answers are flagged, since the model may miss records.
"""

from __future__ import annotations

import csv
import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from services.gateway.planner.evidence import STOPWORDS
from services.gateway.planner.splitter import DocFormat, UnitKind, json_children, units_of

logger = logging.getLogger(__name__)

MAX_LISTED = 200
_COUNT = re.compile(r"\bhow many\b|\bnumber of\b|\bcount\b", re.IGNORECASE)
_SUM = re.compile(r"\b(sum|total)\b", re.IGNORECASE)
_MAX = re.compile(r"\b(maximum|max|highest|largest|biggest|greatest)\b", re.IGNORECASE)
_MIN = re.compile(r"\b(minimum|min|lowest|smallest)\b", re.IGNORECASE)
_LIST = re.compile(r"^\W*(list|enumerate)\b|\b(list all|list every|name all|name every)\b", re.IGNORECASE)
_SEMANTIC = re.compile(
    r"\b(not|no|without|except|other than|more than|less than|fewer than|greater than|at least|at most|"
    r"between|unless|neither|nor)\b|n't\b|[<>]|\b(over|under|above|below|after|before|since|until)\s+[$\d]",
    re.IGNORECASE,
)
_HOW_MANY = re.compile(r"\bhow many\s+([A-Za-z_][\w.-]*)", re.IGNORECASE)
_KEY_VALUE = re.compile(r"([A-Za-z_][\w.-]*)\s*(?:=|:|==)\s*([\"'`]?)([^\s\"'`,;?]+)\2")
_QUOTED = re.compile(r"\"([^\"]+)\"|'([^']{2,})'|`([^`]+)`|“([^”]+)”")
_FIELD_PAIR = re.compile(r"(?<![\w.-])([A-Za-z_][\w.-]*)=(\"[^\"]*\"|'[^']*'|[^\s,;]+)")
_QUESTION_WORD = re.compile(r"[\w][\w.@/+-]*")
GENERIC = frozenset(
    """record records line lines row rows entry entries item items element elements event events log logs
    file data document text there many much number count sum total list all every value values field
    fields column columns maximum max minimum min highest lowest largest smallest biggest greatest
    contain contains containing mention mentions mentioned appear appears occur occurs show shows have
    has had with were was are is run ran recorded logged listed found exist exists name names enumerate
    in""".split()
)


class AggKind(str, Enum):
    COUNT = "count"
    SUM = "sum"
    LIST = "list"
    MIN = "min"
    MAX = "max"


class Record(NamedTuple):
    """One record: document[start:end], with its fields (names as written, values as text)."""

    start: int
    end: int
    text: str
    fields: dict[str, str]


class Criterion(NamedTuple):
    """A record matches when its `key` field equals `value` (case aside), or, without a key, when
    its text holds `value` (as a whole word, or as a substring when quoted)."""

    label: str  # how the answer names it: status=FAILED, "disk full", ERROR
    key: str
    value: str
    substring: bool = False


@dataclass(frozen=True)
class AggQuery:
    kind: AggKind
    criteria: tuple[Criterion, ...]  # all must match; () selects every record
    field: str  # the field to sum / compare / list; "" = the records themselves
    literal: bool  # criteria are exact text: the map is done in code
    reason: str = ""  # why it is not literal


class AggResult(NamedTuple):
    """The exact combination over the matching records of every shard."""

    kind: AggKind
    value: str  # the number, or the listed items joined
    num_records: int
    text: str  # the answer as the client reads it


def classify(question: str) -> AggKind | None:
    """The aggregation a question asks for, or None (a lookup)."""
    if _COUNT.search(question):
        return AggKind.COUNT
    if _MAX.search(question):
        return AggKind.MAX
    if _MIN.search(question):
        return AggKind.MIN
    if _SUM.search(question):
        return AggKind.SUM
    if _LIST.search(question):
        return AggKind.LIST
    return None


# ---------------------------------------------------------------- records


def records_of(document: str, fmt: DocFormat) -> list[Record]:
    """The document's records (empty when it has no record structure)."""
    if fmt is DocFormat.JSON:
        return _json_records(document)
    if fmt is DocFormat.LINES:
        return _line_records(document)
    return _markdown_records(document)


def _line_records(document: str) -> list[Record]:
    units = [u for u in units_of(document, DocFormat.LINES) if document[u.start : u.end].strip()]
    header = _csv_columns(document[units[0].start : units[0].end]) if units else []
    if header:
        units = units[1:]
    records = []
    for u in units:
        text = document[u.start : u.end]
        fields = _pairs(text)
        if header:
            row = next(csv.reader([text.strip()]), [])
            if len(row) == len(header):
                fields = {**fields, **dict(zip(header, (v.strip() for v in row), strict=True))}
        records.append(Record(u.start, u.end, text, fields))
    return records


def _csv_columns(line: str) -> list[str]:
    row = next(csv.reader([line.strip()]), [])
    if len(row) < 2 or any(not c.strip() or _number(c) is not None for c in row):
        return []
    return [c.strip() for c in row]


def _pairs(text: str) -> dict[str, str]:
    return {k: v.strip("\"'") for k, v in _FIELD_PAIR.findall(text)}


def _json_records(document: str) -> list[Record]:
    spans = json_children(document, 0, len(document)) or []
    while spans:  # descend into the biggest item while it holds more items than this level
        a, b = max(spans, key=lambda s: s[1] - s[0])
        inner = json_children(document, a, b)
        if not inner or len(inner) <= len(spans):
            break
        spans = inner  # the other items at this level (a count, a title) are not records
    records = []
    for a, b in spans:
        value = _json_value_in(document, a, b)
        if value is None:
            continue
        records.append(Record(a, b, document[a:b], _flatten(value)))
    return records


def _json_value_in(document: str, start: int, end: int) -> object | None:
    decoder = json.JSONDecoder()
    for k in range(start, end):
        if document[k] in '{["-0123456789tfn':
            try:
                value, stop = decoder.raw_decode(document, k)
            except ValueError:
                continue
            rest = document[stop:end].lstrip()
            if stop <= end and not rest.startswith(":"):  # a "key": is not the record
                return value
    return None


def _flatten(value: object, prefix: str = "") -> dict[str, str]:
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
        return out
    if isinstance(value, list):
        return {prefix or "value": ", ".join(str(v) for v in value)}
    return {prefix or "value": "" if value is None else str(value)}


def _markdown_records(document: str) -> list[Record]:
    records = []
    columns: list[str] = []
    for u in units_of(document, DocFormat.MARKDOWN):
        text = document[u.start : u.end]
        if u.kind is UnitKind.TABLE_ROW:
            cells = [c.strip() for c in text.strip().strip("|").split("|")]
            if all(re.fullmatch(r":?-{2,}:?", c) for c in cells if c):
                continue
            if not columns:
                columns = cells
                continue
            fields = dict(zip(columns, cells, strict=False)) if len(cells) == len(columns) else {}
            records.append(Record(u.start, u.end, text, {**_pairs(text), **fields}))
        elif u.kind is UnitKind.LIST_ITEM:
            records.append(Record(u.start, u.end, text, _pairs(text)))
    return records if len(records) >= 2 else []


# ---------------------------------------------------------------- question -> query


def parse_query(question: str, records: Sequence[Record]) -> AggQuery | None:
    """The aggregation query of a question over these records; None when it is not one."""
    kind = classify(question)
    if kind is None or len(records) < 2:
        return None
    fields = _field_names(records)
    criteria: list[Criterion] = []
    field_words: list[tuple[int, str]] = []  # (position in the question, field name)
    leftover: list[str] = []
    taken = _explicit_criteria(question, fields, criteria)
    for match in _QUESTION_WORD.finditer(question):
        if any(a <= match.start() < b for a, b in taken):
            continue
        word = match.group(0).rstrip(".-/")
        low = word.lower()
        if len(word) < 2 or low in STOPWORDS:
            continue
        name = _field_name(low, fields)
        if name is not None:
            field_words.append((match.start(), name))
        elif low in GENERIC or _stem(low) in GENERIC:
            continue
        elif (crit := _value_criterion(word, records)) is not None:
            criteria.append(crit)
        elif (crit := _word_criterion(word, records)) is not None:
            if crit.value:
                criteria.append(crit)
        else:
            leftover.append(word)
    field = "" if kind is AggKind.COUNT else _field_asked(question, kind, field_words, {c.key for c in criteria})
    how_many = _HOW_MANY.search(question)
    measured = fields.get(how_many.group(1).lower(), "") if how_many else ""
    if kind is AggKind.COUNT and measured in _numeric_fields(records):  # "how many bytes ..." is a sum
        kind, field = AggKind.SUM, measured
    if kind in (AggKind.SUM, AggKind.MIN, AggKind.MAX) and not field:
        field = _only_numeric_field(records)
    reason = ""
    if _SEMANTIC.search(question):
        reason = f"the question negates or compares ({_SEMANTIC.search(question).group(0)!r})"  # type: ignore[union-attr]
    elif leftover:
        reason = f"no record field or text accounts for {', '.join(repr(w) for w in leftover)}"
    elif kind in (AggKind.SUM, AggKind.MIN, AggKind.MAX) and not field:
        reason = "the question names no numeric field and the records have several"
    return AggQuery(kind, tuple(dict.fromkeys(criteria)), field, not reason, reason)


def _field_asked(question: str, kind: AggKind, field_words: list[tuple[int, str]], keys: set[str]) -> str:
    """The field named first after the aggregation's own word ("total bytes of jobs": bytes), else
    the last one before it; never a field a criterion already uses."""
    pattern = {AggKind.SUM: _SUM, AggKind.MAX: _MAX, AggKind.MIN: _MIN, AggKind.LIST: _LIST}[kind]
    keyword = pattern.search(question)
    at = keyword.start() if keyword else 0
    candidates = [(pos, name) for pos, name in field_words if name not in keys]
    after = [name for pos, name in candidates if pos >= at]
    before = [name for pos, name in candidates if pos < at]
    return after[0] if after else (before[-1] if before else "")


def _stem(word: str) -> str:
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _field_names(records: Sequence[Record]) -> dict[str, str]:
    names: dict[str, str] = {}
    for r in records:
        for name in r.fields:
            names.setdefault(name.lower(), name)
    return names


def _field_name(low: str, fields: dict[str, str]) -> str | None:
    for candidate in (low, _stem(low), low.rstrip("s"), low + "s"):
        if candidate in fields:
            return fields[candidate]
    return None


def _explicit_criteria(question: str, fields: dict[str, str], out: list[Criterion]) -> list[tuple[int, int]]:
    """key=value pairs and quoted strings of the question; returns the spans they used."""
    taken: list[tuple[int, int]] = []
    for m in _KEY_VALUE.finditer(question):
        key, value = m.group(1), m.group(3)
        name = fields.get(key.lower())
        if name is None:
            continue
        out.append(Criterion(f"{name}={value}", name, value))
        taken.append(m.span())
    for m in _QUOTED.finditer(question):
        if any(a <= m.start() < b for a, b in taken):
            continue
        text = next(g for g in m.groups() if g)
        out.append(Criterion(f'"{text}"', "", text, substring=True))
        taken.append(m.span())
    return taken


def _value_criterion(word: str, records: Sequence[Record]) -> Criterion | None:
    """`word` as the value of one field (the field where it occurs most), or None."""
    low = word.lower()
    counts: dict[str, int] = {}
    for r in records:
        for name, value in r.fields.items():
            if value.lower() in (low, _stem(low)) or _stem(value.lower()) == _stem(low):
                counts[name] = counts.get(name, 0) + 1
    if not counts:
        return None
    name = max(counts, key=lambda n: counts[n])
    value = next(r.fields[name] for r in records if name in r.fields and _stem(r.fields[name].lower()) == _stem(low))
    return Criterion(f"{name}={value}", name, value)


def _word_criterion(word: str, records: Sequence[Record]) -> Criterion | None:
    """`word` as text of the records: None when no record has it; a criterion without value when
    most records have it (it selects nothing); else a whole-word criterion."""
    pattern = _word_pattern(word)
    hits = sum(1 for r in records if pattern.search(r.text))
    if hits == 0:
        return None
    if hits >= 0.8 * len(records):
        return Criterion(word, "", "")
    return Criterion(word, "", word)


def _word_pattern(word: str) -> re.Pattern[str]:
    flags = 0 if word.isupper() or any(c.isdigit() for c in word) else re.IGNORECASE
    return re.compile(rf"(?<![\w-]){re.escape(word)}(?![\w-])", flags)


def _numeric_fields(records: Sequence[Record]) -> list[str]:
    return [
        name
        for name in _field_names(records).values()
        if sum(1 for r in records if _number(r.fields.get(name, "")) is not None) >= 0.9 * len(records)
    ]


def _only_numeric_field(records: Sequence[Record]) -> str:
    numeric = _numeric_fields(records)
    return numeric[0] if len(numeric) == 1 else ""


# ---------------------------------------------------------------- map and reduce


def matches(record: Record, criteria: Iterable[Criterion]) -> bool:
    """Whether the record meets every criterion."""
    for c in criteria:
        if c.key:
            value = record.fields.get(c.key)
            if value is None or value.strip().lower() != c.value.lower():
                return False
        elif c.substring:
            if c.value not in record.text:
                return False
        elif not _word_pattern(c.value).search(record.text):
            return False
    return True


def literal_map(records: Sequence[Record], query: AggQuery) -> list[Record]:
    """The matching records (the map of one shard's records, done in code)."""
    return [r for r in records if matches(r, query.criteria)]


def match_items(items: Sequence[str], records: Sequence[Record]) -> tuple[list[Record], int]:
    """Records of a shard that the model's extracted items point to (an item equal to a record,
    whitespace aside, or a piece of 12+ characters of exactly one record); and how many items
    pointed to no record (dropped)."""
    flat = [" ".join(r.text.split()) for r in records]
    found: dict[int, Record] = {}
    dropped = 0
    for item in items:
        item_flat = " ".join(item.split())
        exact = [k for k, f in enumerate(flat) if f == item_flat]
        inside = [k for k, f in enumerate(flat) if len(item_flat) >= 12 and item_flat in f]
        hits = exact or inside
        if len(hits) == 1:
            found.setdefault(hits[0], records[hits[0]])
        else:
            dropped += 1
    return [found[k] for k in sorted(found)], dropped


class FieldMissing(ValueError):
    """Matching records lack the numeric field the aggregation needs; the message has the numbers."""


def combine(query: AggQuery, matched: Sequence[Record]) -> AggResult:
    """The exact count / sum / min / max / list over the matching records of all shards."""
    where = describe(query)
    n = len(matched)
    if query.kind is AggKind.COUNT:
        return AggResult(query.kind, str(n), n, f"{n} {_records(n)}{where}.")
    if query.kind is AggKind.LIST:
        items = [r.fields.get(query.field, "") if query.field else " ".join(r.text.split()) for r in matched]
        shown = items[:MAX_LISTED]
        more = f"\n(and {n - len(shown)} more)" if n > len(shown) else ""
        what = f"{query.field} values of the " if query.field else ""
        body = "\n".join(f"- {item}" for item in shown)
        return AggResult(query.kind, ", ".join(items), n, f"The {what}{n} {_records(n)}{where}:\n{body}{more}")
    values = [_number(r.fields.get(query.field, "")) for r in matched]
    missing = sum(1 for v in values if v is None)
    if missing:
        raise FieldMissing(f"{missing} of the {n} matching records have no numeric {query.field!r}")
    numbers = [v for v in values if v is not None]
    if not numbers:
        return AggResult(query.kind, "", 0, f"No record{where}, so there is no {query.kind.value} of {query.field}.")
    if query.kind is AggKind.SUM:
        total = _show(sum(numbers))
        return AggResult(
            query.kind, total, n, f"The sum of {query.field} over the {n} {_records(n)}{where} is {total}."
        )
    best = max(numbers) if query.kind is AggKind.MAX else min(numbers)
    record = matched[numbers.index(best)]
    word = "maximum" if query.kind is AggKind.MAX else "minimum"
    text = (
        f"The {word} {query.field} over the {n} {_records(n)}{where} is {_show(best)} "
        f"(record: {' '.join(record.text.split())})."
    )
    return AggResult(query.kind, _show(best), n, text)


def describe(query: AggQuery) -> str:
    """' matching status=FAILED and "disk"', or '' when every record counts; for a query that is not
    literal, what the model was asked (its extraction chose the records)."""
    if not query.literal:
        return " that the model found to match the question"
    labels = [c.label for c in query.criteria if c.value]
    return f" matching {' and '.join(labels)}" if labels else ""


def _records(n: int) -> str:
    return "record" if n == 1 else "records"


def _number(text: str) -> float | None:
    cleaned = text.strip().strip("$€£%").replace(",", "").replace("_", "")
    try:
        return float(cleaned)
    except ValueError:
        return None


def _show(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"
