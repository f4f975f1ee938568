"""The decode runner (services/engine/step/decode_graph.py) against StepAttention and the dense reference.

CPU (fp32, eager): the runner's logits equal StepAttention's (max |diff| < 1e-4 on logits whose
spread is several units), and greedy decoding equals tests/engine/helpers.reference_greedy, for tiny
Llama and tiny Gemma (sliding window 8 over pages of 4: the local read set is exercised; and again
with the sliding layers in local rings, `gemma-local`), batches of
1-3 sequences of different lengths on scattered slots, and a ring sequence with pages that are not
resident (gaps). Engine level: greedy output with the decode runner equals output without it, with
and without the ring. A decode burst on the runner (tokens chosen on the device) equals single steps
(engine-level bursts and overlapped bursts: test_decode_bursts.py). GPU (`gpu` marker): a captured graph
replayed equals the eager step, for several batch and window buckets and after the page table changed; a
captured burst equals eager steps; captured scoring steps give the uncaptured runner's page scores.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.kv.attention import PAD_POS
from services.engine.kv.kv_formats import parse_format
from services.engine.kv.kv_pool import KVPool
from services.engine.ring.local_ring import LocalRings, ring_span
from services.engine.ring.state import SeqRing
from services.engine.ring.summaries import PageSummaries
from services.engine.step.decode_graph import DecodeGraphs, batch_bucket, window_bucket
from services.engine.step.model_runner import ModelRunner
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import NOT_RESIDENT, Sequence
from services.engine.step.work import Switch, Work
from tests.conftest import StartStore
from tests.engine.helpers import (
    DECODE_MODELS,
    decode_model,
    drain,
    events_of,
    greedy,
    make_engine,
    reference_greedy,
    ring_limits,
    run_until_done,
    tiny_gemma,
)

VOCAB = 256
PAGE = 4
ATOL = 1e-4
# fp8 rows read with fp16 dots (decode_attention_triton.fp8_dot): each attention output carries the fp16 rounding of
# its weights (within 2^-11 of the mean |v|: test_decode_attention.py) through the layers into the logits (|x| < ~5
# here): 5.7e-3 seen on the tiny models, a fifth of this
FP16_DOT_ATOL = 3e-2
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=DECODE_MODELS)
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return decode_model(request.param, VOCAB)


def _seq(prompt: list[int], name: str) -> Sequence:
    from services.engine.step.detokenizer import Detokenizer

    return Sequence(
        request_id=name, prompt_ids=prompt, params=SamplingParams(temperature=0.0), namespace="",
        max_tokens=64, stop_token_ids=frozenset(), detokenizer=Detokenizer(None, ()),  # type: ignore[arg-type]
        generator=None,
    )  # fmt: skip


class Harness:
    """Sequences on scattered slots of one pool, prefilled by StepAttention, then decoded step by step."""

    def __init__(self, model: torch.nn.Module, lengths: list[int], num_slots: int = 96, seed: int = 0,
                 device: torch.device = CPU, capture: bool = False, kv_format: str = "") -> None:  # fmt: skip
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        local = None
        if getattr(model, "test_local_rings", False):
            windows = {i: w for i, w in enumerate(cfg.layer_windows) if w is not None}
            local = LocalRings(windows, ring_span(max(windows.values()), PAGE), 4, PAGE)
        formats = [parse_format(kv_format)] * cfg.num_layers if kv_format else None
        self.pool = KVPool(cfg.num_layers, num_slots, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, device, formats,
                           local=local)  # fmt: skip
        self.step_runner = ModelRunner(model, self.pool, device, decode_runner=False)
        self.graphs = DecodeGraphs(model, self.pool, device, max_batch=4, capture=capture)
        rng = random.Random(seed)
        free = list(range(num_slots))
        rng.shuffle(free)
        self.seqs: list[Sequence] = []
        for i, n in enumerate(lengths):
            prompt = [rng.randrange(VOCAB) for _ in range(n)]
            seq = _seq(prompt, f"s{i}")
            seq.page_table.slot_ids = [free.pop() for _ in range(-(-(n + 24) // PAGE))]
            seq.local_ring = local.allocate() if local is not None else -1
            self.seqs.append(seq)
        self.model = model
        logits, _ = self.step_runner.run([Work(s, 0, len(s.prompt_ids)) for s in self.seqs])
        for s, row in zip(self.seqs, logits, strict=True):
            s.num_computed = len(s.prompt_ids)
            s.output_ids.append(int(row.argmax()))

    def works(self) -> list[Work]:
        return [Work(s, s.num_computed, 1) for s in self.seqs]

    def advance(self, logits: torch.Tensor) -> None:
        for s, row in zip(self.seqs, logits, strict=True):
            s.num_computed += 1
            s.output_ids.append(int(row.argmax()))


@pytest.mark.parametrize("lengths", [[13], [5, 22], [9, 30, 17]])
def test_eager_runner_matches_step_attention_and_reference(model, lengths: list[int]) -> None:
    h = Harness(model, lengths)
    for _ in range(12):  # crosses page boundaries: rows are rebuilt, cached rows reused in between
        works = h.works()
        assert h.graphs.accepts(works)
        expected, _ = h.step_runner.run(works)  # writes the same K/V into the same rows first
        got = h.graphs.run(works)
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() < ATOL
        assert expected.std().item() > 1.0  # the tolerance is small next to the logits' spread
        h.advance(got)
    for s in h.seqs:
        assert s.output_ids == reference_greedy(h.model, s.prompt_ids, len(s.output_ids))
    assert h.graphs.num_eager == 12 and h.graphs.num_replays == 0


def test_ring_sequence_with_gaps_matches_step_attention(model) -> None:
    """Pages 1-3 and 6 are not resident: both paths skip them; page summaries stay current."""
    h = Harness(model, [34, 11])
    cfg = model.config
    ring_seq = h.seqs[0]
    summaries = PageSummaries(cfg.num_layers, 32, cfg.num_kv_heads, cfg.head_dim, h.pool.device)
    ring_seq.ring = SeqRing(summaries=summaries, policy="sparse", query_start=0)
    for p in (1, 2, 3, 6):
        ring_seq.page_table.slot_ids[p] = NOT_RESIDENT
    filled = []
    for _ in range(10):
        works = h.works()
        assert h.graphs.accepts(works)
        fills = (ring_seq.num_computed + 1) % PAGE == 0
        summaries.kmin.zero_()  # StepAttention refreshed them last step: make the check meaningful
        summaries.kmax.zero_()
        got = h.graphs.run(works)
        if fills:  # the page this step filled has its summary, from its keys in the pool
            page = ring_seq.num_computed // PAGE
            slot = ring_seq.page_table.slot_ids[page]
            filled.append(page)
            for layer in h.pool.paged_layers:
                keys = h.pool.gather_keys(layer, torch.arange(slot * PAGE, (slot + 1) * PAGE))
                assert torch.equal(summaries.kmin[layer, page], keys.amin(0))
                assert torch.equal(summaries.kmax[layer, page], keys.amax(0))
        else:  # no summary work on the other steps
            assert not summaries.kmax.any()
        expected, _ = h.step_runner.run(works)
        assert (got - expected).abs().max().item() < ATOL
        h.advance(got)
    assert filled, "the run must fill a page"
    other = h.seqs[1]  # its neighbour in the batch is unaffected by the gaps
    assert other.output_ids == reference_greedy(h.model, other.prompt_ids, len(other.output_ids))


def _attach_ring(h: Harness) -> Sequence:
    """Harness sequence 0 becomes a ring sequence with summaries of its computed pages (page scoring)."""
    cfg = h.model.config
    seq = h.seqs[0]
    summaries = PageSummaries(cfg.num_layers, 64, cfg.num_kv_heads, cfg.head_dim, h.pool.device, h.pool.paged_layers)
    seq.ring = SeqRing(summaries=summaries, policy="sparse", query_start=0)
    pages = seq.num_computed // PAGE
    rows = h.pool.rows(torch.tensor(seq.page_table.slot_ids[:pages], device=h.pool.device))
    valid = torch.ones(pages, PAGE, dtype=torch.bool, device=h.pool.device)
    for layer in h.pool.paged_layers:
        summaries.update_from_pool(layer, torch.arange(pages, device=h.pool.device), h.pool, rows, valid)
    return seq


@pytest.mark.parametrize("scales", ["one", "per-layer"])
def test_scoring_decode_step_gives_step_attentions_page_scores(model, scales: str) -> None:
    """A re-selecting decode step runs on the runner; its page scores, from the queries the step kept,
    every layer in one call, equal StepAttention's for the same token (which scores inside its attention
    pass, layer by layer), also when the layers' attention scales differ."""
    if scales == "per-layer":
        model = copy.deepcopy(model)
        for i, layer in enumerate(model.layers):
            layer.self_attn.scale *= 1.0 + 0.5 * i
    h = Harness(model, [30, 13])
    cfg = model.config
    ring_seq = _attach_ring(h)
    pages = ring_seq.num_computed // PAGE
    works = [Work(ring_seq, ring_seq.num_computed, 1, score_tokens=1), Work(h.seqs[1], h.seqs[1].num_computed, 1)]
    assert h.graphs.accepts(works)
    h.graphs.run(works)
    got = h.graphs.page_scores(works)
    _, expected = h.step_runner.run(works)
    assert got[1] is None and expected[1] is None
    assert got[0] is not None and expected[0] is not None and got[0].shape == (pages,)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-4, atol=1e-5)
    num_paged = len(h.pool.paged_layers)  # local-ring layers are not scored
    assert got[0].sum().item() == pytest.approx(num_paged * cfg.num_heads, rel=1e-4)  # unit mass per head


