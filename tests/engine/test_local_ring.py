"""Local rings (services/engine/ring/local_ring.py): Gemma's sliding-window layers keep a small ring per running
sequence; only the global layers' K/V occupies pool slots. Row arithmetic, pool bytes, pages that
still carry every layer on the host, and engines (with and without a host store, with the KVMem ring)
whose greedy output equals the dense reference."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.kv.kv_formats import parse_format
from services.engine.kv.kv_pool import KVPool
from services.engine.ring.local_ring import LocalRings, LocalRingsExhaustedError, ParkedRing, ring_span
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import FinishReason
from tests.conftest import StartStore
from tests.engine.helpers import (
    drain,
    events_of,
    greedy,
    make_engine,
    reference_greedy,
    ring_limits,
    run_until_done,
    tiny_gemma,
)

VOCAB = 49152
PAGE = 4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def gemma() -> torch.nn.Module:
    return tiny_gemma(VOCAB, seed=7, window=8)  # layers S F S S F S: 4 local, 2 paged


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB) for _ in range(n)]


# -- row arithmetic --------------------------------------------------------------------------------


def test_ring_span_is_the_window_and_a_page_in_whole_pages() -> None:
    assert ring_span(window=512, page_size=64) == 576  # 512 + 63 -> 9 pages
    assert ring_span(window=500, page_size=64) == 576
    assert ring_span(window=8, page_size=4) == 12
    assert ring_span(window=2, page_size=64) == 128


def test_a_parked_ring_covers_the_window_before_any_later_position() -> None:
    rings = LocalRings({0: 8}, span=12, num_rings=2, page_size=PAGE)
    parked = ParkedRing(ring_id=0, end=43, tail=(1, 2, 3), written=43)  # computed 10 pages + 3 tokens: [31, 43)
    assert rings.covers(parked, 40) and rings.covers(parked, 43) and not rings.covers(parked, 44)
    assert not LocalRings({0: 8}, span=8, num_rings=1, page_size=PAGE).covers(parked, 40)  # [35, 43) lacks 33
    ahead = parked._replace(written=46)  # a burst wrote 3 positions past a stop: the ring holds [34, 43)
    assert rings.covers(ahead, 43) and not rings.covers(ahead, 40)  # 40's window starts at 33


def test_parked_rings_are_taken_by_their_page_and_reclaimed_oldest_first() -> None:
    rings = LocalRings({0: 8}, span=24, num_rings=3, page_size=PAGE)
    a, b, c = rings.allocate(), rings.allocate(), rings.allocate()
    rings.park(b"page-a", a, end=10, tail=(1, 2))
    rings.park(b"page-b", b, end=20, tail=())
    assert rings.num_free() == 2 and rings.num_parked == 2
    assert rings.take(b"page-b") == (b, 20, (), 20) and rings.take(b"page-b") is None
    assert rings.allocate() == a  # no free ring: the oldest parked one is reclaimed
    assert rings.take(b"page-a") is None and rings.num_free() == 0
    rings.park(b"page-c", c, end=5, tail=(3,))
    rings.park(b"page-c", b, end=6, tail=(4,))  # the same page again: the older ring is freed
    assert rings.num_parked == 1 and rings.take(b"page-c") == (b, 6, (4,), 6)
    assert rings.allocate() == c


def test_rings_are_handed_out_and_taken_back() -> None:
    rings = LocalRings({0: 8, 2: 8, 3: 6}, span=24, num_rings=2, page_size=PAGE)
    assert rings.layers == frozenset({0, 2, 3}) and rings.window == 8 and rings.windows == frozenset({6, 8})
    assert rings.num_rows == 48
    assert [rings.allocate(), rings.allocate()] == [0, 1]
    with pytest.raises(LocalRingsExhaustedError):
        rings.allocate()
    rings.release(0)
    assert rings.num_free() == 1 and rings.allocate() == 0


def test_positions_wrap_around_the_ring_and_pages_stay_contiguous() -> None:
    rings = LocalRings({0: 8}, span=24, num_rings=3, page_size=PAGE)
    assert rings.rows(1, torch.tensor([0, 5, 23, 24, 30])).tolist() == [24, 29, 47, 24, 30]
    assert [rings.page_row(2, p) for p in (0, 1, 5, 6, 7)] == [48, 52, 68, 48, 52]


# -- the pool ----------------------------------------------------------------------------------------


def _pool(local: LocalRings | None, num_slots: int = 6) -> KVPool:
    return KVPool(6, num_slots, PAGE, 2, 16, torch.float32, CPU, local=local)


def test_slots_hold_the_paged_layers_only() -> None:
    local = LocalRings({0: 8, 2: 8, 3: 8, 5: 8}, span=24, num_rings=2, page_size=PAGE)
    paged, full = _pool(local), _pool(None)
    layer_page = 2 * PAGE * 2 * 16 * 4  # K and V of one layer of one page: 512 bytes
    assert paged.paged_layers == (1, 4) and full.paged_layers == tuple(range(6))
    assert paged.page_nbytes == full.page_nbytes == 6 * layer_page  # the host copy keeps every layer
    assert paged.slot_nbytes == 2 * layer_page and full.slot_nbytes == 6 * layer_page
    assert paged.nbytes == 6 * 2 * layer_page
    assert paged.local_nbytes == 4 * 48 // PAGE * layer_page  # 4 layers x 48 rows
    assert paged.k[0].shape[0] == 48 and paged.k[1].shape[0] == 6 * PAGE


def _packed(page: torch.Tensor, parts: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([page[lo:hi] for lo, hi in parts])


def test_a_page_reads_its_local_rows_from_the_ring_and_restores_them() -> None:
    torch.manual_seed(0)
    local = LocalRings({0: 8, 2: 8, 3: 8, 5: 8}, span=24, num_rings=2, page_size=PAGE)
    pool = _pool(local)
    for t in (*pool.k, *pool.v):
        t.normal_()
    page = pool.read_page(slot=3, local=(1, 7))  # ring 1, page 7: rows 28..31 of the ring
    other = _pool(LocalRings({0: 8, 2: 8, 3: 8, 5: 8}, span=24, num_rings=2, page_size=PAGE))
    assert pool.slot_parts == pool.layer_parts((1, 4)) and len(pool.local_parts) == 3  # layers 0, 2-3, 5
    other.write_pages([5], _packed(page, pool.slot_parts)[None])  # a restore moves the slots' layers only
    other.write_local_pages([local.page_row(0, 2)], _packed(page, pool.local_parts)[None])  # ring 0, page 2
    for layer in range(6):
        if layer in local.layers:
            src, dst = slice(24 + 4, 24 + 8), slice(8, 12)
        else:
            src, dst = slice(3 * PAGE, 4 * PAGE), slice(5 * PAGE, 6 * PAGE)
        assert torch.equal(other.k[layer][dst], pool.k[layer][src]), layer
        assert torch.equal(other.v[layer][dst], pool.v[layer][src]), layer
    assert not other.k[1][: 5 * PAGE].any()  # the local layers' bytes did not land in the slots
    with pytest.raises(AssertionError):
        pool.read_page(3)  # a page of a local-ring pool needs its ring rows
    ring_pages = pool.read_pages([3, 1], (1, [7, 8]))  # two pages in one read: one row each
    assert torch.equal(ring_pages[0], page) and torch.equal(ring_pages[1], pool.read_page(slot=1, local=(1, 8)))
    for layer in local.layers:  # a prefill step finished pages 7 and 8: their local rows come from the stage
        pool.local_stage[(1, layer)] = (
            7 * PAGE, torch.full_like(pool.k[layer][: 2 * PAGE], 7.0), torch.full_like(pool.v[layer][: 2 * PAGE], 8.0)
        )  # fmt: skip
        pool.local_stage[(1, layer)][1][PAGE:] = 9.0  # page 8's K rows
    both = pool.read_pages([3, 1], (1, [7, 8])).view(torch.float32).view(2, 6, 2, PAGE, 2, 16)
    again = pool.read_page(slot=3, local=(1, 7)).view(torch.float32).view(6, 2, PAGE, 2, 16)
    assert torch.equal(both[0], again)
    assert (again[0, 0] == 7.0).all() and (again[0, 1] == 8.0).all() and (again[5, 0] == 7.0).all()
    assert (both[1, 0, 0] == 9.0).all() and (both[1, 3, 1] == 8.0).all()
    assert torch.equal(again[1, 0], pool.k[1][3 * PAGE : 4 * PAGE])  # a paged layer: from its slot
    assert torch.equal(both[1, 4, 1], pool.v[4][1 * PAGE : 2 * PAGE])
    with pytest.raises(AssertionError, match="only some staged"):
        pool.read_pages([3, 1], (1, [8, 9]))  # page 9 was not finished by the staging step


# -- engines -------------------------------------------------------------------------------------------


def test_engine_pool_with_local_rings_is_smaller_and_greedy_is_the_reference(gemma, smol_tokenizer: Tokenizer) -> None:
    with_rings = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8)
    without = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8, local_ring=False)
    assert with_rings.pool.slot_nbytes * 3 == without.pool.slot_nbytes  # 2 of 6 layers paged
    prompts = [_prompt(n, 10 + n) for n in (37, 5, 22)]
    outs = []
    for engine in (with_rings, without):
        seqs = [engine.submit(f"s{i}", p, greedy(14)) for i, p in enumerate(prompts)]
        run_until_done(engine, seqs)
        outs.append([drain(events_of(s))[0] for s in seqs])
        assert engine.pool.local is None or engine.pool.local.num_free() == engine.pool.local.num_rings
    assert outs[0] == outs[1] == [reference_greedy(gemma, p, 14) for p in prompts]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_stop_mid_burst_still_parks_the_ring_for_the_next_turn(
    gemma, smol_tokenizer: Tokenizer, overlap: bool
) -> None:
    """Turn 1 decodes in bursts (pages of 4, bursts up to the page end) and its stop token ends it mid-burst:
    the ring, written a position past the stop, is parked all the same (ParkedRing.written) and turn 2
    takes it over; its answer is the reference's. Overlapped, the burst launched after it ran into the next
    page, past the window the ring can hold for turn 2: freed, and turn 2 is computed afresh, as correctly."""
    engine = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8, decode_burst=4, decode_overlap=overlap)
    prompt = _prompt(41, 1)
    ref = reference_greedy(gemma, prompt, 4)
    assert ref[2] not in ref[:2]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=(ref[2],))
    first = engine.submit("t1", prompt, params)
    run_until_done(engine, [first])
    answer, done = drain(events_of(first))
    assert answer == ref[:3] and done.finish_reason == FinishReason.STOP  # type: ignore[union-attr]
    assert engine.pool.local is not None
    turn2 = prompt + answer + [5, 6, 7]
    if overlap:
        # the burst from position 41 ran to the page end and the next page's burst was on its way: the ring
        # no longer holds the window before position 40 (where turn 2 would take it over) and is freed
        assert engine.pool.local.num_parked == 0
    else:
        parked = next(iter(engine.pool.local._parked.values()))
        assert (parked.end, parked.written) == (43, 44)  # the burst from position 41 ran to the page end
    seq = engine.submit("t2", turn2, greedy(4))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    reused = (0, 0) if overlap else (43, 1)
    assert (done.cached_tokens, engine.scheduler.prefixes.num_local_reuses) == reused  # type: ignore[union-attr]
    assert tokens == reference_greedy(gemma, turn2, 4)


def test_the_next_turn_takes_the_parked_ring_and_the_tail_page(gemma, smol_tokenizer: Tokenizer) -> None:
    """No host store: turn 1's ring is parked under its last full page; turn 2 (history + answer + a new
    question) takes it over, with the start of the tail page: everything turn 1 computed is reused."""
    engine = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8)
    prompt = _prompt(41, 1)
    first = engine.submit("t1", prompt, greedy(3))
    run_until_done(engine, [first])
    answer = drain(events_of(first))[0]
    assert engine.pool.local is not None and engine.pool.local.num_parked == 1
    turn2 = prompt + answer + [5, 6, 7]
    seq = engine.submit("t2", turn2, greedy(4))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 43  # 41 + 3 - 1 (the last answer token was never fed): 10 pages + 3 tokens
    assert (engine.scheduler.prefixes.num_local_reuses, engine.scheduler.prefixes.num_local_fills) == (1, 0)
    assert tokens == reference_greedy(gemma, turn2, 4)
    other = engine.submit("t3", _prompt(30, 9) + prompt, greedy(2))  # no parked ring fits: computed afresh
    run_until_done(engine, [other])
    tokens, done = drain(events_of(other))
    assert done.cached_tokens == 0 and tokens == reference_greedy(gemma, _prompt(30, 9) + prompt, 2)


def test_a_prefix_without_its_ring_or_host_copy_is_recomputed(gemma, smol_tokenizer: Tokenizer) -> None:
    """The device still holds the prefix's global pages, but the parked ring was reclaimed by other
    sequences and there is no host copy: the prefix is computed again, and the answer is the reference."""
    engine = make_engine(gemma, smol_tokenizer, num_slots=64, prefill_chunk=8, max_running=2)
    prompt = _prompt(30, 1)
    run_until_done(engine, [engine.submit("t1", prompt, greedy(2))])
    others = [engine.submit(f"o{i}", _prompt(9, 20 + i), greedy(2)) for i in range(2)]
    run_until_done(engine, others)  # both rings in use at once: the parked one was reclaimed
    seq = engine.submit("t2", prompt + [5, 6, 7], greedy(4))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 0
    assert tokens == reference_greedy(gemma, prompt + [5, 6, 7], 4)


def test_a_reused_prefix_fills_the_ring_from_the_host_copy(
    gemma, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """Turn 2 on a second engine (every page from the host store): its ring gets the last pages' local rows
    from their host copies; on the first engine, the parked ring (and the tail page's first token)."""
    address = start_store(host_kv_mib=32).address
    first = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8, store_address=address)
    prompt = _prompt(41, 2)
    run_until_done(first, [first.submit("t1", prompt, greedy(3))])
    first.write_through.flush()
    turn2 = prompt + [901, 902, 903]
    second = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8, store_address=address)
    for engine, cached in ((first, 41), (second, 40)):  # 10 whole pages (+ 1 token of the tail page)
        seq = engine.submit("t2", turn2, greedy(6))
        run_until_done(engine, [seq])
        tokens, done = drain(events_of(seq))
        assert done.cached_tokens == cached
        assert tokens == reference_greedy(gemma, turn2, 6)
        engine.slots.check_integrity()
    assert second.scheduler.prefixes.num_host_restored == 10
    assert (first.scheduler.prefixes.num_local_reuses, second.scheduler.prefixes.num_local_fills) == (1, 1)
    for engine in (first, second):
        engine.stop()


