"""Decode bursts through the engine (several greedy steps per host round trip, scheduler.py) and overlapped
bursts (each launched before the one before it is read, engine.py), on tiny Llama and tiny Gemma 3 (also with
local rings): the same tokens, finish reasons and reusable K/V as one step at a time; bursts kept inside a
page, ended at re-selection steps and where a re-selection takes effect, never for sampled requests unless split
steps are on (greedy neighbours burst without the host-sampled request, then everyone steps once); a chain of
overlapped bursts ends for an arriving request or an abort. The runner-level burst checks are in
test_decode_graph.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import FinishReason, Sequence
from services.engine.step.work import Work
from tests.conftest import StartStore
from tests.engine.helpers import (
    DECODE_MODELS,
    decode_model,
    device_or_skip,
    drain,
    events_of,
    greedy,
    make_engine,
    reference_greedy,
    ring_limits,
    run_until_done,
    tiny_model,
    word_tokenizer,
)

VOCAB = 256
PAGE = 4  # make_engine's page size


@pytest.fixture(scope="module", params=DECODE_MODELS)
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return decode_model(request.param, VOCAB)


def _burst_run(
    model,
    tokenizer: Tokenizer,
    burst: int,
    params: list[SamplingParams],
    namespace: str,
    lengths: tuple[int, ...] = (7, 30, 19),
    **kw: object,
) -> tuple[list[tuple[list[int], object]], list[list[Work]], object]:
    """Prompts of these lengths decoded together; (per request (tokens, Done), the works of every step, the
    engine)."""
    on_engine = kw.pop("on_engine", None)
    engine = make_engine(model, tokenizer, decode_burst=burst, **kw)  # type: ignore[arg-type]
    if on_engine is not None:
        on_engine(engine)  # type: ignore[operator]
    steps: list[list[Work]] = []
    real = engine.runner.run

    def spy(works: list[Work]):  # type: ignore[no-untyped-def]
        steps.append(list(works))
        return real(works)

    engine.runner.run = spy  # type: ignore[method-assign]
    rng = random.Random(11)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]
    seqs = [engine.submit(f"b{i}", p, params[i], namespace=namespace) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    return [drain(events_of(s)) for s in seqs], steps, engine


def _check_bursts(steps: list[list[Work]], page: int = PAGE) -> int:
    """Every burst is all-decode, uniform, inside each sequence's page; returns how many ran."""
    bursts = 0
    for works in steps:
        n = works[0].num_steps
        assert all(w.num_steps == n for w in works)
        if n > 1:
            bursts += 1
            assert all(w.num_new == 1 and w.start % page + n <= page for w in works), works
    return bursts


def test_bursts_give_the_tokens_of_single_steps(model, smol_tokenizer: Tokenizer) -> None:
    params = [greedy(20)] * 3
    single, steps1, engine1 = _burst_run(model, smol_tokenizer, 1, params, "one", num_slots=64)
    burst, steps4, engine4 = _burst_run(model, smol_tokenizer, 4, params, "burst", num_slots=64)
    assert _check_bursts(steps1) == 0 and _check_bursts(steps4) >= 4
    assert len(steps4) < len(steps1) - 4  # fewer host round trips (3 sequences at different page offsets)
    # what ended each burst: a page end of one of the three (at different offsets), the cap, the token limit
    cuts = engine4.scheduler.burst_cuts  # type: ignore[attr-defined]
    assert not engine1.scheduler.burst_cuts and set(cuts) <= {"page", "cap", "tokens"} and cuts["page"] >= 3  # type: ignore[attr-defined]
    assert sum(cuts.values()) == sum(1 for ws in steps4 if ws[0].device_argmax), (cuts, len(steps4))
    assert [t for t, _ in burst] == [t for t, _ in single]
    assert all(len(t) == 20 for t, _ in burst)


def _shrinking_continuations(steps: list[list[Work]]) -> int:
    """How many continued steps (inputs from the device) ran fewer sequences than the step before them."""
    return sum(
        1
        for before, after in zip(steps, steps[1:], strict=False)
        if after[0].on_device and {w.seq for w in after} < {w.seq for w in before}
    )


