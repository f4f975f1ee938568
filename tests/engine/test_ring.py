"""The ring on a tiny random model with a real kvstore: a sequence many times its resident budget.

- `exact` gives the same tokens as an unlimited pool (dense reference), through demotions and restores;
- `sparse` reports itself and is flagged unverified; the bucket identity holds at every step;
- two sequences share one pool, each within its budget.
"""

from __future__ import annotations

import logging
import random
import traceback

import pytest

from services.common.protos import engine_pb2 as pb
from services.common.tokenizer import Tokenizer
from services.engine.ring.ring import RingManager
from services.engine.server import EngineServicer
from services.engine.step.sequence import NOT_RESIDENT, Done, Failed
from tests.conftest import StartStore
from tests.engine.helpers import (
    drain,
    events_of,
    greedy,
    make_engine,
    random_prompt,
    reference_greedy,
    ring_limits,
    tiny_model,
)

VOCAB = 49152


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=11)


def _prompt(n: int, seed: int) -> list[int]:
    return random_prompt(n, seed, VOCAB)


def _run_checking_buckets(engine, seqs, max_steps: int = 5000) -> None:
    engine.poll()
    for _ in range(max_steps):
        if all(s.is_finished for s in seqs):
            return
        engine.step()
        engine.slots.check_integrity()
        for s in engine.scheduler.running:
            if s.ring is not None:
                resident = s.page_table.resident_pages()
                assert len(resident) <= engine.ring.limits.budget_pages, resident
                assert 0 in resident  # protect
                last = (s.num_computed - 1) // engine.ring.limits.page_size
                assert last in resident  # recent
                snap = engine.ring_snapshot  # what GetStats reports
                assert snap.protect >= 1 and snap.recent >= 1
                assert snap.protect + snap.skeleton + snap.evidence + snap.recent + snap.free == sum(
                    engine.ring.limits.budget_pages for r in engine.scheduler.running if r.ring is not None
                )
    raise AssertionError("sequences did not finish")


@pytest.mark.parametrize("held", [False, True], ids=["fetched", "held"])
def test_exact_policy_matches_the_unlimited_pool(
    model, smol_tokenizer: Tokenizer, store_address: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`held`: the host pages a chunk attends do not fit HOST_PAGES_ON_DEVICE, so they stay held in the store and
    each layer's staging batches read their bytes (HostPages.hold): the same tokens."""
    from services.engine.kv import kv_pool
    from services.engine.ring.host_pages import KVStoreHostPages

    holds: list[int] = []
    real_hold = KVStoreHostPages.hold
    monkeypatch.setattr(KVStoreHostPages, "hold", lambda self, h, d: holds.append(len(h)) or real_hold(self, h, d))
    if held:
        monkeypatch.setattr(kv_pool, "HOST_PAGES_ON_DEVICE", 1)
    limits = ring_limits(budget_pages=8)  # 32 tokens resident for a 90-token context
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address,
                         default_policy="exact")  # fmt: skip
    prompt = _prompt(70, 1)
    seq = engine.submit("exact", prompt, greedy(20))
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert isinstance(done, Done)
    assert tokens == reference_greedy(model, prompt, 20)
    assert done.prefill_policy == "exact" and not done.unverified
    assert engine.ring.num_demotions > 10
    assert bool(holds) == held and all(n > 0 for n in holds)


def test_sparse_policy_is_flagged_unverified(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address)  # fmt: skip
    seq = engine.submit("sparse", _prompt(70, 2), greedy(12))
    _run_checking_buckets(engine, [seq])
    _, done = drain(events_of(seq))
    assert done.prefill_policy == "sparse" and done.unverified
    assert done.completion_tokens == 12