def test_exact_ring_sequence_with_host_pages_is_refused(model) -> None:
    h = Harness(model, [20])
    cfg = model.config
    seq = h.seqs[0]
    seq.ring = SeqRing(PageSummaries(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, h.pool.device), "exact", 0)
    assert h.graphs.accepts(h.works())
    seq.page_table.slot_ids[1] = NOT_RESIDENT
    assert not h.graphs.accepts(h.works())
    assert not h.graphs.accepts([Work(seq, seq.num_computed, 1, score_tokens=1)])


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 16)] == [1, 2, 4, 8, 16]
    assert [window_bucket(n) for n in (1, 256, 257, 4096, 4097)] == [256, 256, 512, 4096, 8192]


def _engine_outputs(model, tokenizer: Tokenizer, decode_runner: bool, **kw: object) -> tuple[list[list[int]], int]:
    engine = make_engine(model, tokenizer, **kw)  # type: ignore[arg-type]
    if not decode_runner:
        engine.runner.decode = None
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (7, 30, 19)]
    # a namespace per run: the second run must not adopt the first one's pages from the host store
    seqs = [engine.submit(f"r{i}", p, greedy(20), namespace=f"runner-{decode_runner}") for i, p in enumerate(prompts)]
    run_until_done(engine, seqs)
    outs = []
    for s in seqs:
        tokens, done = drain(events_of(s))
        assert done.completion_tokens == 20, done
        outs.append(tokens)
    used = engine.runner.decode.num_eager if engine.runner.decode is not None else 0
    return outs, used