def test_sequences_finishing_at_different_steps_leave_the_chain_of_overlapped_bursts(
    model, smol_tokenizer: Tokenizer
) -> None:
    """Three requests with different max_tokens: when one chooses its last token in a burst in flight, the next
    burst is launched for the other two before the host reads it (its row leaves the batch, the others' tokens
    gathered on the device) instead of the device waiting for a host schedule(). Every request's tokens are
    those of single steps; only the last finish ends the chain."""
    params = [greedy(9), greedy(26), greedy(17)]
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "leave1", num_slots=64)
    burst, steps, engine = _burst_run(model, smol_tokenizer, 4, params, "leave4", num_slots=64)
    assert [t for t, _ in burst] == [t for t, _ in single] and [len(t) for t, _ in burst] == [9, 26, 17]
    sched = engine.scheduler  # type: ignore[attr-defined]
    assert sched.continue_leaves == 2 and _shrinking_continuations(steps) == 2, (sched.continue_leaves, steps)
    assert sched.continue_declines["token limit"] == 1, sched.continue_declines


def test_a_stop_read_during_a_burst_in_flight_drops_the_row_from_the_next_one(smol_tokenizer: Tokenizer) -> None:
    """A request stops (a stop token) in a burst whose successor is already on the device: the burst after that
    one runs without it, the others' tokens unchanged (single steps' reference), its slots come back."""
    model = tiny_model(VOCAB, seed=3)
    free_run = _burst_run(model, smol_tokenizer, 1, [greedy(30)] * 3, "lfree", num_slots=64)[0][0][0]
    k = next(i for i in range(6, 30) if free_run[i] not in free_run[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=(free_run[k],))
    params = [stop, greedy(30), greedy(30)]
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "lstop1", num_slots=64)
    burst, steps, engine = _burst_run(model, smol_tokenizer, 4, params, "lstop4", num_slots=64)
    assert [t for t, _ in burst] == [t for t, _ in single] and burst[0][0] == free_run[: k + 1]
    assert burst[0][1].finish_reason == FinishReason.STOP  # type: ignore[union-attr]
    assert engine.scheduler.continue_leaves >= 1 and _shrinking_continuations(steps) >= 1  # type: ignore[attr-defined]
    assert "others" not in engine.scheduler.continue_declines  # type: ignore[attr-defined]
    engine.slots.check_integrity()  # type: ignore[attr-defined]


def _split_pattern(steps: list[list[Work]], odd: str, others: set[str]) -> list[str]:
    """Per decode step while the odd request and every other decode together: "burst" (the others only, several
    steps), "rest" (the others only, one step: a page end or re-selection capped it) or "all" (everyone, one step)."""
    out = []
    for works in steps:
        ids = {w.seq.request_id for w in works}
        if not all(w.num_new == 1 and w.start >= len(w.seq.prompt_ids) for w in works) or not others <= ids:
            continue
        if ids == others | {odd}:
            assert all(w.num_steps == 1 and not w.device_argmax for w in works), works
            out.append("all")
        elif ids == others:
            assert all(w.seq.params.device_greedy for w in works)
            out.append("burst" if works[0].num_steps > 1 else "rest")
    return out


@pytest.mark.parametrize(
    "odd",
    [
        SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2),
    ],
    ids=["sampled", "penalised", "logprobs"],
)
def test_split_steps_let_greedy_neighbours_burst_beside_a_host_sampled_request(
    model, smol_tokenizer: Tokenizer, odd: SamplingParams
) -> None:
    """Split steps (scheduler.py): while a host-sampled request decodes beside greedy ones, steps alternate between
    a burst of the greedy ones alone and one step of everyone; every request's tokens are those of single steps
    (the sampled one's too: its generator draws once per own step)."""
    params = [greedy(12), odd, greedy(12)]
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "split1", num_slots=64)
    split, steps, _ = _burst_run(model, smol_tokenizer, 4, params, "split4", num_slots=64, split_bursts=True)
    assert [t for t, _ in split] == [t for t, _ in single] and [len(t) for t, _ in split] == [12, 12, 12]
    pattern = _split_pattern(steps, "b1", {"b0", "b2"})
    assert pattern.count("burst") >= 2
    assert all(a != "all" or b != "all" for a, b in zip(pattern, pattern[1:], strict=False))  # never two in a row
    assert all(a == "all" or b == "all" for a, b in zip(pattern, pattern[1:], strict=False))  # alternating
    assert _check_bursts(steps) >= 2