def test_a_prompts_selections_are_fetched_ahead(
    model, smol_tokenizer: Tokenizer, store_address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With prefetch_steps, a prompt's selections' host pages reach the device in the background (prefetch_selection)
    as the decode re-selections' do: fewer restores on a step's path (here the final selection's two pages; the
    protect and recent pages the exact last chunk takes back stay on it), and the same tokens as with the prompt's
    selections restored on the step (prefetch_selection switched off)."""
    prompt = _prompt(150, 12)
    outputs, counts = [], []
    for ahead in (False, True):
        if not ahead:
            monkeypatch.setattr(RingManager, "prefetch_selection", lambda *a: None)
        else:
            monkeypatch.undo()
        limits = ring_limits(budget_pages=8, rescore_interval=4, prefetch_steps=2)
        engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8,
                             store_address=store_address)  # fmt: skip
        seq = engine.submit(f"ahead{ahead}", prompt, greedy(24))
        _run_checking_buckets(engine, [seq])
        outputs.append(drain(events_of(seq))[0])
        counts.append((engine.ring.num_restores, engine.ring.num_prefetched))
    assert outputs[0] == outputs[1] and len(outputs[0]) == 24
    (restored_before, fetched_before), (restored, fetched) = counts
    on_the_step, before = restored - fetched, restored_before - fetched_before
    assert restored > 10 and on_the_step <= 3 < before, counts


def test_prompt_within_budget_stays_resident_and_exact(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    engine = make_engine(model, smol_tokenizer, num_slots=16, ring=ring_limits(budget_pages=16), ring_chunk=8,
                         store_address=store_address)  # fmt: skip
    prompt = _prompt(30, 3)
    seq = engine.submit("fits", prompt, greedy(10))
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert tokens == reference_greedy(model, prompt, 10)
    assert done.prefill_policy == "resident" and not done.unverified


def test_two_sequences_share_one_pool(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    limits = ring_limits(budget_pages=8)
    engine = make_engine(model, smol_tokenizer, num_slots=16, ring=limits, ring_chunk=8, store_address=store_address,
                         default_policy="exact")  # fmt: skip
    prompts = [_prompt(60, 4), _prompt(45, 5)]
    seqs = [engine.submit(f"s{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    _run_checking_buckets(engine, seqs)
    for p, s in zip(prompts, seqs, strict=True):
        assert drain(events_of(s))[0] == reference_greedy(model, p, 10)
    assert engine.scheduler.num_preemptions == 0


@pytest.fixture(scope="module")
def gemma():
    from tests.engine.helpers import tiny_gemma

    return tiny_gemma(VOCAB, seed=5, window=8)


def test_gemma_sliding_layers_through_the_paged_engine(gemma, smol_tokenizer: Tokenizer) -> None:
    engine = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8)
    prompt = _prompt(37, 8)
    seq = engine.submit("g", prompt, greedy(12))
    _run_checking_buckets(engine, [seq])
    assert drain(events_of(seq))[0] == reference_greedy(gemma, prompt, 12)


def test_gemma_exact_ring_matches_the_unlimited_pool(gemma, smol_tokenizer: Tokenizer, store_address: str) -> None:
    engine = make_engine(gemma, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address, default_policy="exact")  # fmt: skip
    prompt = _prompt(70, 9)
    seq = engine.submit("g-exact", prompt, greedy(16))
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert tokens == reference_greedy(gemma, prompt, 16)
    assert done.prefill_policy == "exact"


def test_losing_a_store_replica_mid_request_recomputes_and_stays_correct(
    model, smol_tokenizer: Tokenizer, start_store: StartStore, redis_url: str
) -> None:
    """Two kvstore replicas behind the redis catalog; one is killed while an exact ring request runs.
    Its pages are gone: the engine recomputes what it lost and the answer equals the dense reference."""
    import signal
    import time

    from services.kvstore.cluster import KVStoreCluster

    prefix = f"kvmem-lose-{random.randrange(1 << 30)}:"
    stores = [start_store(host_kv_mib=16, prefix=prefix) for _ in range(2)]

    def cluster() -> KVStoreCluster:
        return KVStoreCluster(redis_url, prefix, refresh_s=0.2, stale_after_s=1.0)

    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         default_policy="exact", store_factory=cluster)  # fmt: skip
    prompt = _prompt(90, 21)
    seq = engine.submit("lose", prompt, greedy(16))
    engine.poll()
    for _ in range(6):  # part of the prefill: pages demoted to both replicas
        engine.step()
    assert engine.ring.num_demotions > 0
    stores[1].proc.send_signal(signal.SIGKILL)
    stores[1].proc.wait()
    time.sleep(1.5)
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert isinstance(done, Done)
    assert tokens == reference_greedy(model, prompt, 16)
    assert engine.scheduler.num_preemptions >= 1  # the recompute


def test_last_chunk_holds_the_whole_query(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    """Chunks are cut where the query starts, so the scoring pass reads the whole last user turn."""
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address)  # fmt: skip
    seen = []
    run = engine.runner.run
    engine.runner.run = lambda works: (seen.extend(works), run(works))[1]  # type: ignore[method-assign]
    prompt = _prompt(61, 31)
    seq = engine.submit("q", prompt, greedy(2), query_start=55)  # a boundary of 8 would split it at 56
    _run_checking_buckets(engine, [seq])
    scoring = [w for w in seen if w.score_only]
    assert len(scoring) == 1
    assert (scoring[0].start, scoring[0].num_new, scoring[0].score_tokens) == (55, 6, 6)


@pytest.mark.parametrize("held", [False, True], ids=["fetched", "held"])
def test_prefix_found_only_in_the_host_store_is_adopted_lazily(
    model, smol_tokenizer: Tokenizer, store_address: str, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second engine (empty device cache) sharing the kvstore reuses the first engine's pages:
    they join its page table as not resident, only the planned ones are restored, and the answer
    equals the dense reference. `held`: the adopted pages' summaries (and the exact chunks' host pages) read a
    layer at a time from pages held in the store (HostPages.hold)."""
    from services.engine.kv import kv_pool
    from services.engine.ring.host_pages import KVStoreHostPages

    holds: list[int] = []
    real_hold = KVStoreHostPages.hold
    monkeypatch.setattr(KVStoreHostPages, "hold", lambda self, h, d: holds.append(len(h)) or real_hold(self, h, d))
    if held:
        monkeypatch.setattr(kv_pool, "HOST_PAGES_ON_DEVICE", 1)
    first = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                        store_address=store_address, default_policy="exact")  # fmt: skip
    prompt = _prompt(70, 41 + held)
    seq = first.submit("turn1", prompt, greedy(4))
    _run_checking_buckets(first, [seq])
    first.write_through.flush()
    second = make_engine(model, smol_tokenizer, num_slots=8, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address, default_policy="exact")  # fmt: skip
    turn2 = prompt + [901, 902, 903]
    seq2 = second.submit("turn2", turn2, greedy(8))
    _run_checking_buckets(second, [seq2])
    tokens, done = drain(events_of(seq2))
    assert done.cached_tokens == 68  # the 17 whole prompt pages of 4, from the host store
    assert tokens == reference_greedy(model, turn2, 8)
    assert second.ring.num_restores < 17  # lazily: only what the plan wanted came to the device
    assert (17 in holds) == held and bool(holds) == held  # the 17 adopted pages, held at once


