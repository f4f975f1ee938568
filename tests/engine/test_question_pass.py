"""Question-first chats (ring/question.py): the question's kept queries rank the prompt's final selection.

- question_mass is the softmax of the question's queries over every key (none masked), summed per page;
- QuestionQuery keeps a question split across chunks once, in order (a chunk computed again adds nothing);
- through a tiny engine: the question's queries are kept per scoring layer, the final selection's per-head
  masses are the tail's plus the question's ("add") or the question's ("only"), and the switch off, or no
  question given, leaves the selection exactly as it was.
"""

from __future__ import annotations

import random

import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.ring.question import QuestionQuery, fuse_question, question_mass
from tests.conftest import StartStore
from tests.engine.helpers import drain, events_of, greedy, make_engine, ring_limits, run_until_done, tiny_model

VOCAB = 49152


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, seed=11)


def test_question_mass_is_the_softmax_over_every_key_summed_per_page() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=gen)  # [n, Hq, D], two query heads per kv head
    k = torch.randn(2, 20, 8, generator=gen)  # [Hkv, T, D]
    pos = torch.arange(20)
    # the keys in two disjoint parts, the second out of order (host pages come in staging batches)
    order = torch.tensor([*range(12), 16, 17, 18, 19, 12, 13, 14, 15])
    k_parts = [(k[:, order[:12]], pos[order[:12]]), (k[:, order[12:]], pos[order[12:]])]
    got = question_mass(q, k_parts, 0.5, num_pages=4, page_size=4)  # pages 0-3; keys 16-19 count in the softmax
    weights = torch.softmax(torch.einsum("nhd,htd->nht", q, k.repeat_interleave(2, dim=0)) * 0.5, dim=-1)
    want = weights[..., :16].reshape(3, 4, 4, 4).sum(-1).mean(0)  # [Hq, 4]: no causal mask, later keys included
    torch.testing.assert_close(got, want)


def test_fuse_question_adds_or_replaces_and_falls_back_to_the_tail() -> None:
    tail, asked = torch.tensor([[0.5, 0.25]]), torch.tensor([[0.125, 0.75]])
    assert torch.equal(fuse_question(tail, asked, "add"), torch.tensor([[0.625, 1.0]]))
    assert torch.equal(fuse_question(tail, asked, "only"), asked)
    assert torch.equal(fuse_question(tail, None, "only"), tail)


def test_a_question_across_chunks_is_kept_once_in_order() -> None:
    question = QuestionQuery(5, 11, "add")
    assert question.overlap(0, 4) is None
    assert question.overlap(0, 8) == (5, 8)
    question.keep({3: torch.zeros(3, 2, 4)}, 0, (5, 8))
    assert question.overlap(0, 8) is None  # the chunk again (a preempted sequence recomputed): nothing new
    assert question.overlap(8, 16) == (0, 3)
    question.keep({3: torch.ones(3, 2, 4)}, 8, (0, 3))
    kept = question.stacked()
    assert list(kept) == [3] and torch.equal(kept[3], torch.cat((torch.zeros(3, 2, 4), torch.ones(3, 2, 4))))
    question.release()
    assert question.stacked() == {}


def _final_scores(model, tokenizer, start_store, question_pass, question):  # type: ignore[no-untyped-def]
    """The per-head masses the prompt's final selection ranks by, and the question's kept queries then (a store
    of its own: a run must not adopt the prefix pages another one wrote)."""
    store_address = start_store(host_kv_mib=32).address
    limits = ring_limits(budget_pages=8, query_pass="exact", head_fusion="sum", anchor_pages=1, score_from=0.5,
                         question_pass=question_pass)  # fmt: skip
    engine = make_engine(model, tokenizer, num_slots=8, ring=limits, ring_chunk=8, store_address=store_address)
    seen: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []
    released: list[bool] = []
    select = engine.ring.select

    def record(ring, *args, **kwargs):  # type: ignore[no-untyped-def]
        if ring.scores is not None and ring.scores.dim() == 2:
            kept = ring.question.stacked() if ring.question is not None else {}
            seen.append((ring.scores.clone(), kept))
        select(ring, *args, **kwargs)

    after = engine._ring_after_step

    def after_step(w, scores, ring):  # type: ignore[no-untyped-def]
        after(w, scores, ring)
        if w.exact_query and ring.question is not None:
            released.append(ring.question.stacked() == {})

    engine.ring.select = record  # type: ignore[method-assign]
    engine._ring_after_step = after_step  # type: ignore[method-assign]
    rng = random.Random(7)
    prompt = [rng.randrange(100, VOCAB) for _ in range(70)]
    seq = engine.submit("q", prompt, greedy(2), query_start=66, question=question)
    run_until_done(engine, [seq])
    tokens, done = drain(events_of(seq))
    assert done.unverified and len(tokens) == 2
    assert released == ([] if question_pass == "off" else [True])  # kept queries freed once used
    assert len(seen) == 1
    return seen[0]


def test_question_first_selection_is_ranked_by_the_question(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    question = (5, 11)  # across the first two chunks of 8, long before the scored tail [66, 70)
    off, _ = _final_scores(model, smol_tokenizer, start_store, "off", question)
    plain, _ = _final_scores(model, smol_tokenizer, start_store, "off", None)
    only, kept = _final_scores(model, smol_tokenizer, start_store, "only", question)
    added, _ = _final_scores(model, smol_tokenizer, start_store, "add", question)
    torch.testing.assert_close(off, plain, rtol=0, atol=0)  # the switch off: the question is ignored
    cfg = model.config
    scoring = list(range(cfg.num_layers // 2, cfg.num_layers))  # score_from 0.5
    assert sorted(kept) == scoring
    assert all(q.shape == (6, cfg.num_heads, cfg.head_dim) for q in kept.values())
    torch.testing.assert_close(added, off + only)  # the tail's mass and the question's
    assert not torch.allclose(only, off)
    # the question reads the pages after it (its own are pages 1-2): a page past them carries mass
    assert float(only[:, 4:].sum()) > 0.0


def test_realign_rotates_queries_on_to_the_target_position() -> None:
    """RoPE at positions m, then realigned to position t, equals RoPE at t: scores against keys before t are those
    of a query at t (the "_end" question passes)."""
    from services.engine.models.config import ModelConfig
    from services.engine.models.llama import RotaryEmbedding, apply_rope
    from services.engine.ring.question import realign

    cfg = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=64, intermediate_size=8, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    rotary = RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(5, 4, 16, generator=g)
    positions = torch.tensor([3, 4, 9, 10, 11])
    at_m = apply_rope(raw, *rotary(positions, raw.dtype).rows)
    at_t = apply_rope(raw, *rotary(torch.full((5,), 40), raw.dtype).rows)
    torch.testing.assert_close(realign(at_m, positions, 40, rotary), at_t, rtol=1e-5, atol=1e-5)


def test_question_pass_realigned_to_the_prompts_end_runs_through_the_engine(
    model, smol_tokenizer: Tokenizer, start_store: StartStore
) -> None:
    """ "only_end": the kept queries are rotated to the prompt's end (realign) before they score: the same layers and
    shapes as "only", other masses (the distances changed), pages after the question still read."""
    question = (5, 11)
    only, _ = _final_scores(model, smol_tokenizer, start_store, "only", question)
    at_end, kept = _final_scores(model, smol_tokenizer, start_store, "only_end", question)
    assert at_end.shape == only.shape and not torch.allclose(at_end, only)
    assert all(q.shape[0] == 6 for q in kept.values())
    assert float(at_end[:, 4:].sum()) > 0.0