def test_a_sampled_request_keeps_the_step_one_token_at_a_time_by_default(model, smol_tokenizer: Tokenizer) -> None:
    params = [greedy(12), SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True), greedy(12)]
    _, steps, _ = _burst_run(model, smol_tokenizer, 4, params, "sampled", num_slots=64)
    assert _check_bursts(steps[:-12]) == 0  # while the sampled request runs (it decodes to the end with the others)


def test_without_greedy_neighbours_host_sampled_requests_step_together(model, smol_tokenizer: Tokenizer) -> None:
    """Nothing to burst: every step runs every request (no request ever rests)."""
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)
    _, steps, _ = _burst_run(
        model, smol_tokenizer, 4, [sampled] * 2, "nosplit", num_slots=64, lengths=(7, 9), split_bursts=True
    )
    decoding = [ws for ws in steps if all(w.num_new == 1 for w in ws)]
    assert decoding and all(len(ws) == 2 for ws in decoding[:-1]) and _check_bursts(steps) == 0


def test_a_stop_token_mid_burst_ends_the_sequence_there(smol_tokenizer: Tokenizer) -> None:
    """The stop is a token the first request emits mid-burst: same tokens and finish as single steps; a
    follow-up request extending that output reuses the finished request's pages and decodes correctly.
    Tiny Llama only: the tiny random Gemma repeats one token from the start."""
    model = tiny_model(VOCAB, seed=3)
    results, _, _ = _burst_run(model, smol_tokenizer, 1, [greedy(20)] * 3, "free", num_slots=64)
    free_run = results[0][0]
    prompt0_len = 7
    # a token at a position not at a page end (so a burst runs past it), first occurrence
    k = next(
        i for i in range(2, 20) if (prompt0_len + i) % PAGE not in (0, PAGE - 1) and free_run[i] not in free_run[:i]
    )
    stop = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(free_run[k],))
    params = [stop, greedy(20), greedy(20)]
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "stop1", num_slots=64)
    burst, steps, engine = _burst_run(model, smol_tokenizer, 4, params, "stop4", num_slots=64)
    assert _check_bursts(steps) >= 2
    assert burst[0][0] == single[0][0] == free_run[: k + 1]
    assert burst[0][1] == single[0][1] and burst[0][1].finish_reason == FinishReason.STOP  # type: ignore[union-attr]
    assert [t for t, _ in burst[1:]] == [t for t, _ in single[1:]]
    rng = random.Random(11)
    prompt0 = [rng.randrange(VOCAB) for _ in range(prompt0_len)]
    follow = prompt0 + free_run[: k + 1]
    seq = engine.submit("follow", follow, greedy(6), namespace="stop4")
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens > 0  # type: ignore[union-attr]  # the stopped request's pages were reused
    assert tokens == reference_greedy(model, follow, 6)


