"""bench/longeval's grid: every (task, shape) pair asked equally often, cases reproducible from the split's seed,
the held-out and tuning splits sharing no template."""

from __future__ import annotations

import argparse
from collections import Counter

from bench.longeval import run
from bench.longeval.split import SPLITS


def _args(**kw: object) -> argparse.Namespace:
    base = dict(split="heldout", kinds="", tasks="single_code,single_number,multikey,codeqa",
                shapes="chat_qlast,chat_qfirst,chat_doc_earlier,completion,completion_digits", lengths="1024",
                depths="0.1,0.3,0.5,0.7,0.9", per_cell=4)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


_DIGITS = tuple(range(32, 42))  # SmolLM2's ids of "0".."9"


def _count(text: str) -> int:
    return len(text) // 4  # a stand-in tokenizer: the grid's balance does not depend on it


def test_each_task_meets_each_shape_once_per_block() -> None:
    cases = run.build_cases(_args(), _count, _DIGITS)
    assert len(cases) == 20
    assert set(Counter((c.task, c.shape) for c in cases).values()) == {1}  # 4 tasks x 5 shapes, each once
    assert set(Counter((c.shape, c.depth) for c in cases).values()) == {1}  # a depth's cell is not one shape


def test_the_grid_is_reproducible_and_the_splits_differ() -> None:
    a = run.build_cases(_args(per_cell=2), _count, _DIGITS)
    b = run.build_cases(_args(per_cell=2), _count, _DIGITS)
    assert [c.to_json() for c in a] == [c.to_json() for c in b]
    assert [c.record() for c in a] == [c.record() for c in b] and "prompt" not in a[0].record()
    assert len({c.record()["text_sha256"] for c in a}) == len(a)
    tuning = run.build_cases(_args(per_cell=2, split="tuning"), _count, _DIGITS)
    assert {c.case_id for c in a}.isdisjoint({c.case_id for c in tuning})
    assert set(SPLITS["heldout"].templates).isdisjoint(SPLITS["tuning"].templates)


def test_digit_only_cases_bias_the_models_own_digit_tokens() -> None:
    """completion_digits biases the ids its tokenizer gives "0".."9" (a Gemma run once biased SmolLM2's ids, which
    are Gemma's <unused> tokens, and every such case answered <unused33>...)."""
    from bench.longeval.tasks import digit_tokens
    from services.common.model_files import resolve_model_path
    from services.common.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model_path("embedded:smollm2"))
    assert digit_tokens(tok.encode) == _DIGITS
    assert [tok.decode([t]) for t in digit_tokens(tok.encode)] == [str(d) for d in range(10)]
    shifted = tuple(t + 1000 for t in _DIGITS)
    cases = [c for c in run.build_cases(_args(), _count, shifted) if c.shape == "completion_digits"]
    assert cases and all(set(c.logit_bias) == {str(t) for t in shifted} for c in cases)


def test_a_listing_case_needs_every_needle_and_asks_for_a_long_answer() -> None:
    """listing (the long answer of issue 25 item 3): LIST_KEYS keys, each with its own value at its own depth,
    asked for one line each; found() tells which values the answer holds, score() wants all."""
    from bench.longeval import tables
    from bench.longeval.tasks import LIST_KEYS, found, score

    cases = run.build_cases(_args(tasks="listing", shapes="completion,chat_qlast", lengths="4096"), _count, _DIGITS)
    case = next(c for c in cases if c.shape == "completion")
    assert len(set(case.answers)) == LIST_KEYS and case.max_tokens >= 200
    for value in case.answers:
        assert case.prompt.count(value) == 1
    places = sorted(case.prompt.index(v) for v in case.answers)
    assert places[-1] - places[0] > len(case.prompt) / 2  # spread over the document, not one page
    half = " ".join(case.answers[: LIST_KEYS // 2])
    assert found(case, half) == [True] * (LIST_KEYS // 2) + [False] * (LIST_KEYS - LIST_KEYS // 2)
    assert not score(case, half) and score(case, " ".join(case.answers))
    assert set(SPLITS["heldout"].list_questions).isdisjoint(SPLITS["tuning"].list_questions)
    rows = {"ring": {case.case_id: {"found": found(case, half), "completion_tokens": 230}}}
    lines = tables.recall_lines({case.case_id: case.to_json()}, rows, {case.case_id})
    assert "| ring (1 cases, median answer 230 tokens) | 8/16 = 50% | 8/8 = 100% | 0/8 = 0% |" in lines


def test_a_recite_case_copies_one_passage_whose_sentences_are_the_answers_in_order() -> None:
    """recite (issue 25 item 3): one passage of docstring sentences, the answer's start given (its first sentence);
    the rest of its sentences, in order, are the answers; the prompt and the answer together fill the case's
    length; its haystack is not prose (the passage's own source)."""
    from bench.longeval.tasks import RECITE_TOKENS, found

    cases = run.build_cases(_args(tasks="recite", shapes="completion,chat_qlast", lengths="4096"), _count, _DIGITS)
    assert {c.kind for c in cases} <= {"code", "tables"}
    case = next(c for c in cases if c.shape == "completion")
    assert len(case.answers) >= 10 and len(set(case.answers)) == len(case.answers)
    places = [case.prompt.index(s) for s in case.answers]
    assert places == sorted(places) and all(case.prompt.count(s) == 1 for s in case.answers)
    passage = case.prompt[places[0] : places[-1] + len(case.answers[-1])]
    assert _count(passage) >= RECITE_TOKENS * 0.8 and case.max_tokens > _count(passage)
    assert 4096 - 400 < _count(case.prompt) + case.max_tokens <= 4096
    first = case.prompt.rsplit("\n", 1)[-1]  # the answer's start: the passage's first sentence
    assert case.prompt.count(first) == 2 and found(case, first) == [False] * len(case.answers)
    assert found(case, passage) == [True] * len(case.answers)
    assert set(SPLITS["heldout"].recite_asks).isdisjoint(SPLITS["tuning"].recite_asks)
    tuning = run.build_cases(_args(tasks="recite", shapes="completion", lengths="4096", split="tuning"), _count,
                             _DIGITS)  # fmt: skip
    assert {s for c in tuning for s in c.answers}.isdisjoint({s for c in cases for s in c.answers})