def test_the_kvmem_ring_with_local_rings_matches_the_reference(
    gemma, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """An 8-page budget under 90 tokens (23 pages) with `exact`: global pages leave and come back, the
    sliding layers never need them (exact streams them through staging); two sequences share the pool and two rings."""
    address = start_store(host_kv_mib=32).address
    engine = make_engine(gemma, smol_tokenizer, num_slots=20, ring=ring_limits(budget_pages=8), ring_chunk=8,
                         prefill_chunk=8, store_address=address, default_policy="exact")  # fmt: skip
    prompts = [_prompt(90, 3), _prompt(70, 4)]
    seqs = [engine.submit(f"x{i}", p, greedy(10)) for i, p in enumerate(prompts)]
    engine.poll()
    engine.step()
    summaries = seqs[0].ring.summaries  # page summaries only for the paged (global) layers: 2 of 6
    assert summaries.layers == engine.pool.paged_layers == (1, 4) and summaries.kmin.shape[0] == 2
    run_until_done(engine, seqs)
    for seq, prompt in zip(seqs, prompts, strict=True):
        tokens, done = drain(events_of(seq))
        assert done.prefill_policy == "exact"
        assert tokens == reference_greedy(gemma, prompt, 10)
    assert engine.ring is not None and engine.ring.num_demotions > 0  # exact streamed them back from the host
    engine.stop()


def test_a_scoring_pass_leaves_the_local_rings_as_they_were(
    gemma, smol_tokenizer: Tokenizer, start_store: StartStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scoring pass of a sparse over-budget prompt's last chunk runs the chunk once for its queries only:
    it must not write the chunk's rows into the local rings, where they would overwrite the window before
    the chunk that the real pass of the same chunk reads next (a ring holds a window and a page less one
    token). On the real Gemma 3 270M that clobbering cost the ring passkeys at 16K and 30K (6/6 -> 2/6).
    Rings large enough for a chunk and its window (nothing a step writes reaches the window it reads) give
    the same logits."""
    import services.engine.engine as engine_module

    address = start_store(host_kv_mib=32).address
    logits: list[torch.Tensor] = []
    real_sample = engine_module.sample_batch

    def capture(rows, params):  # type: ignore[no-untyped-def]
        logits.append(rows.detach().clone())
        return real_sample(rows, params)

    monkeypatch.setattr(engine_module, "sample_batch", capture)
    runs = []
    for span in (0, 64):  # ring_span's 12 rows (window 8, page 4), then room for a chunk and its window
        engine = make_engine(gemma, smol_tokenizer, num_slots=20, ring=ring_limits(budget_pages=8), ring_chunk=8,
                             prefill_chunk=8, store_address=address, local_span=span)  # fmt: skip
        local = engine.pool.local
        assert local is not None
        scored: list[bool] = []
        real = engine.runner.run

        def spy(works, real=real, local=local, engine=engine, scored=scored):  # type: ignore[no-untyped-def]
            if not any(w.score_only for w in works):
                return real(works)
            before = [(engine.pool.k[i].clone(), engine.pool.v[i].clone()) for i in sorted(local.layers)]
            out = real(works)
            after = [(engine.pool.k[i], engine.pool.v[i]) for i in sorted(local.layers)]
            scored.append(
                all(torch.equal(a, b) for x, y in zip(before, after, strict=True) for a, b in zip(x, y, strict=True))
            )
            return out

        engine.runner.run = spy  # type: ignore[method-assign]
        logits.clear()
        seq = engine.submit("scored", _prompt(90, 11), greedy(4), namespace=f"span{span}")  # nothing shared
        run_until_done(engine, [seq])
        tokens, done = drain(events_of(seq))
        assert scored == [True]  # one scoring pass, nothing written to the rings
        assert len(tokens) == 4 and done.prefill_policy == "sparse"  # type: ignore[union-attr]
        runs.append((local.span, tokens, torch.cat(logits)))
        engine.stop()
    (small, tokens, ring_logits), (roomy, roomy_tokens, roomy_logits) = runs
    assert small < 8 + 8 <= roomy
    assert tokens == roomy_tokens
    torch.testing.assert_close(ring_logits, roomy_logits, rtol=0, atol=1e-5)


def _sparse_ring_answers(
    gemma, tokenizer: Tokenizer, address: str, span: int, scenario: str
) -> list[tuple[list[int], int]]:
    """Per request of the scenario (sparse ring over budget, a real store): (tokens, cached_tokens)."""
    limits = ring_limits(budget_pages=8, prefetch_steps=2 if scenario == "concurrent" else 0)
    engine = make_engine(gemma, tokenizer, num_slots=18, ring=limits, ring_chunk=8, prefill_chunk=8,
                         store_address=address, local_span=span, decode_burst=4)  # fmt: skip
    space = f"{scenario}-{span}"  # nothing shared between the two engines' runs
    out = []
    if scenario == "concurrent":  # two sequences share the pool, decode in bursts, re-select every 4 steps
        # (in effect 2 steps later, their host pages prefetched meanwhile)
        seqs = [engine.submit(f"c{i}", _prompt(n, 20 + i), greedy(24), namespace=space) for i, n in enumerate((90, 71))]
        run_until_done(engine, seqs)
        for seq in seqs:
            tokens, done = drain(events_of(seq))
            out.append((tokens, done.cached_tokens))  # type: ignore[union-attr]
        assert engine.ring is not None and engine.ring.num_prefetched > 0  # re-selections took prefetched pages
    else:  # multi-turn: turn 2 re-sends turn 1 and its answer (parked ring, pages from the device and host)
        prompt = _prompt(83, 31)
        for turn in range(2):
            seq = engine.submit(f"t{turn}", prompt, greedy(6), namespace=space)
            run_until_done(engine, [seq])
            tokens, done = drain(events_of(seq))
            out.append((tokens, done.cached_tokens))  # type: ignore[union-attr]
            prompt = prompt + tokens + _prompt(9, 40 + turn)
    engine.stop()
    return out


@pytest.mark.parametrize("scenario", ["concurrent", "multi-turn"])
def test_sparse_answers_do_not_depend_on_the_ring_size(
    gemma, smol_tokenizer: Tokenizer, start_store: StartStore, scenario: str
) -> None:
    """Sparse over-budget prompts have no dense reference (they attend a selection), but a local ring's
    size must never change an answer: a ring of ring_span's rows (a window and a page less one token)
    gives the tokens of one four times larger, where nothing a step writes reaches the window it reads.
    The guard against a step writing over rows a later step reads (a scoring pass did, see above)."""
    address = start_store(host_kv_mib=32).address
    small = _sparse_ring_answers(gemma, smol_tokenizer, address, 0, scenario)
    roomy = _sparse_ring_answers(gemma, smol_tokenizer, address, 48, scenario)
    assert [t for t, _ in small] == [t for t, _ in roomy]
    assert all(len(t) in (6, 24) for t, _ in small)
    if scenario == "multi-turn":
        assert small[1][1] > 0 and roomy[1][1] > 0  # turn 2 reused turn 1's pages


def test_preempted_sequences_take_their_parked_ring_back(gemma, smol_tokenizer: Tokenizer) -> None:
    """A pool too small for four sequences at once: the youngest are preempted (their rings parked under
    their last page) and re-admitted later, taking their own ring back; every answer is the reference."""
    engine = make_engine(gemma, smol_tokenizer, num_slots=14, prefill_chunk=8, max_running=4)
    prompts = [_prompt(n, 40 + n) for n in (21, 26, 17, 30)]
    seqs = [engine.submit(f"p{i}", p, greedy(14)) for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    assert engine.scheduler.num_preemptions >= 1
    assert engine.scheduler.prefixes.num_local_reuses >= 1  # a preempted sequence came back to its parked ring
    assert [drain(events_of(s))[0] for s in seqs] == [reference_greedy(gemma, p, 14) for p in prompts]
    assert engine.pool.local is not None and engine.pool.local.num_free() == engine.pool.local.num_rings


@pytest.mark.parametrize("kv_format", ["fp8", "int8+h", "nvfp4"])
def test_quantised_local_rings_hold_the_slots_bytes(kv_format: str) -> None:
    """Rows are quantised per token and head: the rows a sliding layer's ring stores (encode) are the very bytes
    a paged layer's slots store for the same K/V (write), and read back (decode) as the slots' gather does."""
    local = LocalRings({0: 8, 2: 8, 3: 8, 5: 8}, span=24, num_rings=2, page_size=PAGE)
    pool = KVPool(6, 8, PAGE, 2, 16, torch.float32, CPU, [parse_format(kv_format)] * 6, local=local)
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(7, 2, 16, generator=gen) * 3, torch.randn(7, 2, 16, generator=gen)
    rows = torch.tensor([5, 6, 7, 8, 9, 20, 21])
    pool.write(1, rows, k, v)  # layer 1: paged
    k_ring, v_ring = pool.encode(0, k, v)  # layer 0: in the rings
    assert torch.equal(k_ring, pool.k[1][rows]) and torch.equal(v_ring, pool.v[1][rows])
    k_back, v_back = pool.decode(0, k_ring, v_ring, torch.float32)
    k_slot, v_slot = pool.gather(1, rows, torch.float32)
    assert torch.equal(k_back, k_slot) and torch.equal(v_back, v_slot)
    assert not torch.equal(k_back, k)  # quantised: the check above is not one of plain copies


@pytest.mark.parametrize("kv_format", ["fp8", "int8+h", "nvfp4"])
def test_a_ring_filled_from_quantised_host_pages_continues_as_a_cold_prefill(
    gemma, smol_tokenizer: Tokenizer, start_store: StartStore, kv_format: str
) -> None:
    """A second engine that fills its ring from the first one's quantised host pages answers turn 2 exactly as an
    engine with local rings that prefills turn 2 cold in the same steps (the reused prefix ends on a chunk
    boundary, so every row is computed from the same inputs). Not against an engine with every layer paged:
    its sliding layers attend 16 rows, one masked, where the ring attends 15, an fp32 rounding difference
    (~1e-6) that can carry a quantised value across a rounding step (int8+h: one key of a global layer moved by
    1e-3), after which this tiny model's near-tied greedy tokens differ; the bytes themselves are checked above,
    and fp32 rings against slots by the engine tests above."""
    address = start_store(host_kv_mib=32).address
    prompt = _prompt(41, 60)  # 10 whole pages and one token: the reused prefix is 40 tokens, 5 chunks of 8
    turn2 = prompt + [901, 902, 903]
    cold = make_engine(gemma, smol_tokenizer, num_slots=40, prefill_chunk=8, kv_format=kv_format)
    seq = cold.submit("cold", turn2, greedy(6))
    run_until_done(cold, [seq])
    expected = drain(events_of(seq))[0]
    first = make_engine(
        gemma, smol_tokenizer, num_slots=40, prefill_chunk=8, store_address=address, kv_format=kv_format
    )
    seq = first.submit("t1", prompt, greedy(6))
    run_until_done(first, [seq])
    drain(events_of(seq))
    first.write_through.flush()
    second = make_engine(
        gemma, smol_tokenizer, num_slots=40, prefill_chunk=8, store_address=address, kv_format=kv_format
    )
    seq = second.submit("t2", turn2, greedy(6))
    run_until_done(second, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 40 and second.scheduler.prefixes.num_local_fills == 1
    assert tokens == expected
    for engine in (cold, first, second):
        engine.stop()


def test_local_rings_on_the_triton_tier(
    smol_tokenizer: Tokenizer, triton_tier: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernels (interpreted here, compiled on a GPU) write and read the rings: fused norms, the
    K/V rows written by the q/k norm + RoPE launch on decode steps (kv_sink: ring rows and slot rows),
    decode attention where the window is a page multiple (not tiny Gemma's 8)."""
    from services.engine.kernels.layer import norm_triton

    sinks: list[int] = []
    real = norm_triton.qk_norm_rope

    def counted(*args, kv_sink=None, **kwargs):  # type: ignore[no-untyped-def]
        if kv_sink is not None:
            sinks.append(int(kv_sink[0].shape[0]))  # the store's rows: a ring's or the slots'
        return real(*args, kv_sink=kv_sink, **kwargs)

    monkeypatch.setattr(norm_triton, "qk_norm_rope", counted)
    # the module's layers with a small vocabulary: the interpreted vocab head would take most of the test's time
    gemma = tiny_gemma(1024, seed=7, window=8)
    engine = make_engine(gemma, smol_tokenizer, num_slots=16, prefill_chunk=8)
    reference = make_engine(gemma, smol_tokenizer, num_slots=16, prefill_chunk=8, local_ring=False)
    rng = random.Random(70)
    prompt = [rng.randrange(100, 1024) for _ in range(11)]
    outs = []
    for e in (engine, reference):
        seq = e.submit("t", prompt, greedy(3))
        run_until_done(e, [seq])
        outs.append(drain(events_of(seq))[0])
    assert outs[0] == outs[1] == reference_greedy(gemma, prompt, 3)
    assert len(set(sinks)) == 2  # decode steps wrote local-ring rows and slot rows through the sink


def test_a_parked_ring_serves_a_prefix_ending_at_a_page_boundary(gemma, smol_tokenizer: Tokenizer) -> None:
    """Turn 1 computed 3 tokens past its last full page; a request that shares only the whole pages (it
    differs right after them) still finds the window before the page boundary in the parked ring."""
    engine = make_engine(gemma, smol_tokenizer, num_slots=32, prefill_chunk=8)
    prompt = _prompt(41, 5)
    run_until_done(engine, [engine.submit("t1", prompt, greedy(3))])  # computed 43 = 10 pages + 3
    other = prompt[:40] + [7, 7, 7, 7, 7]
    seq = engine.submit("t2", other, greedy(5))
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.cached_tokens == 40 and engine.scheduler.prefixes.num_local_reuses == 1
    assert tokens == reference_greedy(gemma, other, 5)