def _timeline(engine, seq, max_steps: int = 5000) -> list[tuple[int, frozenset[int]]]:
    """(tokens computed, evidence in effect) after every step, checking the buckets as it goes."""
    out = []
    engine.poll()
    for _ in range(max_steps):
        if seq.is_finished:
            return out
        engine.step()
        engine.slots.check_integrity()
        if seq.ring is not None:
            out.append((seq.num_computed, frozenset(seq.ring.evidence)))
    raise AssertionError("the sequence did not finish")


@pytest.mark.parametrize("burst", [1, 4])
def test_a_sparse_answer_does_not_depend_on_what_the_engine_ran_before(
    model, smol_tokenizer: Tokenizer, store_address: str, burst: int
) -> None:
    """Decode re-selections come every rescore_interval of the sequence's own decode steps, never of the
    engine's: the same over-budget request, first on a fresh engine and again after requests of other lengths,
    scores on the same decode steps (4, 8, 12, ...) and gives the same tokens."""
    limits = ring_limits(budget_pages=8, rescore_interval=4, prefetch_steps=2)
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address,
                         decode_burst=burst)  # fmt: skip
    scored: list[int] = []
    select_deferred = engine.ring.select_deferred

    def recording(r, *args, _sd=select_deferred):  # type: ignore[no-untyped-def]
        scored.append(r.scored_at)
        _sd(r, *args)

    engine.ring.select_deferred = recording  # type: ignore[method-assign]
    runs = []
    for i, (other, other_tokens) in enumerate([(0, 0), (45, 7), (70, 5)]):
        if other:  # something else first: the engine's own step count moves on by an odd amount
            seq = engine.submit(f"other{i}", _prompt(other, 90 + i), greedy(other_tokens), namespace=f"o{burst}-{i}")
            _timeline(engine, seq)
        scored.clear()
        seq = engine.submit(f"same{i}", _prompt(70, 61), greedy(22), namespace=f"s{burst}-{i}")  # no shared prefix
        _timeline(engine, seq)
        runs.append((drain(events_of(seq))[0], list(scored)))
    engine.stop()
    assert runs[0][1][:4] == [4, 8, 12, 16]
    assert runs[1] == runs[0] and runs[2] == runs[0]


