"""The instructions of map, extraction and reduce calls, and tolerant parsers of their answers.

The formats are kept trivial for a small model (one line: `ANSWER: ... | EVIDENCE: ...` or
`NOT FOUND`); the parsers accept what small models really write (the answer as a plain sentence,
the evidence missing, extra lines), because every answer is checked against the shard text
afterwards (evidence.py) rather than trusted for following the format.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import NamedTuple

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 500

MAP_INSTRUCTION = (
    "Answer the QUESTION using only the TEXT above. Reply in one line: "
    "ANSWER: <short answer> | EVIDENCE: <the words of the TEXT that give the answer>. "
    "If the TEXT does not contain the answer, reply: NOT FOUND"
)
EXTRACT_INSTRUCTION = (
    "Copy every line or record of the TEXT that matches the QUESTION, one per line, exactly as "
    "written in the TEXT. If no line matches, reply: NONE"
)
REDUCE_INSTRUCTION = (
    "The partial answers above come from different parts of one long document. Using only what "
    "they say, give one answer to the QUESTION."
)

_NOT_FOUND = re.compile(
    r"^\W*(not found|none|n/?a|no answer|not in the text|the text does not (contain|say|mention)\b.*)\W*$",
    re.IGNORECASE,
)
_ANSWER = re.compile(r"\bANSWER\s*:\s*", re.IGNORECASE)
_EVIDENCE = re.compile(r"\|?\s*\bEVIDENCE\s*:\s*", re.IGNORECASE)
_QUOTES = "\"'`“”‘’"


class Partial(NamedTuple):
    """One map call's answer as parsed: found or not, the answer, the quoted evidence."""

    found: bool
    answer: str
    evidence: str


class PartialLine(NamedTuple):
    """A partial answer as the reduce call shows it."""

    label: str  # e.g. "part 3"
    answer: str
    quote: str


def _framed_text(shard_text: str, context: str) -> str:
    head = f"(This part of the document is under:\n{context.strip()})\n\n" if context.strip() else ""
    return f"{head}TEXT:\n{shard_text.strip()}"


def map_prompt(shard_text: str, context: str, question: str) -> str:
    """The user message of a map call: the shard, the question, the one-line answer format."""
    return f"{_framed_text(shard_text, context)}\n\nQUESTION: {question.strip()}\n\n{MAP_INSTRUCTION}"


def extract_prompt(shard_text: str, context: str, question: str) -> str:
    """The user message of an extraction call (aggregations): copy the matching records."""
    return f"{_framed_text(shard_text, context)}\n\nQUESTION: {question.strip()}\n\n{EXTRACT_INSTRUCTION}"


def reduce_prompt(partials: Sequence[PartialLine], question: str) -> str:
    """The user message of a reduce call over partial answers and their evidence."""
    lines = []
    for k, p in enumerate(partials, 1):
        quote = f' | EVIDENCE: "{p.quote.strip()}"' if p.quote.strip() else ""
        lines.append(f"{k}. ({p.label}) ANSWER: {p.answer.strip()}{quote}")
    body = "\n".join(lines)
    return f"PARTIAL ANSWERS:\n{body}\n\nQUESTION: {question.strip()}\n\n{REDUCE_INSTRUCTION}"


def parse_partial(text: str) -> Partial:
    """Parse a map answer: `ANSWER: a | EVIDENCE: e`, `NOT FOUND`, or a plain sentence."""
    text = text.strip()
    if not text:
        return Partial(False, "", "")
    match = _ANSWER.search(text)
    if match is None:
        first = text.splitlines()[0].strip()
        if _NOT_FOUND.match(first) or (re.search(r"\bNOT FOUND\b", text) and len(first) < 40):
            return Partial(False, "", "")
        answer, evidence = _split_evidence(text)
    else:
        answer, evidence = _split_evidence(text[match.end() :])
    answer = answer.strip().strip(_QUOTES).strip()[:MAX_ANSWER_CHARS]
    if not answer or _NOT_FOUND.match(answer.splitlines()[0]):
        return Partial(False, "", "")
    return Partial(True, answer, evidence)


def _split_evidence(text: str) -> tuple[str, str]:
    match = _EVIDENCE.search(text)
    if match is None:
        return text, ""
    evidence = text[match.end() :].strip().splitlines()
    return text[: match.start()], (evidence[0].strip().strip(_QUOTES).strip() if evidence else "")


def parse_items(text: str) -> list[str]:
    """Parse an extraction answer: one item per line; `NONE` (or nothing) is no item."""
    items = []
    for line in text.splitlines():
        item = re.sub(r"^\s*(?:[-*•]|\d{1,4}[.)])\s+", "", line).strip()
        if item and not _NOT_FOUND.match(item):
            items.append(item)
    return items
