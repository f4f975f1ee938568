"""Engine core on a tiny random model: paged KV equals the dense reference, across pages, chunks,
concurrent sequences, prefix reuse and preemption; bad requests are refused with typed errors."""

from __future__ import annotations

import random
import threading

import pytest

from services.common.tokenizer import Tokenizer
from services.engine.records import ContextLengthError, EngineStoppedError, OverloadedError
from services.engine.step.sampling import InvalidRequestError, SamplingParams
from services.engine.step.sequence import Done, Failed, FinishReason
from services.kvstore.client import KVStoreError
from tests.engine.helpers import drain, events_of, greedy, make_engine, reference_greedy, run_until_done, tiny_model

VOCAB = 49152  # the real tokenizer's vocabulary: detokenization runs for real


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


@pytest.mark.parametrize(("prompt_len", "chunk"), [(1, 16), (7, 16), (8, 3), (37, 16), (37, 5)])
def test_single_sequence_matches_dense_reference(model, smol_tokenizer: Tokenizer, prompt_len: int, chunk: int) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32, prefill_chunk=chunk)
    prompt = _prompt(prompt_len, prompt_len)
    seq = engine.submit("r", prompt, greedy(12))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert tokens == reference_greedy(model, prompt, 12)
    assert isinstance(done, Done) and done.finish_reason is FinishReason.LENGTH
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (prompt_len, 12, 0)
    assert engine.slots.counts().owned == 0