@pytest.mark.parametrize("slow", [False, True], ids=["fast-store", "slow-store"])
@pytest.mark.parametrize("burst", [1, 4])
def test_decode_reselection_takes_effect_prefetch_steps_later_whatever_the_fetch_time(
    model, smol_tokenizer: Tokenizer, store_address: str, slow: bool, burst: int
) -> None:
    """With prefetch_steps 2 a decode re-selection is in effect exactly two decode steps after its scoring step;
    its host pages arrive through the background fetch (num_prefetched); a store 40 ms slow gives the same
    evidence timeline and the same tokens as a fast one (the schedule depends on steps, never on timing).
    Decode bursts of 4 (overlapped) end where a re-selection takes effect: the same timeline as single steps."""
    import time

    limits = ring_limits(budget_pages=8, rescore_interval=4, prefetch_steps=2)
    runs = {}
    for name in ("fast", "slow") if slow else ("fast",):
        engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address,
                             decode_burst=burst)  # fmt: skip
        ring = engine.ring
        made: list[tuple[int, frozenset[int]]] = []
        applied: list[int] = []
        select_deferred, apply_pending = ring.select_deferred, ring.apply_pending

        def recording_select(r, *args, _sd=select_deferred, _made=made):  # type: ignore[no-untyped-def]
            _sd(r, *args)
            _made.append((r.scored_at, frozenset(r.pending.evidence)))

        def recording_apply(r, force=False, _ap=apply_pending, _applied=applied):  # type: ignore[no-untyped-def]
            had = r.pending is not None
            _ap(r, force)
            if had and r.pending is None:
                _applied.append(r.decode_steps)

        ring.select_deferred, ring.apply_pending = recording_select, recording_apply
        if name == "slow":
            fetch_to = engine.runner.host.fetch_to

            def slow_fetch(*args, _f=fetch_to):  # type: ignore[no-untyped-def]
                time.sleep(0.04)
                return _f(*args)

            engine.runner.host.fetch_to = slow_fetch
        seq = engine.submit(f"prefetch-{name}", _prompt(70, 51), greedy(24), namespace=name)  # no shared prefix
        timeline = _timeline(engine, seq)
        tokens, done = drain(events_of(seq))
        assert done.completion_tokens == 24
        assert len(made) >= 4 and applied[: len(made) - 1] == [d + 2 for d, _ in made[: len(made) - 1]]
        assert ring.num_prefetched > 0  # chosen pages came back ahead of their step
        stats = EngineServicer(engine, None).GetStats(pb.GetStatsRequest(), None)  # type: ignore[arg-type]
        assert stats.prefetched_pages_total == ring.num_prefetched and stats.restores_total >= ring.num_prefetched
        runs[name] = (tokens, timeline, made)
        engine.stop()
    if slow:
        assert runs["slow"] == runs["fast"]