def test_a_burst_streams_its_tokens_as_one_event_with_the_text_of_single_steps(smol_tokenizer: Tokenizer) -> None:
    """A sequence without stop strings takes a burst's tokens as one run (one detokenizer update, one event):
    the streamed tokens and text, the finish and its counts are those of single steps, with a stop token and
    the max_tokens limit both falling inside a run; with a stop string every token is still its own event."""
    from services.engine.step.sequence import Chunk

    model = tiny_model(VOCAB, seed=3)
    free_run = _burst_run(model, smol_tokenizer, 1, [greedy(20)] * 3, "free", num_slots=64)[0][0][0]
    stop_text = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=("zzzz",))

    def streamed(burst: int, params: list[SamplingParams]) -> list[tuple[list[list[int]], str, object]]:
        engine = make_engine(model, smol_tokenizer, decode_burst=burst, num_slots=64)
        rng = random.Random(11)
        prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 30, 19)]
        seqs = [engine.submit(f"e{i}", q, params[i], namespace=f"text{burst}") for i, q in enumerate(prompts)]
        run_until_done(engine, seqs)
        out = []
        for seq in seqs:
            events = events_of(seq)
            chunks = [ev for ev in events if isinstance(ev, Chunk)]
            out.append(([c.token_ids for c in chunks], "".join(c.text for c in chunks), events[-1]))
        return out

    inside = 0  # stop tokens (each a first occurrence in the free run) that came inside a run
    for k in [i for i in range(2, 20) if free_run[i] not in free_run[:i]]:
        stop_token = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=(free_run[k],))
        params = [stop_token, greedy(18), stop_text]
        single, burst = streamed(1, params), streamed(4, params)
        for (ids1, text1, done1), (ids4, text4, done4) in zip(single, burst, strict=True):
            assert sum(ids4, []) == sum(ids1, []) and text4 == text1 and done4 == done1
            assert all(len(ids) == 1 for ids in ids1)
        assert sum(burst[0][0], []) == free_run[: k + 1] and len(sum(burst[1][0], [])) == 18
        assert max(len(ids) for ids in burst[1][0]) > 1 and len(burst[1][0][-1]) > 1  # the limit inside a run
        assert all(len(ids) == 1 for ids in burst[2][0])  # a stop string: token by token
        inside += len(burst[0][0][-1]) > 1
        if inside >= 2:
            break
    assert inside >= 2


@pytest.mark.parametrize("lengths", [(62,), (7, 30, 19)], ids=["one", "three"])
def test_ring_bursts_end_at_re_selection_steps(
    model, smol_tokenizer: Tokenizer, start_store: StartStore, lengths: tuple[int, ...]
) -> None:
    """Re-selection every 4 of a sequence's own decode steps on an 8-page budget: a burst ends on a scoring
    step (its query scores the pages; one over-budget sequence of 62 tokens, whose scoring steps fall mid-page:
    the burst before each ends there), and the tokens equal single steps'. Three sequences re-select at their
    own phases: a step where one of them scores is a burst of one, its token still chosen on the device."""
    address = start_store(host_kv_mib=32).address
    kw = dict(num_slots=40, ring=ring_limits(8, rescore_interval=4), ring_chunk=8, store_address=address)
    params = [greedy(20)] * len(lengths)
    if len(lengths) > 1:  # and one host-sampled request: split steps around it (the sequences' own steps stay)
        params[1] = SamplingParams(temperature=0.8, seed=3, max_tokens=20, ignore_eos=True)
        kw["split_bursts"] = True
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "ring1", lengths=lengths, **kw)
    burst, steps, engine = _burst_run(model, smol_tokenizer, 4, params, "ring4", lengths=lengths, **kw)
    assert _check_bursts(steps) >= 3
    scoring = [ws for ws in steps if any(w.score_tokens for w in ws) and all(w.num_new == 1 for w in ws)]
    assert scoring and all(w.score_tokens <= 1 for ws in scoring for w in ws)
    greedy_scoring = [ws for ws in scoring if all(w.seq.params.device_greedy for w in ws)]  # not an "all" step
    assert all(w.device_argmax for ws in greedy_scoring for w in ws)
    if len(lengths) > 1:
        assert "burst" in _split_pattern(steps, "b1", {"b0", "b2"})  # the greedy two burst beside the sampled one
    if len(lengths) == 1:
        assert any(ws[0].num_steps > 1 for ws in scoring), "a burst must end on a re-selection step"
        assert engine.scheduler.burst_cuts["rescore"] >= 1, engine.scheduler.burst_cuts  # type: ignore[attr-defined]
    assert [t for t, _ in burst] == [t for t, _ in single]


