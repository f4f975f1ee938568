"""The planner's parts: the request taken apart (task), answer parsing (prompts), checking answers
against their shard (evidence), and exact aggregations (aggregate)."""

from __future__ import annotations

import json

import pytest

from services.gateway.planner import aggregate
from services.gateway.planner.aggregate import AggKind, Criterion, classify, combine, parse_query, records_of
from services.gateway.planner.evidence import content_words, ground, occurrences, values_of
from services.gateway.planner.prompts import (
    Partial,
    PartialLine,
    map_prompt,
    parse_items,
    parse_partial,
    reduce_prompt,
)
from services.gateway.planner.splitter import DocFormat, detect_format
from services.gateway.planner.task import (
    Message,
    NotSplittable,
    split_question,
    task_from_messages,
    task_from_text,
    upper_bound_tokens,
)

DOC = "Para one.\n\n" + "Body sentence. " * 50 + "\n\nMore body.\n\n"

# ---------------------------------------------------------------- task


def test_question_is_the_trailing_paragraph_and_a_short_preamble_joins_it() -> None:
    document, question = split_question(DOC + "What is the pass key?")
    assert question == "Para one.\n\nWhat is the pass key?"
    assert task_from_text(DOC + "What is the pass key?").ask == "What is the pass key?"
    assert document.startswith("Body sentence.") and document.rstrip().endswith("More body.")
    document, question = split_question("Body sentence. " * 50 + "\n\nWhat is it?")
    assert question == "What is it?" and document.startswith("Body sentence.")


def test_question_first_when_the_tail_is_long() -> None:
    document, question = split_question("What is the pass key?\n\n" + "Long text. " * 200)
    assert question == "What is the pass key?" and document.startswith("Long text.")
    with pytest.raises(NotSplittable, match="own paragraph"):
        split_question("one paragraph only " * 10)
    with pytest.raises(NotSplittable, match="neither"):
        split_question("x" * 2000 + "\n\n" + "y" * 2000)


def test_task_from_messages() -> None:
    system = Message("system", "Be brief.")
    doc = Message("user", "Here is the report.\n\n" + "Revenue grew. " * 100)
    question = Message("user", "What grew?")
    task = task_from_messages([system, doc, Message("assistant", "Noted."), question])
    assert task.question == "What grew?" and task.document == doc.content
    assert task.frame == (system, Message("assistant", "Noted."))
    task = task_from_messages([system, Message("user", DOC + "What is the key?")])
    assert task.frame == (system,) and task.question.endswith("What is the key?")
    with pytest.raises(NotSplittable, match="no user message"):
        task_from_messages([Message("system", "x" * 100)])
    assert task_from_text(DOC + "Q?").question.endswith("Q?")


def test_upper_bound_is_above_the_bytes() -> None:
    messages = [Message("user", "héllo wörld")]
    assert upper_bound_tokens(messages) >= len("héllo wörld".encode()) + 256


# ---------------------------------------------------------------- prompts


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ANSWER: 48213 | EVIDENCE: The pass key is 48213.", Partial(True, "48213", "The pass key is 48213.")),
        ("answer: Paris\nevidence: 'The capital is Paris'", Partial(True, "Paris", "The capital is Paris")),
        ("NOT FOUND", Partial(False, "", "")),
        ("Not found.", Partial(False, "", "")),
        ("ANSWER: NOT FOUND", Partial(False, "", "")),
        ("", Partial(False, "", "")),
        ("The pass key is 48213. Remember it.", Partial(True, "The pass key is 48213. Remember it.", "")),
    ],
)
def test_parse_partial_is_tolerant(text: str, expected: Partial) -> None:
    assert parse_partial(text) == expected


def test_prompts_and_items() -> None:
    prompt = map_prompt("  some text  ", "# Title", "What?")
    assert prompt.startswith("(This part of the document is under:\n# Title)\n\nTEXT:\nsome text\n\nQUESTION: What?")
    assert "NOT FOUND" in prompt
    reduce = reduce_prompt([PartialLine("part 2", "a", "quote a"), PartialLine("part 5", "b", "")], "Q?")
    assert '1. (part 2) ANSWER: a | EVIDENCE: "quote a"\n2. (part 5) ANSWER: b\n' in reduce
    assert parse_items("- line one\n2. line two\n\nNONE\n  line three ") == ["line one", "line two", "line three"]
    assert parse_items("NONE") == []


# ---------------------------------------------------------------- evidence

SHARD = "The grass is green. The sky is blue. The pass key is 48213. Remember it. The sun is yellow."


def test_values_and_occurrences() -> None:
    assert values_of("The key is 48213, not A-17 or 3.5.") == ["48213", "A-17", "3.5"]
    assert occurrences("48213", "x 48213. y 482130 z-48213") == [2]
    assert content_words("What is the pass keys?") == {"pass", "key"}


def test_a_value_in_the_shard_near_the_question_is_grounded() -> None:
    g = ground(Partial(True, "The pass key is 48213. There and back.", ""), SHARD, "What is the pass key?")
    assert (g.grounded, g.kind, g.key, g.answer) == (True, "value", "48213", "The pass key is 48213.")
    assert g.quote == "The pass key is 48213."


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("The pass key is 77777.", "value '77777' is not in the shard"),
        ("The pass key is a password used to access a computer.", "only 0% of the answer's words are in the shard"),
        ("The pass key is the pass key.", "the answer only repeats the question"),
    ],
)
def test_answers_the_shard_does_not_bear_out_are_dropped(answer: str, reason: str) -> None:
    g = ground(Partial(True, answer, ""), SHARD, "What is the pass key?")
    assert not g.grounded and g.reason == reason


