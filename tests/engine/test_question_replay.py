"""The ring's question replay (issue 25): a request's question span is read again at the prompt's end, in a
scoring pass that keeps nothing, before the prompt's final selection.

- its per-head page masses are those of the same tokens appended to the prompt and scored as its last chunk
  (the question at those positions, attending every earlier page and itself);
- it writes no pool row, and its best page leads the prompt's selection;
- switched off, or without a question, no replay runs; a question outside the prompt is refused.
"""

from __future__ import annotations

import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.step.sampling import InvalidRequestError
from tests.conftest import StartStore
from tests.engine.helpers import (
    drain,
    events_of,
    greedy,
    make_engine,
    random_prompt,
    ring_limits,
    run_until_done,
    tiny_model,
)

VOCAB = 49152
START = 64  # the last chunk (the query span) starts here: a multiple of ring_chunk, so both prompts' chunks agree


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=11)


@pytest.fixture(scope="module")
def gemma():
    from tests.engine.helpers import tiny_gemma

    return tiny_gemma(VOCAB, seed=5, window=8)


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, VOCAB)


def _engine(model, tok: Tokenizer, address: str, replay: bool = True):  # type: ignore[no-untyped-def]
    limits = ring_limits(budget_pages=8, query_pass="exact", anchor_pages=1, score_from=0.5, question_replay=replay)
    return make_engine(model, tok, num_slots=8, ring=limits, ring_chunk=8, store_address=address)


def _spy(engine):  # type: ignore[no-untyped-def]
    """Works run (replay_from, score_only, num_new) and, at each selection, (replay scores, query span scores)."""
    works: list[tuple[int, bool, int]] = []
    picks: list[tuple[torch.Tensor | None, torch.Tensor | None, list[int]]] = []
    run, select = engine.runner.run, engine.ring.select

    def spy_run(ws):  # type: ignore[no-untyped-def]
        works.extend((w.replay_from, w.score_only, w.num_new) for w in ws)
        return run(ws)

    def spy_select(ring, *args, **kwargs):  # type: ignore[no-untyped-def]
        before = (ring.replay_scores, ring.scores)
        select(ring, *args, **kwargs)
        if before[1] is not None and before[1].dim() == 2:
            picks.append((*before, list(ring.anchor)))

    engine.runner.run = spy_run
    engine.ring.select = spy_select
    return works, picks


def test_the_replay_scores_the_question_as_if_it_were_appended(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    prompt = _prompt(70, 7)
    question = (3, 11)  # tokens near the head: a question asked before the document
    replayed = _engine(model, smol_tokenizer, start_store(host_kv_mib=32).address)
    works, picks = _spy(replayed)
    seq = replayed.submit("a", prompt, greedy(6), query_start=START, question=question)
    run_until_done(replayed, [seq])
    tokens, done = drain(events_of(seq))
    assert done.unverified and len(tokens) == 6
    assert [w for w in works if w[0] >= 0] == [(3, True, 8)]  # one replay: the question's 8 tokens, kept nowhere
    assert len(picks) == 1 and picks[0][0] is not None

    appended = _engine(model, smol_tokenizer, start_store(host_kv_mib=32).address)
    _, picks_b = _spy(appended)
    seq_b = appended.submit("b", prompt[:START] + prompt[3:11], greedy(1), query_start=START)
    run_until_done(appended, [seq_b])
    assert len(picks_b) == 1 and picks_b[0][0] is None
    # the same tokens at the same positions over the same pages: the replay's masses are the appended chunk's
    torch.testing.assert_close(picks[0][0], picks_b[0][1], rtol=1e-4, atol=1e-6)
    assert picks[0][2][0] == picks_b[0][2][0]  # the replay's best page leads, as it does for the appended prompt


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_the_replay_writes_no_pool_row(model, gemma, kind: str, smol_tokenizer: Tokenizer, store_address: str) -> None:
    """Nor a local-ring row (Gemma's sliding layers): the pool is bit for bit what it was before the replay."""
    engine = _engine(model if kind == "llama" else gemma, smol_tokenizer, store_address)
    run = engine.runner.run
    unchanged: list[bool] = []

    def spy(ws):  # type: ignore[no-untyped-def]
        if not any(w.replay_from >= 0 for w in ws):
            return run(ws)
        pool = engine.runner.pool
        before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v, strict=True)]
        out = run(ws)
        unchanged.append(all(torch.equal(k, b[0]) and torch.equal(v, b[1])
                             for k, v, b in zip(pool.k, pool.v, before, strict=True)))  # fmt: skip
        return out

    engine.runner.run = spy
    seq = engine.submit("a", _prompt(70, 8), greedy(3), query_start=START, question=(2, 9))
    run_until_done(engine, [seq])
    assert unchanged == [True]
    assert len(drain(events_of(seq))[0]) == 3


def test_no_replay_when_off_or_without_a_question(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    for replay, question in ((False, (3, 11)), (True, None)):
        engine = _engine(model, smol_tokenizer, store_address, replay=replay)
        works, picks = _spy(engine)
        seq = engine.submit("a", _prompt(70, 9), greedy(3), query_start=START, question=question)
        run_until_done(engine, [seq])
        assert not [w for w in works if w[0] >= 0] and len(picks) == 1 and picks[0][0] is None
        engine.stop()
    engine = _engine(model, smol_tokenizer, store_address)
    for bad in ((5, 5), (-1, 3), (60, 71)):
        with pytest.raises(InvalidRequestError):
            engine.submit("b", _prompt(70, 9), greedy(3), question=bad)


def test_a_replay_beside_other_sequences_changes_none_of_their_tokens(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """A step that holds a replay and other sequences' prompt chunks or decode rows writes only theirs: each answer
    is the one it gets alone."""
    requests = [("a", _prompt(70, 21), (3, 11)), ("b", _prompt(60, 22), None), ("c", _prompt(75, 23), (5, 9))]
    alone = {}
    for rid, prompt, question in requests:
        engine = _engine(model, smol_tokenizer, start_store(host_kv_mib=32).address)
        seq = engine.submit(rid, prompt, greedy(8), query_start=len(prompt) - 6, question=question)
        run_until_done(engine, [seq])
        alone[rid] = drain(events_of(seq))[0]
        engine.stop()
    engine = make_engine(model, smol_tokenizer, num_slots=24, ring=ring_limits(budget_pages=8, query_pass="exact",
                         anchor_pages=1, score_from=0.5, question_replay=True), ring_chunk=8,
                         store_address=start_store(host_kv_mib=32).address)  # fmt: skip
    works, _ = _spy(engine)
    seqs = [engine.submit(rid, prompt, greedy(8), query_start=len(prompt) - 6, question=question)
            for rid, prompt, question in requests]  # fmt: skip
    run_until_done(engine, seqs)
    assert {s.request_id: drain(events_of(s))[0] for s in seqs} == alone
    assert sum(1 for w in works if w[0] >= 0) == 2
