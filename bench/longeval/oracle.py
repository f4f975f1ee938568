"""Selection diagnostics in process: what would each page-selection rule pick for a case's question?

One dense forward per case (no ring: every query sees every key) records, for each paged layer, the
post-RoPE queries of the prompt's last chunk and every key; then each rule ranks the pages and we report
whether the needle's pages are in its evidence set (the same budget and neighbour expansion as the ring),
plus where the true attention of the question tokens would put them (the oracle). Tuning split only: it
is the tool the selection rules were chosen with.

    .venv/bin/python -m bench.longeval.oracle --cases 12 --length 4096
"""

from __future__ import annotations

import argparse
import logging
import random
from collections import defaultdict

import torch

from bench.longeval.split import SPLITS
from bench.longeval.tasks import make_case
from services.cacheguard.renderer import ChatRenderer
from services.engine import paged_attention
from services.engine.builder import build_engine
from services.engine.config import EngineConfig
from services.engine.sampling import SamplingParams
from services.engine.sequence import Done, Failed
from services.engine.summaries import page_bounds

logger = logging.getLogger("bench.longeval.oracle")
PAGE = 64


class Recorder:
    def __init__(self) -> None:
        self.target = 0
        self.q: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}

    def install(self) -> None:
        original = paged_attention.StepAttention.attend
        rec = self

        def attend(self, layer_idx, q, k, v, scale, window=None, stored=False, partial=False):  # noqa: ANN001
            out = original(self, layer_idx, q, k, v, scale, window, stored, partial)
            span = self.spans[0]
            if span.num_past + span.num_new == rec.target and not self.pool.is_local(layer_idx):
                k_all, _ = self.pool.gather(layer_idx, span.read_rows, torch.float32)
                rec.q[layer_idx] = q.float().clone()
                rec.k[layer_idx] = k_all.clone()
            return out

        paged_attention.StepAttention.attend = attend


def select(scores: torch.Tensor, excluded: set[int], budget: int, neighbors: int) -> set[int]:
    """The ring's rule: top pages plus neighbours until the budget is full."""
    n = scores.shape[0]
    chosen: list[int] = []
    for p in torch.argsort(scores, descending=True, stable=True).tolist():
        if p in excluded:
            continue
        for q in [p, *range(p + 1, p + 1 + neighbors), *range(p - 1, p - 1 - neighbors, -1)]:
            if len(chosen) < budget and 0 <= q < n and q not in excluded and q not in chosen:
                chosen.append(q)
        if len(chosen) >= budget:
            break
    return set(chosen)