def test_overlapped_bursts_give_the_tokens_of_bursts_read_one_by_one(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """Each burst launched before the one before it is read (engine.py: overlapped bursts), through the ring
    with re-selections every 4 steps taking effect 2 steps later (their pages prefetched), page ends and
    sequences finishing at different lengths (leaving the chain): the same tokens and finishes as bursts read one
    by one."""
    address = start_store(host_kv_mib=32).address
    ring = ring_limits(8, rescore_interval=4, prefetch_steps=2)
    kw = dict(num_slots=26, ring=ring, ring_chunk=8, store_address=address, lengths=(61, 30, 45))
    params = [greedy(20), greedy(13), greedy(24)]
    serial, serial_steps, _ = _burst_run(model, smol_tokenizer, 4, params, "serial", decode_overlap=False, **kw)
    overlapped, steps, engine = _burst_run(model, smol_tokenizer, 4, params, "overlap", **kw)
    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "single", **kw)
    continued = [ws for ws in steps if ws[0].on_device]
    assert not any(ws[0].on_device for ws in serial_steps)
    assert len(continued) >= 5 and engine.stats.overlapped_steps_total == len(continued)  # type: ignore[attr-defined]
    assert any(w.start % PAGE == 0 for ws in continued for w in ws)  # continued into a new page
    assert any(w.score_tokens for ws in continued for w in ws)  # a continued step scored the pages
    assert engine.ring.num_prefetched > 0  # type: ignore[attr-defined]  # re-selections took pages in
    assert [t for t, _ in overlapped] == [t for t, _ in serial]
    assert [t for t, _ in overlapped] == [t for t, _ in single]  # re-selections take effect on the same steps
    assert [d.finish_reason for _, d in overlapped] == [d.finish_reason for _, d in serial]  # type: ignore[attr-defined]
    assert [len(t) for t, _ in overlapped] == [20, 13, 24]
    # the two that finished first left the chain (their rows closed up on the device) rather than ending it
    assert engine.scheduler.continue_leaves >= 1 and _shrinking_continuations(steps) >= 1  # type: ignore[attr-defined]


