"""The structural splitter on real-looking documents: markdown with code, JSON, CSV, logs, long prose.

Every test checks the three promises: joined shards == the input (nothing lost or duplicated),
every shard within size, and a cut inside a unit only where that unit alone is over the size.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from services.gateway.planner.splitter import (
    DocFormat,
    Shard,
    Size,
    UnitKind,
    detect_format,
    json_children,
    split,
    units_of,
)

MARKDOWN = """# Deployment guide

This guide explains how to deploy the service. It covers the build, the configuration
and the checks to run afterwards.

## Build

Run the build from the repository root:

```bash
make build

# the image is tagged with the commit
docker tag kvmem:latest kvmem:$(git rev-parse --short HEAD)
```

The build takes about two minutes on a laptop.

## Configuration

- `KVMEM_PORT`: the port the gateway listens on.
  Defaults to 8000.
- `KVMEM_POOL`: the device pool in tokens.
- `KVMEM_REDIS_URL`: where the catalog lives.

| variable | default |
|---|---|
| KVMEM_PORT | 8000 |
| KVMEM_POOL | 4096 |

## Checks

After the deployment, call `/health` and expect a 200. Then send one chat request and check
that the answer comes back within a second. If it does not, read the engine's log first.
"""


def check_shards(text: str, shards: list[Shard], max_size: int, size: Size = len) -> None:
    assert "".join(s.text for s in shards) == text
    assert [s.index for s in shards] == list(range(len(shards)))
    for s in shards:
        assert text[s.start : s.end] == s.text and s.text
        assert s.size <= max_size, (s.index, s.size, max_size)
    units = units_of(text)
    starts = {u.start for u in units}
    for s in shards[1:]:
        if s.start in starts:
            continue
        (unit,) = [u for u in units if u.start < s.start < u.end]
        assert size(text[unit.start : unit.end]) > max_size, f"unit {unit} cut needlessly at {s.start}"


def test_markdown_units_follow_the_structure() -> None:
    kinds = [(u.kind, MARKDOWN[u.start : u.end].split("\n")[0]) for u in units_of(MARKDOWN)]
    assert kinds == [
        (UnitKind.HEADING, "# Deployment guide"),
        (UnitKind.PARAGRAPH, "This guide explains how to deploy the service. It covers the build, the configuration"),
        (UnitKind.HEADING, "## Build"),
        (UnitKind.PARAGRAPH, "Run the build from the repository root:"),
        (UnitKind.CODE, "```bash"),
        (UnitKind.PARAGRAPH, "The build takes about two minutes on a laptop."),
        (UnitKind.HEADING, "## Configuration"),
        (UnitKind.LIST_ITEM, "- `KVMEM_PORT`: the port the gateway listens on."),
        (UnitKind.LIST_ITEM, "- `KVMEM_POOL`: the device pool in tokens."),
        (UnitKind.LIST_ITEM, "- `KVMEM_REDIS_URL`: where the catalog lives."),
        (UnitKind.TABLE_ROW, "| variable | default |"),
        (UnitKind.TABLE_ROW, "|---|---|"),
        (UnitKind.TABLE_ROW, "| KVMEM_PORT | 8000 |"),
        (UnitKind.TABLE_ROW, "| KVMEM_POOL | 4096 |"),
        (UnitKind.HEADING, "## Checks"),
        (
            UnitKind.PARAGRAPH,
            "After the deployment, call `/health` and expect a 200. Then send one chat request and check",
        ),
    ]
    code = next(u for u in units_of(MARKDOWN) if u.kind is UnitKind.CODE)
    assert MARKDOWN[code.start : code.end].rstrip().endswith("```")  # the blank line inside stays in the block


@pytest.mark.parametrize("max_size", [120, 200, 300, 700, 5000])
def test_markdown_with_code_keeps_blocks_whole(max_size: int) -> None:
    shards = split(MARKDOWN, max_size)
    check_shards(MARKDOWN, shards, max_size)
    code = next(u for u in units_of(MARKDOWN) if u.kind is UnitKind.CODE)
    if code.end - code.start <= max_size:  # the fenced block fits: it is in one shard
        assert any(s.start <= code.start and code.end <= s.end for s in shards)
    for s in shards[:-1]:  # a heading opens a shard, never closes one
        last_line = s.text.rstrip("\n").rsplit("\n", 1)[-1]
        assert not last_line.startswith("#") or s.text.strip() == last_line
    assert len(split(MARKDOWN, 5000)) == 1


def test_markdown_shards_carry_their_heading_path() -> None:
    shards = split(MARKDOWN, 200)
    by_start = {s.text.split("\n")[0]: s.context for s in shards}
    assert by_start["- `KVMEM_REDIS_URL`: where the catalog lives."] == "# Deployment guide\n## Configuration"
    assert by_start["## Checks"] == "# Deployment guide"  # its own heading opens it
    assert shards[0].context == ""


def test_oversized_code_block_is_cut_at_lines() -> None:
    code = "```python\n" + "".join(f"value_{i} = compute({i})  # step {i}\n" for i in range(40)) + "```\n"
    text = "Intro.\n\n" + code + "\nOutro.\n"
    shards = split(text, 200)
    check_shards(text, shards, 200)
    for s in shards[1:]:
        assert text[s.start - 1] == "\n"  # every cut inside the block is at a line end


def _json_doc(num_items: int) -> str:
    rng = random.Random(7)
    items = [
        {"id": i, "name": f"user-{i}", "city": rng.choice(["Paris", "Oslo", "Rome"]), "tags": ["a", "b, c"]}
        for i in range(num_items)
    ]
    return json.dumps({"source": "crm export", "records": items}, indent=2)


def test_json_items_are_never_cut() -> None:
    text = _json_doc(60)
    assert detect_format(text) is DocFormat.JSON
    shards = split(text, 600)
    check_shards(text, shards, 600)
    for item in json.loads(text)["records"]:
        block = json.dumps(item, indent=2).replace("\n", "\n    ")  # as nested two levels deep
        assert sum(block in s.text for s in shards) == 1, item["id"]


def test_json_children_handles_strings_with_brackets_and_commas() -> None:
    text = '[{"a": "x, ]}", "b": [1, 2]}, "q\\"uote,", 3, {"c": {}}]'
    spans = json_children(text, 0, len(text))
    assert spans is not None
    assert [text[a:b] for a, b in spans] == ['[{"a": "x, ]}", "b": [1, 2]}, ', '"q\\"uote,", ', "3, ", '{"c": {}}]']


CSV_HEADER = "order_id,customer,city,amount,status"


def _csv_doc(num_rows: int) -> str:
    rng = random.Random(3)
    rows = [
        f"{1000 + i},cust-{rng.randint(1, 50)},{rng.choice(['Paris', 'Oslo', 'Rome'])},{rng.randint(5, 900)},"
        f"{rng.choice(['paid', 'refunded'])}"
        for i in range(num_rows)
    ]
    return CSV_HEADER + "\n" + "\n".join(rows) + "\n"


def test_csv_lines_are_never_cut_and_shards_know_the_header() -> None:
    text = _csv_doc(200)
    assert detect_format(text) is DocFormat.LINES
    shards = split(text, 500)
    check_shards(text, shards, 500)
    assert all(s.text.endswith("\n") for s in shards)  # every shard ends at a line end
    assert shards[0].context == "" and all(s.context == CSV_HEADER for s in shards[1:])


def test_log_lines_with_token_sizes() -> None:
    lines = [f"2026-11-29T10:{i % 60:02d}:00Z INFO request {i} served in {i % 17} ms" for i in range(300)]
    text = "\n".join(lines) + "\n"

    def tokens(s: str) -> int:
        return math.ceil(len(s) / 4)

    shards = split(text, 256, tokens)
    check_shards(text, shards, 256, tokens)
    assert all(s.text.endswith("\n") for s in shards)
    assert shards[1].context == ""  # a log has no header


def test_long_prose_paragraph_is_cut_at_sentences() -> None:
    sentences = [f"Sentence number {i} says something about the weather in spring." for i in range(60)]
    text = "A short opening paragraph.\n\n" + " ".join(sentences) + "\n\nA short closing paragraph.\n"
    shards = split(text, 400)
    check_shards(text, shards, 400)
    for s in shards[1:]:
        before = text[: s.start]
        assert before.endswith("\n") or re.search(r"[.!?]\s+$", before), before[-30:]
    assert shards[0].text.startswith("A short opening paragraph.\n\nSentence number 0")


def test_a_word_longer_than_the_shard_is_cut_in_characters() -> None:
    text = "tiny words here " + "x" * 95 + " and more words after it.\n"
    shards = split(text, 30)
    check_shards(text, shards, 30)
    assert max(s.size for s in shards) <= 30


def test_leading_blank_lines_and_empty_text() -> None:
    text = "\n\n\nFirst paragraph.\n\nSecond one.\n"
    units = units_of(text)
    assert units[0].start == 0 and units[0].kind is UnitKind.PARAGRAPH
    assert split("", 10) == []
    with pytest.raises(ValueError, match="max_size"):
        split(text, 0)


def test_random_documents_keep_every_promise() -> None:
    rng = random.Random(11)
    pieces = [
        lambda: f"## Section {rng.randint(1, 99)}\n\n",
        lambda: " ".join("word" * rng.randint(1, 3) for _ in range(rng.randint(3, 80))) + ".\n\n",
        lambda: "```\n" + "code line\n" * rng.randint(1, 30) + "```\n\n",
        lambda: "".join(f"- item {k}\n" for k in range(rng.randint(1, 6))) + "\n",
    ]
    for _ in range(30):
        text = "".join(rng.choice(pieces)() for _ in range(rng.randint(1, 25)))
        max_size = rng.randint(20, 600)
        check_shards(text, split(text, max_size), max_size)