def test_concurrent_sequences_each_match_their_reference(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=64, prefill_chunk=10)
    prompts = [_prompt(n, 100 + n) for n in (3, 17, 9, 30)]
    seqs = [engine.submit(f"r{i}", p, greedy(10 + i)) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        assert drain(events_of(s))[0] == reference_greedy(model, p, 10 + i)


def test_shared_prefix_is_reused_and_reported(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    prefix = _prompt(22, 5)  # 5 full pages of 4 + 2 tokens
    first = engine.submit("a", prefix + [200, 201], greedy(4))
    run_until_done(engine, [first])
    second_prompt = prefix + [300, 301, 302]
    second = engine.submit("b", second_prompt, greedy(6))
    run_until_done(engine, [second])
    tokens, done = drain(events_of(second))
    assert isinstance(done, Done) and done.cached_tokens == 20  # 5 whole pages
    assert tokens == reference_greedy(model, second_prompt, 6)


def test_prompt_of_whole_pages_recomputes_its_last_page(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    prompt = _prompt(16, 9)
    run_until_done(engine, [s := engine.submit("a", prompt, greedy(2))])
    again = engine.submit("b", prompt, greedy(5))
    run_until_done(engine, [again])
    tokens, done = drain(events_of(again))
    assert done.cached_tokens == 12  # the last page holds the token whose logits we need
    assert tokens == reference_greedy(model, prompt, 5)
    assert s.is_finished


def test_preemption_under_a_tiny_pool_keeps_outputs_exact(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=12, prefill_chunk=8)  # 48 tokens of KV
    prompts = [_prompt(10, 40 + i) for i in range(3)]
    seqs = [engine.submit(f"r{i}", p, greedy(20)) for i, p in enumerate(prompts)]  # 3 x 30 > 48
    run_until_done(engine, seqs)
    assert engine.scheduler.num_preemptions > 0
    for p, s in zip(prompts, seqs, strict=True):
        assert drain(events_of(s))[0] == reference_greedy(model, p, 20)
    assert engine.slots.counts().owned == 0


def test_seeded_sampling_is_reproducible(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = engine.submit("a", _prompt(5, 1), params)
    b = engine.submit("b", _prompt(5, 1), params)
    run_until_done(engine, [a, b])
    assert drain(events_of(a))[0] == drain(events_of(b))[0]


def test_stop_token_ends_with_stop_and_is_not_in_text(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    prompt = _prompt(6, 3)
    expected = reference_greedy(model, prompt, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(expected[3],), ignore_eos=True)
    seq = engine.submit("a", prompt, params)
    run_until_done(engine, [seq])
    events = events_of(seq)
    tokens, done = drain(events)
    assert tokens == expected[:4]
    assert done.finish_reason is FinishReason.STOP
    text = "".join(e.text for e in events[:-1])
    assert text == smol_tokenizer.decode(expected[:3])


def test_abort_releases_slots(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    seq = engine.submit("a", _prompt(10, 2), greedy(100))
    engine.poll()
    engine.step()
    engine.step()
    assert engine.slots.counts().owned > 0
    engine.abort(seq)
    engine.poll()
    assert engine.slots.counts().owned == 0
    assert drain(events_of(seq))[1].finish_reason is FinishReason.ABORT


def test_bad_requests_raise_typed_errors(model, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=32, max_context=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.submit("a", [], greedy(1))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.submit("a", [VOCAB + 5], greedy(1))
    with pytest.raises(ContextLengthError, match="60 \\+ max_tokens 10 = 70"):
        engine.submit("a", _prompt(60, 0), greedy(10))
    with pytest.raises(ContextLengthError, match="64 tokens"):
        engine.submit("a", _prompt(64, 0), greedy(1))
    for i in range(64):
        engine.submit(f"q{i}", [5], greedy(1))
    with pytest.raises(OverloadedError):
        engine.submit("over", [5], greedy(1))


def test_tail_page_rows_are_copied_for_the_next_turn(model, smol_tokenizer: Tokenizer) -> None:
    """Turn 2 resends turn 1 (prompt + answer) and more: every computed token of turn 1 is reused,
    including the partial tail page, whose rows are copied (never shared) into a new slot."""
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    prompt = _prompt(21, 12)
    first = engine.submit("t1", prompt, greedy(6))
    run_until_done(engine, [first])
    answer, _ = drain(events_of(first))
    turn2 = prompt + answer + [77, 78, 79]
    second = engine.submit("t2", turn2, greedy(5))
    run_until_done(engine, [second])
    tokens, done = drain(events_of(second))
    assert done.cached_tokens == len(prompt) + len(answer) - 1  # the last answer token was never fed
    assert tokens == reference_greedy(model, turn2, 5)
    third = engine.submit("t3", prompt[:10] + [5, 6, 7], greedy(3))  # diverges inside full page 2
    run_until_done(engine, [third])
    tokens, done = drain(events_of(third))
    assert done.cached_tokens == 8  # whole pages only: a full page is not matched partially
    assert tokens == reference_greedy(model, prompt[:10] + [5, 6, 7], 3)


def _until_end(seq, timeout_s: float = 120) -> Done | Failed:  # noqa: ANN001
    """The sequence's last event, read as the engine's own thread posts them."""
    while True:
        event = seq.events.get(timeout=timeout_s)
        if isinstance(event, Done | Failed):
            return event


def test_a_failing_schedule_fails_what_it_held_and_the_loop_serves_on(
    model, smol_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while scheduling (a kvstore replica of another deployment refusing the prefix lookup, in the run
    that found it) fails the requests the engine holds with `internal`; it used to end the engine's loop thread,
    and every request after it waited forever on a process that still answered health checks."""
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    real, calls = engine.scheduler.schedule, []

    def schedule():  # noqa: ANN202
        calls.append(1)
        if len(calls) == 1:
            raise KVStoreError("kvstore 127.0.0.1:1: UNKNOWN: boom")
        return real()

    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    engine.start()
    try:
        first = _until_end(engine.submit("a", _prompt(10, 3), greedy(4)))
        assert isinstance(first, Failed) and first.code == "internal", first
        assert engine.stats.step_failures_total == 1
        later = engine.submit("b", _prompt(10, 4), greedy(4))
        assert isinstance(_until_end(later), Done)
    finally:
        engine.stop()


def test_a_loop_that_dies_fails_every_request_and_says_so(
    model, smol_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error the step cannot contain (here in taking requests in) ends the loop: the requests held and the
    ones not yet taken in fail with `internal`, and on_loop_death runs (the engine process exits on it, and the
    launcher starts a new one) instead of leaving a process that accepts requests no step will ever run."""
    engine = make_engine(model, smol_tokenizer, num_slots=32)
    died = threading.Event()
    engine.on_loop_death = died.set

    def poll() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "poll", poll)
    seqs = [engine.submit(f"r{i}", _prompt(10, i), greedy(4)) for i in range(3)]  # queued before the loop runs
    engine.start()
    try:
        for seq in seqs:
            last = _until_end(seq)
            assert isinstance(last, Failed) and last.code == "internal", last
        assert died.wait(30)
        with pytest.raises(EngineStoppedError):  # nothing is queued behind a dead loop
            engine.submit("late", _prompt(10, 9), greedy(4))
    finally:
        engine.stop()