def test_engine_greedy_is_the_same_with_and_without_the_decode_runner(model, smol_tokenizer: Tokenizer) -> None:
    with_runner, used = _engine_outputs(model, smol_tokenizer, True, num_slots=64)
    without, _ = _engine_outputs(model, smol_tokenizer, False, num_slots=64)
    assert used >= 15  # the 3 sequences decode together: most of their 19 decode steps ran in the runner
    assert with_runner == without


def test_ring_engine_greedy_is_the_same_with_and_without_the_decode_runner(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """A 12-page budget under prompts of up to 30 tokens + 20 new: pages leave, evidence is re-selected
    every 4 decode steps (those steps run StepAttention), the rest runs in the decode runner."""
    address = start_store(host_kv_mib=32).address
    kw = dict(num_slots=40, ring=ring_limits(8, rescore_interval=4), ring_chunk=8, store_address=address)
    with_runner, used = _engine_outputs(model, smol_tokenizer, True, **kw)
    without, _ = _engine_outputs(model, smol_tokenizer, False, **kw)
    assert used >= 12  # the re-selection steps (1 in 4, aligned across sequences) ran StepAttention
    assert with_runner == without


# -- decode bursts on the runner (engine-level bursts: test_decode_bursts.py) ---------------------------


def _burst_equals_single_steps(model: torch.nn.Module, device: torch.device, capture: bool) -> DecodeGraphs:
    """Bursts of a whole page (tokens chosen on the device) equal single steps with the argmax on the host."""
    burst = Harness(model, [8, 32], num_slots=256, device=device, capture=capture)  # both start on a page
    single = Harness(model, [8, 32], num_slots=256, device=device, capture=False)
    for _ in range(3):
        works = [Work(s, s.num_computed, 1, num_steps=PAGE) for s in burst.seqs]
        assert burst.graphs.accepts(works)
        burst.graphs.run(works)
        chosen = burst.graphs.tokens_to_host(2, PAGE)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the copy is queued behind the burst (ModelRunner waits on an event)
        for s, tokens in zip(burst.seqs, chosen.tolist(), strict=True):
            s.num_computed += PAGE
            s.output_ids.extend(tokens)
        for _ in range(PAGE):
            single.advance(single.graphs.run(single.works()))
    assert [s.output_ids for s in burst.seqs] == [s.output_ids for s in single.seqs]
    assert all(len(s.output_ids) == 1 + 3 * PAGE for s in burst.seqs)
    return burst.graphs


def test_runner_burst_equals_single_steps(model) -> None:
    graphs = _burst_equals_single_steps(model, CPU, capture=False)
    assert graphs.num_eager == 3 * PAGE


def _use_triton_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's step on the Triton decode-attention and advance kernels (interpreted on the CPU; the model's
    other kernels stay torch)."""
    import importlib

    from services.engine.step import decode_graph, graph_attention

    def kernels(name: str, device: torch.device) -> object:
        wanted = ("attention.decode_attention_triton", "layer.step_triton")
        return importlib.import_module(f"services.engine.kernels.{name}") if name in wanted else None

    for module in (decode_graph, graph_attention):
        monkeypatch.setattr(module, "triton_module", kernels)


@pytest.mark.parametrize(("switch_at", "score_at", "kernels"), [(1, 2, "torch"), (3, 0, "torch"), (1, 2, "triton")])
def test_burst_that_switches_and_scores_mid_burst_equals_single_steps(
    model, kernels: str, switch_at: int, score_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of a page (4 steps) of three sequences (batch bucket 4: a padding row repeats sequence 0):
    sequence 0 (a ring) switches its read set at step `switch_at` (pages 1 and 2 leave, page 5 joins) and
    scores at step `score_at`; sequence 2's switch is at the burst's first step (it reads without page 0
    throughout) and it scores at the last step (score_pos -1); sequence 1 neither. Tokens, the last step's
    logits, the kept queries (sequence 0's from step `score_at`, the others' from the last step) and sequence
    0's page scores equal single steps on page tables that lack the joining page before the switch and the
    leaving pages from it on; after the burst sequence 0's row holds the after-set and is rewritten next.
    `kernels`: the Triton decode-attention kernel keeps the queries (its keep_pos) and the Triton advance kernel
    switches the rows (interpreted: a few seconds, so once, and not over local rings, whose kernel keeps none)."""
    if kernels == "triton":
        if getattr(model, "test_local_rings", False):
            pytest.skip("the paged layers are tiny Gemma's, run without local rings")
        _use_triton_step(monkeypatch)
    lengths = [32, 12, 20]  # every sequence starts on a page: the burst fills it
    burst, single = Harness(model, lengths, seed=3), Harness(model, lengths, seed=3)
    for h in (burst, single):
        _attach_ring(h)
    starts = [s.num_computed for s in burst.seqs]
    switch0 = Switch(starts[0] + switch_at, leaving=frozenset({1, 2}), joining=frozenset({5}))
    switch2 = Switch(starts[2], leaving=frozenset({0}), joining=frozenset())
    seq0, seq1, seq2 = burst.seqs
    works = [
        Work(seq0, starts[0], 1, score_tokens=1, num_steps=PAGE, score_pos=starts[0] + score_at, switch=switch0),
        Work(seq1, starts[1], 1, num_steps=PAGE),
        Work(seq2, starts[2], 1, score_tokens=1, num_steps=PAGE, switch=switch2),
    ]
    assert burst.graphs.accepts(works)
    logits = burst.graphs.run(works)
    tokens = burst.graphs.tokens_to_host(3, PAGE)
    kept = burst.graphs._last.queries[:, :3].clone()  # type: ignore[union-attr]
    scores = burst.graphs.page_scores(works)
    assert scores[1] is None and scores[2] is None  # sequence 2 has no ring: nothing to score

    slots0, slots2 = (list(s.page_table.slot_ids) for s in (single.seqs[0], single.seqs[2]))
    single.seqs[2].page_table.slot_ids[0] = NOT_RESIDENT
    want_kept = torch.empty_like(kept)
    want_scores = None
    for step in range(PAGE):
        table = single.seqs[0].page_table.slot_ids
        table[:] = slots0
        for page in switch0.joining if step < switch_at else switch0.leaving:
            table[page] = NOT_RESIDENT
        step_works = single.works()
        if step == score_at:
            step_works[0] = Work(single.seqs[0], step_works[0].start, 1, score_tokens=1)
        want_logits = single.graphs.run(step_works)
        queries = single.graphs._last.queries[:, :3]  # type: ignore[union-attr]
        if step == score_at:
            want_kept[:, 0] = queries[:, 0]
            want_scores = single.graphs.page_scores(step_works)[0]
        if step == PAGE - 1:
            want_kept[:, 1:] = queries[:, 1:]
        single.advance(want_logits)
    assert tokens.tolist() == [s.output_ids[-PAGE:] for s in single.seqs]
    assert (logits - want_logits).abs().max().item() < ATOL
    torch.testing.assert_close(kept, want_kept, rtol=1e-5, atol=1e-5)
    assert scores[0] is not None and want_scores is not None
    torch.testing.assert_close(scores[0], want_scores, rtol=1e-4, atol=1e-5)

    bufs = burst.graphs._last
    assert bufs is not None and bufs.owners[0] is None and bufs.owners[3] is None  # switched: rewritten next
    after = [p for p in range(starts[0] // PAGE + 1) if p not in switch0.leaving]
    want_rows = torch.tensor([slots0[p] * PAGE + r for p in after for r in range(PAGE)])
    assert torch.equal(bufs.rows[0, : len(want_rows)].cpu(), want_rows)
    assert (bufs.key_pos[0, len(want_rows) :] == PAD_POS).all()
    assert bufs.owners[1] is not None and bufs.owners[2] is not None  # no switch inside the burst: reused


# -- GPU: capture and replay ---------------------------------------------------------------------------


def _gpu_model(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(model).to("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lengths", [[13], [5, 22, 300], [9, 30, 17, 70]])
def test_replay_equals_eager(model, lengths: list[int]) -> None:
    m = _gpu_model(model)
    dev = torch.device("cuda")
    cap = Harness(m, lengths, num_slots=256, device=dev, capture=True)
    ref = Harness(m, lengths, num_slots=256, device=dev, capture=False)
    for step in range(10):
        got = cap.graphs.run(cap.works()).clone()
        expected = ref.graphs.run(ref.works())
        assert torch.allclose(got, expected, rtol=0, atol=1e-5), (step, (got - expected).abs().max().item())
        cap.advance(got)
        ref.advance(expected)
        if step == 4:  # the page table changes: a page moves to a free slot (both harnesses)
            for h in (cap, ref):
                s = h.seqs[-1]
                used = {x for q in h.seqs for x in q.page_table.slot_ids}
                dst = next(x for x in range(h.pool.num_slots) if x not in used)
                h.pool.copy_rows(s.page_table.slot_ids[1], dst, PAGE)
                s.page_table.slot_ids[1] = dst
    assert cap.graphs.num_replays >= 8 and cap.graphs.num_captures >= 1
    assert [s.output_ids for s in cap.seqs] == [s.output_ids for s in ref.seqs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_burst_equals_eager_steps(model) -> None:
    m = _gpu_model(model)
    graphs = _burst_equals_single_steps(m, torch.device("cuda"), capture=True)
    assert graphs.num_captures == 1 and graphs.num_replays == 3 * PAGE - 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batch_and_window_buckets_each_capture_once(model) -> None:
    m = _gpu_model(model)
    h = Harness(m, [5, 600, 40], num_slots=512, device=torch.device("cuda"), capture=True)
    ref = Harness(m, [5, 600, 40], num_slots=512, device=torch.device("cuda"), capture=False)
    for subset in ([0], [0, 2], [0, 1, 2], [0], [0, 1, 2]):
        works = [h.works()[i] for i in subset]
        expected = ref.graphs.run([ref.works()[i] for i in subset])
        got = h.graphs.run(works)
        assert torch.allclose(got, expected, rtol=0, atol=1e-5), (subset, (got - expected).abs().max().item())
    # (1, 256), (2, 256), (4, 1024) captured once each; the repeats replayed
    assert h.graphs.num_captures == 3 and h.graphs.num_replays == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_scoring_steps_give_the_eager_page_scores(model) -> None:
    """Page scores read the queries a step kept: with captured graphs (several buckets sharing one memory
    pool, the first step of each a capture) they equal the uncaptured runner's at every scoring step, also
    when steps of another bucket run in between."""
    m = _gpu_model(model)
    dev = torch.device("cuda")
    cap = Harness(m, [30, 13, 200], num_slots=256, device=dev, capture=True)
    ref = Harness(m, [30, 13, 200], num_slots=256, device=dev, capture=False)
    for h in (cap, ref):
        _attach_ring(h)
    for step, subset in enumerate(([0], [0, 1], [0, 1, 2], [0], [0, 1, 2], [0, 1], [0])):
        scores = []
        for h in (cap, ref):
            works = [h.works()[i] for i in subset]
            works[0] = Work(works[0].seq, works[0].start, 1, score_tokens=1)
            logits = h.graphs.run(works)
            scores.append(h.graphs.page_scores(works)[0])
            for w, row in zip(works, logits, strict=True):
                w.seq.num_computed += 1
                w.seq.output_ids.append(int(row.argmax()))
        got, want = scores
        assert got is not None and want is not None
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"step {step}, batch {subset}")
    assert cap.graphs.num_captures >= 3 and cap.graphs.num_replays >= 3
    assert [s.output_ids for s in cap.seqs] == [s.output_ids for s in ref.seqs]


def _decode_with_the_fused_kernel(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    """Two decode steps of two sequences on the runner with the Triton decode-attention kernel (interpreted
    on the CPU; the other kernels stay torch), each equal to StepAttention's, then greedy equal to the
    reference; returns the [B, W] row shapes the kernel was called with, ("ring", B, W) for a local ring."""
    from services.engine.kernels.attention import decode_attention_triton
    from services.engine.step import decode_graph, graph_attention

    calls: list[tuple[object, ...]] = []
    real, real_ring = decode_attention_triton.decode_attention, decode_attention_triton.decode_attention_ring

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(tuple(args[3].shape))  # rows [B, W]
        return real(*args, **kwargs)

    def counted_ring(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("ring", args[0].shape[0], args[7]))  # B, the ring window read
        return real_ring(*args, **kwargs)

    for module in (decode_graph, graph_attention):  # the graph's step, and its attention backend
        monkeypatch.setattr(
            module, "triton_module", lambda name, device: decode_attention_triton if "attention" in name else None
        )
    monkeypatch.setattr(decode_attention_triton, "decode_attention", counted)
    monkeypatch.setattr(decode_attention_triton, "decode_attention_ring", counted_ring)
    h = Harness(model, [13, 30])
    for _ in range(2):
        works = h.works()
        expected, _ = h.step_runner.run(works)
        got = h.graphs.run(works)
        assert (got - expected).abs().max().item() < ATOL
        h.advance(got)
    for s in h.seqs:
        assert s.output_ids == reference_greedy(h.model, s.prompt_ids, len(s.output_ids))
    return calls


def test_fused_decode_attention_matches_step_attention(model, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paged layers read their rows in place (the 256-row window bucket); sliding layers whose read set is
    not a page multiple (tiny Gemma's 12 rows, or its 8-row ring window) keep SDPA."""
    calls = _decode_with_the_fused_kernel(model, monkeypatch)
    global_layers = sum(1 for w in model.config.layer_windows if w is None)
    assert calls == [(2, 256)] * (2 * global_layers)


def test_fused_decode_attention_over_local_rings_before_the_window_fills(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sliding layers of 64 tokens in local rings read their ring through the kernel's ring mode (rows by
    arithmetic); sequences shorter than the window have ring positions before 0 (never read)."""
    m = tiny_gemma(VOCAB, seed=4, window=64)
    m.test_local_rings = True
    calls = _decode_with_the_fused_kernel(m, monkeypatch)
    local = sum(1 for w in m.config.layer_windows if w is not None)
    want = [("ring", 2, 64)] * (2 * local) + [(2, 256)] * (2 * (m.config.num_layers - local))
    assert sorted(calls, key=str) == sorted(want, key=str)


@pytest.mark.parametrize(("on", "dot"), [(True, "bf16"), (True, "fp16"), (False, "fp16")])
def test_fused_decode_attention_reads_fp8_rows_in_place(
    model, on: bool, dot: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """An fp8 pool (every layer): with KVMEM_FP8_ATTENTION=1 the decode kernel reads the uint8 rows in place
    (fp8=True on every paged layer's call), and each step's logits are StepAttention's (which gathers and
    dequantises the rows): to ATOL with the bf16 dots (exact in fp32 on the CPU), to FP16_DOT_ATOL with the fp16
    ones (KVMEM_FP8_DOT); without it (the default) the fp8 layers keep the gather path (no kernel call)."""
    from services.engine.kernels.attention import decode_attention_triton
    from services.engine.kv import kv_pool

    monkeypatch.setenv("KVMEM_FP8_ATTENTION", "1" if on else "0")
    monkeypatch.setenv("KVMEM_FP8_DOT", dot)
    kv_pool.fp8_in_place.cache_clear()
    decode_attention_triton.fp8_dot.cache_clear()
    request.addfinalizer(kv_pool.fp8_in_place.cache_clear)
    request.addfinalizer(decode_attention_triton.fp8_dot.cache_clear)
    from services.engine.step import decode_graph, graph_attention

    if getattr(model, "test_local_rings", False):
        pytest.skip("local rings keep plain rows")
    flags: list[bool] = []
    real = decode_attention_triton.decode_attention

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        flags.append(kwargs["fp8"])
        return real(*args, **kwargs)

    for module in (decode_graph, graph_attention):  # the graph's step, and its attention backend
        monkeypatch.setattr(
            module, "triton_module", lambda name, device: decode_attention_triton if "attention" in name else None
        )
    monkeypatch.setattr(decode_attention_triton, "decode_attention", counted)
    h = Harness(model, [13, 30], kv_format="fp8")
    for _ in range(2):
        works = h.works()
        expected, _ = h.step_runner.run(works)
        got = h.graphs.run(works)
        assert (got - expected).abs().max().item() < (FP16_DOT_ATOL if on and dot == "fp16" else ATOL)
        h.advance(got)
    global_layers = sum(1 for w in model.config.layer_windows if w is None)
    assert flags == ([True] * (2 * global_layers) if on else [])
