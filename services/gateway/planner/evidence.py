"""Checking a shard's answer against the shard's own text: what keeps silent wrong answers out.

An answer is **grounded** in its shard when
- it carries values (tokens with a digit: pass keys, ids, amounts): every value occurs verbatim
  in the shard as a whole token, with a word of the question within `NEAR_CHARS` of it;
- otherwise (free text): most of its own words (those not taken from the question) occur in the
  shard, and the shard holds a word of the question. Free-text answers stay flagged unverified.
An answer that only repeats the question, or whose values are not in the shard, is dropped.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

from services.gateway.planner.prompts import Partial

logger = logging.getLogger(__name__)

NEAR_CHARS = 300
MIN_TEXT_COVERAGE = 0.6
MAX_QUOTE_CHARS = 300

STOPWORDS = frozenset(
    """a an the and or but if then than that this these those there here of in on at to for from by with
    as is are was were be been being am do does did done have has had having it its it's he she they them
    their his her we us our you your i me my what which who whom whose when where why how whether can
    could should would will shall may might must not no yes so such very just also only into onto out up
    down over under about above below again further once all any both each few more most other some own
    same too s t don now tell give say says said please answer question text document find according""".split()
)
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
_VALUE = re.compile(r"(?<![\w-])[\w][\w.,:/-]*\d[\w.,:/-]*|(?<![\w-])\d[\w.,:/-]*")
_SENTENCE = re.compile(r"[^.!?\n]*[.!?]?")


class Grounding(NamedTuple):
    """The verdict on one partial answer."""

    grounded: bool
    kind: str  # "value" or "text" when grounded
    key: str  # grounded answers with equal keys say the same thing
    answer: str  # the answer cut to its first sentence that carries it
    quote: str  # the shard's sentence that carries it
    reason: str  # why it was dropped (empty when grounded)


def _stem(word: str) -> str:
    word = word.lower().strip("'-")
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def content_words(text: str) -> set[str]:
    """Lower-cased, crudely singular words of 3+ letters that are not stopwords."""
    return {_stem(w) for w in _WORD.findall(text) if len(w) >= 3 and w.lower() not in STOPWORDS}


def values_of(text: str) -> list[str]:
    """Tokens that carry a digit (numbers, ids, codes), trailing punctuation removed, in order."""
    found: list[str] = []
    for match in _VALUE.finditer(text):
        value = match.group(0).rstrip(".,:/-")
        if value and value not in found:
            found.append(value)
    return found


def occurrences(value: str, text: str) -> list[int]:
    """Start positions of `value` in `text` as a whole token (not inside a longer word or number)."""
    pattern = re.compile(rf"(?<![\w-]){re.escape(value)}(?![\w]|[.,:/-]\w)")
    return [m.start() for m in pattern.finditer(text)]


def sentence_at(text: str, pos: int) -> str:
    """The sentence (or line) of `text` around position `pos`, at most MAX_QUOTE_CHARS long."""
    start = max(text.rfind(c, 0, pos) for c in ".!?\n") + 1
    ends = [k for k in (text.find(c, pos) for c in ".!?\n") if k >= 0]
    end = min(ends) + 1 if ends else len(text)
    sentence = " ".join(text[start:end].split())
    if len(sentence) > MAX_QUOTE_CHARS:
        offset = pos - start
        lo = max(0, offset - MAX_QUOTE_CHARS // 2)
        sentence = " ".join(text[start + lo : start + lo + MAX_QUOTE_CHARS].split())
    return sentence


def _has_question_word_near(shard: str, pos: int, question_words: set[str]) -> bool:
    if not question_words:
        return True
    window = shard[max(0, pos - NEAR_CHARS) : pos + NEAR_CHARS]
    return bool(content_words(window) & question_words)


def _first_sentence_with(answer: str, value: str) -> str:
    for match in _SENTENCE.finditer(answer):
        if value in match.group(0):
            return " ".join(match.group(0).split())
    return " ".join(answer.split())


def ground(partial: Partial, shard: str, question: str) -> Grounding:
    """Check one partial answer against its shard (see the module docstring for the rules)."""
    if not partial.found:
        return Grounding(False, "", "", "", "", "not found")
    question_words = content_words(question)
    question_values = set(values_of(question))
    values = [v for v in values_of(partial.answer) if v not in question_values]
    if values:
        return _ground_values(partial, shard, values, question_words)
    return _ground_text(partial, shard, question_words)


def _ground_values(partial: Partial, shard: str, values: list[str], question_words: set[str]) -> Grounding:
    for value in values:
        positions = occurrences(value, shard)
        if not positions:
            return Grounding(False, "", "", "", "", f"value {value!r} is not in the shard")
        near = [p for p in positions if _has_question_word_near(shard, p, question_words)]
        if not near:
            return Grounding(False, "", "", "", "", f"value {value!r} is not near the question's words")
    near = [p for p in occurrences(values[0], shard) if _has_question_word_near(shard, p, question_words)]
    answer = _first_sentence_with(partial.answer, values[0])
    key = " ".join(sorted(values))
    return Grounding(True, "value", key, answer, sentence_at(shard, near[0]), "")


def _ground_text(partial: Partial, shard: str, question_words: set[str]) -> Grounding:
    answer = _first_sentence(partial.answer)
    own_words = content_words(answer) - question_words
    if not own_words:
        return Grounding(False, "", "", "", "", "the answer only repeats the question")
    shard_words = content_words(shard)
    coverage = len(own_words & shard_words) / len(own_words)
    if coverage < MIN_TEXT_COVERAGE:
        return Grounding(False, "", "", "", "", f"only {coverage:.0%} of the answer's words are in the shard")
    if question_words and not question_words & shard_words:
        return Grounding(False, "", "", "", "", "the shard has none of the question's words")
    quote = _verbatim(partial.evidence, shard) or _best_sentence(shard, own_words)
    key = " ".join(sorted(own_words))
    return Grounding(True, "text", key, answer, quote, "")


def _first_sentence(text: str) -> str:
    for match in _SENTENCE.finditer(text):
        if match.group(0).strip():
            return " ".join(match.group(0).split())
    return ""


def _verbatim(evidence: str, shard: str) -> str:
    """The evidence when it is in the shard word for word (whitespace and case aside), else ""."""
    words = evidence.split()
    if len(words) < 3:
        return ""
    flat = " ".join(shard.split()).lower()
    quote = " ".join(words)
    return quote[:MAX_QUOTE_CHARS] if quote.lower() in flat else ""


def _best_sentence(shard: str, words: set[str]) -> str:
    best, best_score = "", 0
    for match in _SENTENCE.finditer(shard):
        score = len(content_words(match.group(0)) & words)
        if score > best_score:
            best, best_score = match.group(0), score
    return " ".join(best.split())[:MAX_QUOTE_CHARS]