def test_voting_selection_runs_through_prefill_and_decode(model, smol_tokenizer: Tokenizer, store_address: str) -> None:
    """Per-head votes, recent pages out of the competition and anchored decode re-selections (issue 25) run
    through a real sparse prefill and decode re-selections, with the bucket identity checked every step."""
    limits = ring_limits(budget_pages=8, vote_top=2, anchor_pages=1, exclude_recent=True)
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address)
    seq = engine.submit("votes", _prompt(70, 6), greedy(12))
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.prefill_policy == "sparse" and done.unverified and len(tokens) == 12
    assert seq.ring is None and engine.ring.num_restores > 0


def test_copy_following_gets_the_prompt_and_the_answers_last_tokens(
    model, smol_tokenizer: Tokenizer, store_address: str
) -> None:
    """follow_copy through a real sparse prefill and decode: every decode re-selection is handed the prompt's ids
    and the sequence's last known tokens (the prompt's before the answer has that many), with the bucket identity
    checked every step."""
    limits = ring_limits(budget_pages=8, anchor_pages=1, follow_copy=4)
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address)
    prompt = _prompt(70, 8)
    seq = engine.submit("follow", prompt, greedy(14))
    calls: list[tuple[list[int], list[int]]] = []
    select = engine.ring.select

    def spy(ring, num_pages, request_id, step, end_tokens=0, prompt_ids=None, recent=()):  # noqa: ANN001, ANN202
        if prompt_ids is not None:
            calls.append((prompt_ids.tokens.tolist(), list(recent)))
            calls[-1][1].append(seq.known_outputs)
        return select(ring, num_pages, request_id, step, end_tokens, prompt_ids, recent)

    engine.ring.select = spy  # type: ignore[method-assign]
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.prefill_policy == "sparse" and len(tokens) == 14
    assert len(calls) >= 2  # re-selections every 4 decode steps
    for ids, (*recent, known) in calls:
        assert ids == prompt
        assert recent == (prompt + seq.output_ids[:known])[-4:]


