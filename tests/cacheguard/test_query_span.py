"""The ring's query span from the cache guard (issue 25): the question of a chat's last user message
(document then question, question then document, document in an earlier message) and of a raw prompt,
with the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import pytest

from services.cacheguard.core import GuardCore, PromptRequest
from services.common.model_files import resolve_model_path
from services.common.tokenizer import Tokenizer, load_tokenizer

QUESTION = "What is the access code for amber-falcon-42 mentioned in the text?"
PARAGRAPH = "Paragraph {}: the harbor lanterns were lit at {} o'clock, and the ledger noted it."
DOC = "\n\n".join(PARAGRAPH.format(i, i) for i in range(80))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path("embedded:smollm2"))


def _prepare(tok: Tokenizer, messages=None, prompt: str | None = None, span: str = "question"):
    core = GuardCore(tok, max_sessions=8, query_span=span)
    return core.prepare(PromptRequest(messages=messages, prompt_text=prompt))


def _find(ids: list[int], piece: list[int]) -> int:
    for i in range(len(ids) - len(piece), -1, -1):
        if ids[i : i + len(piece)] == piece:
            return i
    raise AssertionError("piece not in the prompt")


def test_document_then_question_starts_at_the_question(tokenizer: Tokenizer) -> None:
    p = _prepare(tokenizer, [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}])
    at = _find(p.token_ids, tokenizer.encode(" access code for amber"))
    assert len(p.token_ids) > 1500
    assert at - 4 <= p.query_start <= at  # the question's first tokens ("What is the"), give or take a seam
    turn = _prepare(tokenizer, [{"role": "user", "content": f"{DOC}\n\n{QUESTION}"}], span="turn")
    assert turn.query_start <= 3  # the turn: the whole document


def test_question_first_scores_the_generation_prompt(tokenizer: Tokenizer) -> None:
    p = _prepare(tokenizer, [{"role": "user", "content": f"{QUESTION}\n\n{DOC}"}])
    assert len(p.token_ids) - 8 <= p.query_start < len(p.token_ids)  # end of the message: the assistant header


def test_document_in_an_earlier_message_keeps_the_last_turn(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": DOC}, {"role": "assistant", "content": "Read it."},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    p = _prepare(tokenizer, messages)
    at = _find(p.token_ids, tokenizer.encode(QUESTION)[:3])
    assert at - 4 <= p.query_start <= at


def test_raw_prompt_takes_its_last_paragraph(tokenizer: Tokenizer) -> None:
    text = f"{DOC}\n\nQuestion: {QUESTION}\nAnswer: The code is"
    p = _prepare(tokenizer, prompt=text)
    at = _find(p.token_ids, tokenizer.encode("Question:"))
    assert at - 2 <= p.query_start <= at + 1
    assert _prepare(tokenizer, prompt="short prompt").query_start is None
    assert _prepare(tokenizer, prompt=text, span="turn").query_start is None


def _decoded_question(tok: Tokenizer, content: str) -> str | None:
    p = _prepare(tok, [{"role": "user", "content": content}])
    if p.question is None:
        return None
    start, end = p.question
    return tok.decode(p.token_ids[start:end]).strip()


def test_a_question_first_is_sent_for_the_question_replay(tokenizer: Tokenizer) -> None:
    """A question first (it asks, nothing asks at the end) is replayed alone; an instruction first reads like a
    paragraph, so it is replayed beside the query span (the message's last paragraph)."""
    assert _decoded_question(tokenizer, f"{QUESTION}\n\n{DOC}") == QUESTION
    assert _prepare(tokenizer, [{"role": "user", "content": f"{QUESTION}\n\n{DOC}"}]).question_alone
    instruction = "Find the access code for amber-falcon-42 in the text and state it."
    assert _decoded_question(tokenizer, f"{instruction}\n\n{DOC}") == instruction
    assert not _prepare(tokenizer, [{"role": "user", "content": f"{instruction}\n\n{DOC}"}]).question_alone


def test_no_question_replay_for_a_question_last_a_short_message_or_a_later_turn(tokenizer: Tokenizer) -> None:
    assert _decoded_question(tokenizer, f"Read this.\n\n{DOC}\n\n{QUESTION}") is None  # the query span holds it
    assert _decoded_question(tokenizer, QUESTION) is None
    messages = [{"role": "user", "content": DOC}, {"role": "assistant", "content": "Read it."},
                {"role": "user", "content": QUESTION}]  # fmt: skip
    assert _prepare(tokenizer, messages).question is None
    assert _prepare(tokenizer, prompt=f"{QUESTION}\n\n{DOC}").question is None  # raw prompts: the tail only
    assert _prepare(tokenizer, [{"role": "user", "content": f"{QUESTION}\n\n{DOC}"}], span="turn").question is None