def test_re_selections_inside_bursts_give_the_tokens_of_single_steps(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """Pages of 16, bursts of 8, a re-selection every 4 of a sequence's steps taking effect 2 steps later (its
    pages prefetched): bursts run through the re-selection steps, the step's query kept on the device for the
    page scores (Work.score_pos), and switch a sequence's read set where its last re-selection takes effect
    (Work.switch, both sets resident for the burst). The same tokens as single steps and as bursts cut at every
    re-selection (switch_in_burst off), in fewer launches."""
    address = start_store(host_kv_mib=64).address
    kw = dict(num_slots=30, page_size=16, max_context=512, ring_chunk=32, store_address=address,
              lengths=(300, 170, 233))  # fmt: skip
    params = [greedy(40), greedy(33), greedy(45)]

    def limits(on: bool) -> object:
        return ring_limits(8, page_size=16, rescore_interval=4, prefetch_steps=2, switch_in_burst=on)

    single, _, _ = _burst_run(model, smol_tokenizer, 1, params, "in1", ring=limits(True), **kw)
    cut, cut_steps, _ = _burst_run(model, smol_tokenizer, 8, params, "cut8", ring=limits(False), **kw)
    inside, steps, engine = _burst_run(model, smol_tokenizer, 8, params, "in8", ring=limits(True), **kw)
    _check_bursts(steps, page=16)
    works = [w for ws in steps for w in ws if w.num_steps > 1]
    switched = [w for w in works if w.switch is not None]
    assert switched and all(w.start < w.switch.pos < w.start + w.num_steps for w in switched)  # type: ignore[union-attr]
    assert any(w.switch.leaving or w.switch.joining for w in switched)  # type: ignore[union-attr]
    assert any(w.start <= w.score_pos < w.start + w.num_steps - 1 for w in works)  # scored before the burst's end
    cuts = engine.scheduler.burst_cuts  # type: ignore[attr-defined]
    assert not set(cuts) & {"rescore", "scoring"}, cuts
    assert [t for t, _ in cut] == [t for t, _ in single]
    assert [t for t, _ in inside] == [t for t, _ in single]
    assert engine.ring.num_prefetched > 0  # type: ignore[attr-defined]
    assert len(steps) < len(cut_steps)
    assert [len(t) for t, _ in inside] == [40, 33, 45]


@pytest.mark.parametrize("in_burst", [True, False], ids=["in-burst", "cut"])
def test_a_re_selection_follows_the_copy_from_its_own_step_whatever_the_burst(
    smol_tokenizer: Tokenizer, start_store: StartStore, in_burst: bool
) -> None:
    """Copy following (follow_copy) looks up the answer's last tokens as of the re-selection step itself: a burst's
    scoring step may be any of its steps (or its last), so the tokens the burst chose before it count. Every decode
    re-selection gets the same tail and end in bursts of 8 as in single steps, and the answers are the same."""
    address = start_store(host_kv_mib=64).address
    ring = ring_limits(8, page_size=16, rescore_interval=4, prefetch_steps=2, follow_copy=4, switch_in_burst=in_burst)
    kw = dict(num_slots=30, page_size=16, max_context=512, ring_chunk=32, store_address=address, ring=ring,
              lengths=(300, 170))  # fmt: skip
    params = [greedy(40), greedy(33)]
    calls: dict[int, list[tuple[object, ...]]] = {}
    runs = {}
    for burst in (1, 8):
        model = decode_model("llama", VOCAB)
        seen = calls.setdefault(burst, [])

        def spying(engine, seen: list[tuple[object, ...]] = seen) -> None:  # type: ignore[no-untyped-def]
            real = engine.ring.select_deferred

            def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
                seen.append((args[2], args[6], tuple(args[8])))
                return real(*args, **kwargs)

            engine.ring.select_deferred = spy

        got, _, _ = _burst_run(model, smol_tokenizer, burst, params, f"fc{burst}{in_burst}", on_engine=spying, **kw)
        runs[burst] = [t for t, _ in got]
    assert len(calls[1]) >= 10 and all(len(tail) == 4 for _, _, tail in calls[1])
    assert sorted(calls[8]) == sorted(calls[1])  # the same tails and ends, request by request (order: launches)
    assert runs[8] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("burst", [1, 4])
def test_captured_decode_through_the_ring_gives_the_uncaptured_tokens(
    model, start_store: StartStore, burst: int
) -> None:
    """The decode runner on CUDA with its steps captured (graphs sharing one pool, captured as buckets come)
    against the same runner without capture, through the ring: re-selections every 4 steps scored from the
    queries a step kept, prefetched 2 steps ahead, overlapped bursts, page ends, a sampled request whose
    tokens come from the logits read after each replay. Same tokens, request by request (a graph output read
    after another graph wrote over it would show here: run 13's kept queries did so at 8K, bench/RESULTS.md)."""
    import copy

    on_gpu = copy.deepcopy(model).to(device_or_skip("cuda"))
    address = start_store(host_kv_mib=32).address
    ring = ring_limits(8, rescore_interval=4, prefetch_steps=2)
    kw = dict(num_slots=26, ring=ring, ring_chunk=8, store_address=address, lengths=(61, 30, 45, 9), device="cuda")
    params = [greedy(40), greedy(33), SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
              greedy(44)]  # fmt: skip
    runs = {}
    for graphs in (True, False):
        got, _, engine = _burst_run(
            on_gpu, word_tokenizer(VOCAB), burst, params, f"g{graphs}{burst}", cuda_graphs=graphs, **kw
        )
        engine.stop()  # type: ignore[attr-defined]  # its host arena unregistered before the next engine's
        decode = engine.runner.decode  # type: ignore[attr-defined]
        assert (decode.num_replays > 0) == graphs and (decode.num_eager > 0) != graphs
        assert engine.ring.num_prefetched > 0  # type: ignore[attr-defined]
        if burst > 1:  # the greedy three finish one by one: the captured batch shrinks (4 -> 2 -> 1 rows)
            assert engine.scheduler.continue_leaves > 0  # type: ignore[attr-defined]
        runs[graphs] = [t for t, _ in got]
    assert [len(t) for t in runs[True]] == [40, 33, 30, 44]
    assert runs[True] == runs[False]


def _loop_until_done(engine, seqs: list[Sequence]) -> None:  # type: ignore[no-untyped-def]
    """What the engine thread does (poll, then step), by hand, until every sequence has finished."""
    for _ in range(1000):
        if all(s.is_finished for s in seqs):
            return
        engine.poll()
        engine.step()
        engine.slots.check_integrity()
    raise AssertionError("sequences did not finish")


def _chain_hook(engine, at: int, action) -> list[list[Work]]:  # type: ignore[no-untyped-def]
    """Record every launched step's works; `action()` runs when the `at`-th continued step is launched."""
    launched: list[list[Work]] = []
    real = engine.runner.launch

    def spy(works: list[Work]):  # type: ignore[no-untyped-def]
        launched.append(list(works))
        if works[0].on_device and sum(ws[0].on_device for ws in launched) == at:
            action()
        return real(works)

    engine.runner.launch = spy
    return launched


def test_a_request_arriving_during_overlapped_bursts_is_taken_in_at_the_next_burst(
    model, smol_tokenizer: Tokenizer
) -> None:
    """A chain of overlapped bursts ends when a request arrives: the next step admits it (its prefill runs
    while the first request is still decoding), and both answers are the references."""
    engine = make_engine(model, smol_tokenizer, num_slots=64, decode_burst=4)
    rng = random.Random(5)
    first_prompt, second_prompt = [rng.randrange(VOCAB) for _ in range(9)], [rng.randrange(VOCAB) for _ in range(6)]
    second: list[Sequence] = []
    launched = _chain_hook(engine, 2, lambda: second.append(engine.submit("late", second_prompt, greedy(8))))
    first = engine.submit("early", first_prompt, greedy(40))
    _loop_until_done(engine, [first])
    _loop_until_done(engine, second)
    continued = [i for i, ws in enumerate(launched) if ws[0].on_device]
    admitted = next(i for i, ws in enumerate(launched) if any(w.seq is second[0] for w in ws))
    assert admitted == continued[1] + 1  # the step after the burst in flight when it arrived
    # why the host scheduled a step itself, counted: here only where a request reached its max_tokens
    assert set(engine.scheduler.continue_declines) == {"token limit"}, engine.scheduler.continue_declines
    assert len(continued) > 2  # the first request's bursts overlapped again afterwards
    assert drain(events_of(first))[0] == reference_greedy(model, first_prompt, 40)
    assert drain(events_of(second[0]))[0] == reference_greedy(model, second_prompt, 8)


def test_an_abort_during_overlapped_bursts_ends_the_chain_and_drops_the_unread_tokens(
    model, smol_tokenizer: Tokenizer
) -> None:
    """Aborted while a burst is in flight behind the one being read: the request ends with ABORT after the
    tokens read so far (a prefix of the reference), its unread tokens are dropped and its slots come back."""
    engine = make_engine(model, smol_tokenizer, num_slots=64, decode_burst=4)
    prompt = [random.Random(6).randrange(VOCAB) for _ in range(9)]
    seq = engine.submit("aborted", prompt, greedy(40))
    _chain_hook(engine, 3, lambda: engine.abort(seq))
    _loop_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.finish_reason == FinishReason.ABORT  # type: ignore[union-attr]
    assert 0 < len(tokens) < 40 and tokens == reference_greedy(model, prompt, len(tokens))
    assert seq.num_pending == 0 and len(seq.output_ids) == len(tokens)
    assert engine.slots.num_available() == 64  # every slot free or cached (reusable)