def rules(q: dict[int, torch.Tensor], k: dict[int, torch.Tensor], rows: slice, cand: torch.Tensor, scale: float):
    """Page scores [Np] of each rule for the query rows `rows` of the recorded chunk."""
    out: dict[str, torch.Tensor] = defaultdict(lambda: 0)
    for layer in q:
        qq = q[layer][rows]  # [T, Hq, D]
        kk = k[layer]  # [N, Hkv, D]
        n = kk.shape[0] // PAGE * PAGE
        np_ = n // PAGE
        pages = kk[:n].view(np_, PAGE, *kk.shape[1:])
        kmin, kmax = pages.amin(1), pages.amax(1)
        b = page_bounds(qq, kmin, kmax) * scale  # [T, Hq, Np]
        out["quest_all"] = out["quest_all"] + torch.softmax(b, -1).sum((0, 1))
        bc = b.masked_fill(~cand, float("-inf"))
        pc = torch.softmax(bc, -1)  # candidates only
        out["quest_cand"] = out["quest_cand"] + pc.sum((0, 1))
        per_head = pc.mean(0)  # [Hq, Np]
        top = per_head.topk(3, -1).indices
        vote = torch.zeros_like(per_head).scatter_(1, top, 1.0).sum(0)
        out["quest_vote3"] = out["quest_vote3"] + vote
        out["quest_max"] = out["quest_max"] + per_head.amax(0)
        bmax = bc.amax(0)  # [Hq, Np]: the best query token per head
        out["quest_tokmax_vote"] = out["quest_tokmax_vote"] + torch.zeros_like(per_head).scatter_(
            1, bmax.topk(3, -1).indices, 1.0).sum(0)  # fmt: skip
        # true attention of the query tokens over every key (GQA): the oracle
        group = qq.shape[1] // kk.shape[1]
        kr = kk[:n].repeat_interleave(group, 1)  # [n, Hq, D]
        logits = torch.einsum("thd,nhd->thn", qq, kr) * scale
        att = torch.softmax(logits, -1).view(*logits.shape[:2], np_, PAGE).sum(-1)  # [T, Hq, Np]
        out["oracle"] = out["oracle"] + att.sum((0, 1))
        attc = att.masked_fill(~cand, 0)
        attc = attc / attc.sum(-1, keepdim=True).clamp(min=1e-9)
        out["oracle_cand"] = out["oracle_cand"] + attc.sum((0, 1))
        lmax = logits.view(*logits.shape[:2], np_, PAGE).amax(-1).masked_fill(~cand, float("-inf"))  # [T, Hq, Np]
        out["oracle_maxvote"] = out["oracle_maxvote"] + torch.zeros_like(per_head).scatter_(
            1, lmax.amax(0).topk(3, -1).indices, 1.0).sum(0)  # fmt: skip
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=12)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--tasks", default="single_number,single_word,multikey,codeqa")
    p.add_argument("--shapes", default="chat_qlast,chat_qfirst,chat_doc_earlier,completion")
    p.add_argument("--budget", type=int, default=9)
    p.add_argument("--neighbors", type=int, default=1)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    split = SPLITS["tuning"]
    ctx = a.length + 1024
    engine, _ = build_engine(EngineConfig(model="embedded:smollm2", device="cpu", max_context=ctx, kv_capacity=ctx,
                                          prefill_chunk=512, max_running=1))  # fmt: skip
    tok = engine.tokenizer
    render = ChatRenderer(tok.info).render
    count = lambda s: len(tok.encode(s))  # noqa: E731
    rec = Recorder()
    rec.install()
    tasks, shapes = a.tasks.split(","), a.shapes.split(",")
    hits: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    n_by: dict[str, int] = defaultdict(int)
    for i in range(a.cases):
        rng = random.Random(i)
        task, shape = tasks[i % len(tasks)], shapes[(i // len(tasks) + i) % len(shapes)]
        kind, half = split.kinds[rng.randrange(len(split.kinds))]
        if task == "codeqa":
            kind, half = "code", 0
        case = make_case(split, task, kind, half, a.length, rng.choice([0.1, 0.3, 0.5, 0.7, 0.9]), shape, i, count)
        text = render(case.messages) if case.messages is not None else case.prompt
        ids = tok.encode(text, add_special_tokens=case.messages is None)
        at = text.find(case.answers[0])
        needle_tok = len(tok.encode(text[:at], add_special_tokens=case.messages is None))
        needle_pages = {needle_tok // PAGE, (needle_tok + count(case.answers[0])) // PAGE}
        rec.target = len(ids)
        rec.q, rec.k = {}, {}
        seq = engine.submit(case.case_id, ids, SamplingParams(temperature=0.0, max_tokens=1))
        while True:
            ev = seq.events.get()
            if isinstance(ev, (Done, Failed)):
                break
        chunk = next(iter(rec.q.values())).shape[0]
        np_ = len(ids) // PAGE
        recent = set(range(max(0, -(-len(ids) // PAGE) - 5), np_ + 1))
        excluded = set(range(2)) | recent
        cand = torch.tensor([p not in excluded for p in range(np_)])
        # query spans: the last 64 tokens; the question's own tokens (+ the assistant header)
        q_text = next(m for m in (case.messages or [{"content": case.prompt}])[::-1])["content"]
        qs = {"tail64": slice(chunk - 64, chunk), "tail256": slice(max(0, chunk - 256), chunk)}
        question = q_text.split("\n\n")[0] if shape == "chat_qfirst" else q_text.rsplit("\n\n", 1)[-1]
        q_at = text.rfind(question[:40])
        q_tok = len(tok.encode(text[:q_at], add_special_tokens=case.messages is None))
        if q_tok >= len(ids) - chunk:
            qs["question"] = slice(q_tok - (len(ids) - chunk), chunk)
        scale = 64**-0.5
        for qname, rows in qs.items():
            scores = rules(rec.q, rec.k, rows, cand, scale)
            for rule, sc in scores.items():
                chosen = select(sc[:np_], excluded, a.budget, a.neighbors)
                hits[f"{qname}/{rule}"][shape] += int(needle_pages <= chosen | recent | {0, 1})
                hits[f"{qname}/{rule}"]["all"] += int(needle_pages <= chosen | recent | {0, 1})
        n_by[shape] += 1
        n_by["all"] += 1
        print(f"case {i} {task} {shape} depth {case.depth} needle pages {sorted(needle_pages)} of {np_}", flush=True)
    engine.stop()
    cols = ["all", *shapes]
    print("| query/rule | " + " | ".join(cols) + " |")
    for name in sorted(hits):
        print(f"| {name} | " + " | ".join(f"{hits[name][c]}/{n_by[c]}" for c in cols) + " |")


if __name__ == "__main__":
    main()