@pytest.mark.parametrize("query_pass", ["attention", "exact"])
def test_attention_query_pass_runs_through_prefill_and_decode(
    model, smol_tokenizer: Tokenizer, store_address: str, query_pass: str
) -> None:
    """The prompt's selection by real attention (issue 25): `attention` runs a scoring pass that streams the host
    pages, `exact` none (the last chunk itself attends every page); both select from per-head masses, keep the
    bucket identity at every step and decode with re-selections."""
    limits = ring_limits(budget_pages=8, query_pass=query_pass, head_fusion="norm", anchor_pages=1, score_from=0.5)
    engine = make_engine(model, smol_tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address)
    seen: list = []
    run = engine.runner.run

    def spy(works):  # type: ignore[no-untyped-def]
        seen.extend((w.score_only, w.exact_query, w.score_tokens) for w in works)
        return run(works)

    engine.runner.run = spy  # type: ignore[method-assign]
    anchors: list[list[int]] = []
    rows: list[int] = []
    select = engine.ring.select

    def record(ring, *args, **kwargs):  # type: ignore[no-untyped-def]
        per_head = ring.scores is not None and ring.scores.dim() == 2
        if per_head:
            rows.append(ring.scores.shape[0])
        select(ring, *args, **kwargs)
        if per_head:
            anchors.append(list(ring.anchor))

    engine.ring.select = record  # type: ignore[method-assign]
    seq = engine.submit("q", _prompt(70, 7), greedy(10), query_start=62)
    _run_checking_buckets(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.prefill_policy == "sparse" and done.unverified and len(tokens) == 10
    exact_works = [w for w in seen if w[1]]
    assert len(exact_works) == 1 and exact_works[0][2] == 70 - 62  # scored: the query span, 62 to the end
    assert exact_works[0][0] == (query_pass == "attention")  # a scoring pass only for `attention`
    assert sum(1 for w in seen if w[0]) == (1 if query_pass == "attention" else 0)
    assert len(anchors) == 1 and anchors[0] and 0 not in anchors[0]  # one per-head selection; the sink excluded
    cfg = model.config  # score_from 0.5: only the upper half of the layers' heads rank pages
    assert rows == [(cfg.num_layers - cfg.num_layers // 2) * cfg.num_heads]
    assert engine.ring.num_restores > 0


@pytest.mark.parametrize("burst", [1, 4])
def test_decode_reselections_restore_nothing_on_the_steps_path(
    model, smol_tokenizer: Tokenizer, store_address: str, burst: int
) -> None:
    """Every page a decode re-selection will restore is fetched ahead (RingManager._to_prefetch), also one
    still in the device prefix cache or kept only by the recent window when it is chosen: a restore on the
    step's path waits for the store and, on CUDA, for the burst in flight (it broke the overlapped bursts at
    32 sessions). The prefetch changes where the bytes come from, never what is attended: the same tokens and
    evidence timeline as with no prefetch at all (every page restored in its step)."""
    limits = ring_limits(budget_pages=8, rescore_interval=4, prefetch_steps=4)  # a page of steps
    runs = {}
    for name in ("prefetch", "in-step"):
        engine = make_engine(model, smol_tokenizer, num_slots=12, ring=limits, ring_chunk=8,
                             store_address=store_address, decode_burst=burst)  # fmt: skip
        ring = engine.ring
        if name == "in-step":
            ring._prefetcher = None  # the chosen pages are restored by the step that takes them in
        in_step: list[int] = []
        restore = ring._restore

        def counting(slot_ids, page_hashes, pages, r, _restore=restore, _in_step=in_step):  # type: ignore[no-untyped-def]
            if r.decode_steps:  # decode (the prompt's own selection is restored in its first decode step)
                _in_step.extend(p for p in pages if page_hashes[p] not in r.prefetched)
            _restore(slot_ids, page_hashes, pages, r)

        ring._restore = counting  # type: ignore[method-assign]
        seq = engine.submit(f"restore-{name}", _prompt(70, 52), greedy(40), namespace=f"{name}-{burst}")
        timeline = _timeline(engine, seq)
        tokens, done = drain(events_of(seq))
        assert done.completion_tokens == 40
        runs[name] = (tokens, timeline, len(in_step))
        engine.stop()
    assert runs["prefetch"][:2] == runs["in-step"][:2]
    assert runs["in-step"][2] > 0  # decode re-selections did restore pages
    assert runs["prefetch"][2] == 0, runs["prefetch"][2]


def test_room_making_fails_on_a_table_that_does_not_match_its_plan(
    model, smol_tokenizer: Tokenizer, store_address: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A materialize that leaves one page too many resident breaks the invariant: the scheduler's check
    catches it, and the engine fails the request (`internal`, the check's traceback logged) instead of running on
    a broken table or ending its loop."""
    engine = make_engine(model, smol_tokenizer, num_slots=12, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         store_address=store_address)  # fmt: skip
    ring = engine.ring
    materialize = ring.materialize

    def leaky(slot_ids, page_hashes, keep, r):  # type: ignore[no-untyped-def]
        materialize(slot_ids, page_hashes, keep, r)
        spare = [p for p in range(len(slot_ids)) if p not in keep and slot_ids[p] == NOT_RESIDENT]
        if spare:  # a demoted page keeps (gets back) a slot
            slot_ids[spare[0]] = ring.slots.allocate()

    ring.materialize = leaky  # type: ignore[method-assign]
    seq = engine.submit("broken", _prompt(70, 9), greedy(8))
    with caplog.at_level(logging.ERROR, logger="services.engine.engine"):
        _run_checking_buckets(engine, [seq])
    last = drain(events_of(seq))[1]
    assert isinstance(last, Failed) and last.code == "internal", last
    logged = [r.exc_info for r in caplog.records if r.exc_info and r.exc_info[0] is AssertionError]
    assert logged, caplog.text
    assert traceback.extract_tb(logged[0][2])[-1].filename.endswith("scheduler.py")  # the room-making's own check
    engine.stop()