def test_a_value_far_from_the_question_words_is_dropped() -> None:
    shard = "Order 4411 shipped. " + "Filler text here. " * 40 + "The pass key is unknown."
    g = ground(Partial(True, "4411", ""), shard, "What is the pass key?")
    assert not g.grounded and "not near" in g.reason


def test_free_text_needs_its_words_in_the_shard() -> None:
    shard = "The meeting moved to Tuesday because the room was booked."
    g = ground(Partial(True, "It moved to Tuesday.", "the room was booked"), shard, "When is the meeting?")
    assert (g.grounded, g.kind, g.quote) == (True, "text", "the room was booked")


# ---------------------------------------------------------------- aggregate

LOG = "".join(
    f"2026-03-{i % 28 + 1:02d} job={100 + i} user={['ann', 'bob', 'cy'][i % 3]} "
    f"status={'FAILED' if i % 5 == 2 else 'OK'} bytes={10 * i}\n"
    for i in range(40)
)


@pytest.mark.parametrize(
    ("question", "kind"),
    [
        ("How many jobs failed?", AggKind.COUNT),
        ("What is the total number of rows?", AggKind.COUNT),
        ("What is the total of bytes?", AggKind.SUM),
        ("Which job had the largest bytes?", AggKind.MAX),
        ("What is the smallest amount?", AggKind.MIN),
        ("List all users.", AggKind.LIST),
        ("What is the pass key?", None),
    ],
)
def test_classify(question: str, kind: AggKind | None) -> None:
    assert classify(question) == kind


def test_literal_queries_over_a_log() -> None:
    records = records_of(LOG, detect_format(LOG))
    assert len(records) == 40 and records[2].fields == {"job": "102", "user": "cy", "status": "FAILED", "bytes": "20"}
    failed = [r for r in records if "FAILED" in r.text]
    q = parse_query("How many jobs failed?", records)
    assert q == aggregate.AggQuery(AggKind.COUNT, (Criterion("status=FAILED", "status", "FAILED"),), "", True)
    assert combine(q, aggregate.literal_map(records, q)).text == "8 records matching status=FAILED."
    q = parse_query("What is the total bytes of jobs with status=FAILED?", records)
    assert q is not None and (q.kind, q.field, q.literal) == (AggKind.SUM, "bytes", True)
    assert combine(q, aggregate.literal_map(records, q)).value == str(sum(int(r.fields["bytes"]) for r in failed))
    q = parse_query("What is the maximum bytes for user bob?", records)
    assert q is not None and combine(q, aggregate.literal_map(records, q)).value == "370"
    q = parse_query("List the users of FAILED jobs.", records)
    users = ", ".join(r.fields["user"] for r in failed)
    assert q is not None and combine(q, aggregate.literal_map(records, q)).value == users


@pytest.mark.parametrize(
    ("question", "reason"),
    [
        ("How many jobs did not fail?", "negates or compares"),
        ("How many jobs were slow?", "'slow'"),
        ("How many jobs moved more than 100 bytes?", "negates or compares"),
    ],
)
def test_semantic_criteria_are_not_literal(question: str, reason: str) -> None:
    q = parse_query(question, records_of(LOG, DocFormat.LINES))
    assert q is not None and not q.literal and reason in q.reason


def test_csv_and_json_records() -> None:
    csv_doc = "name,city,amount\n" + "".join(f"n{i},{['Paris', 'Oslo'][i % 2]},{i}\n" for i in range(10))
    records = records_of(csv_doc, detect_format(csv_doc))
    q = parse_query("What is the sum of amount for Oslo?", records)
    assert q is not None and combine(q, aggregate.literal_map(records, q)).value == str(1 + 3 + 5 + 7 + 9)
    items = [{"id": i, "kind": "ab"[i % 2], "price": i * 1.5} for i in range(9)]
    json_doc = json.dumps({"title": "prices", "items": items}, indent=1)
    records = records_of(json_doc, detect_format(json_doc))
    assert [r.fields["id"] for r in records] == [str(i) for i in range(9)]
    q = parse_query("What is the total price of items with kind=b?", records)
    assert q is not None and combine(q, aggregate.literal_map(records, q)).value == "24"


def test_extracted_items_must_be_records_of_the_shard() -> None:
    records = records_of(LOG, DocFormat.LINES)
    items = [
        records[3].text.strip(),
        "job=107 user=bob status=FAILED",
        "2026-03-01 job=999 invented line",
        records[3].text,
    ]
    found, dropped = aggregate.match_items(items, records)
    assert found == [records[3], records[7]] and dropped == 1


def test_a_missing_field_is_an_error_with_the_numbers() -> None:
    records = records_of(LOG + "2026-03-02 job=500 user=ann status=FAILED\n", DocFormat.LINES)
    q = parse_query("What is the total bytes of FAILED jobs?", records)
    assert q is not None
    with pytest.raises(aggregate.FieldMissing, match="1 of the 9 matching records have no numeric 'bytes'"):
        combine(q, aggregate.literal_map(records, q))
