"""In-process selection probe: where the ring's prompt selection ranks the needle's page, and whether the
answer is right, per engine variant, on the TUNING split (the held-out split is for run.py only).

    .venv/bin/python -m bench.longeval.probe --lengths 4096 --cases 12 --variants dense,sparse,oracle

A variant is `dense`, `off` (retrieval off), `sparse` or `oracle` (sparse, and the prompt's final selection
forced to include every needle page: an upper bound for what better page ranking can buy), `xsparse` / `xoracle`
(the same with every prompt chunk before the last attending every page, as `exact` does: what the ring's last
chunk and decode make of exact KV, so that sparse prefill's share of a loss shows) followed by
`+key=value` engine overrides (`sparse+ring_vote_top=2+neighbor_pages=0`). The request is what the cache
guard sends: the chat template's render and the query span `--query-span` (turn: the last user message's
start; question: the question's start). This is a diagnostic for tuning; evidence comes from run.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from bench.longeval import tasks
from bench.longeval.split import SPLITS
from bench.needle import start_store
from services.cacheguard.core import GuardCore, PromptRequest
from services.engine.builder import build_engine
from services.engine.config import EngineConfig
from services.engine.ring.ring import RingManager
from services.engine.ring.selection import page_ranking
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import Chunk, Done, Failed

logger = logging.getLogger(__name__)


def _parse_variant(spec: str, base: EngineConfig, pool: int) -> tuple[str, EngineConfig, bool, str | None]:
    kind, *overrides = spec.split("+")
    span = next((o.partition("=")[2] for o in overrides if o.startswith("span=")), None)
    overrides = [o for o in overrides if not o.startswith("span=")]
    oracle = kind in ("oracle", "xoracle")
    if kind == "dense":
        cfg = base
    elif kind in ("sparse", "oracle", "off", "xsparse", "xoracle"):
        cfg = replace(base, kv_capacity=pool, retrieval=kind != "off")
    else:
        raise SystemExit(f"unknown variant {spec!r}")
    types = {f.name: f.type for f in fields(EngineConfig)}
    for item in overrides:
        key, _, value = item.partition("=")
        typ = types.get(key)
        if typ is None:
            raise SystemExit(f"{key!r} is not an EngineConfig field")
        conv: Any = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(str(typ), str)
        cfg = replace(cfg, **{key: conv(value)})
    return spec, cfg, oracle, span


class SelectionSpy:
    """Wraps RingManager.select: records the prompt's final ranking; with `force`, adds the needle pages."""

    def __init__(self) -> None:
        self.force: list[int] = []
        self.records: list[dict[str, Any]] = []
        self._orig = RingManager.select

    def install(self) -> None:
        spy = self

        def select(mgr: RingManager, ring, num_candidate_pages, request_id, step, end_tokens=0, *copy):  # type: ignore[no-untyped-def]
            final = ring.final_scored and not ring.anchor and ring.scores is not None
            ranked = []
            if final:
                excluded = set(range(mgr.limits.protect_pages)) | ring.skeleton
                scores = page_ranking(ring.scores, num_candidate_pages, excluded, mgr.limits.head_fusion)
                ranked = torch.argsort(scores, descending=True, stable=True).tolist()
            spy._orig(mgr, ring, num_candidate_pages, request_id, step, end_tokens, *copy)
            if final:
                if spy.force:
                    chosen = [p for p in spy.force if p < num_candidate_pages]
                    rest = sorted(ring.evidence - set(chosen), key=ranked.index)
                    ring.evidence = set(chosen + rest[: max(0, mgr.limits.evidence_pages - len(chosen))])
                spy.records.append({"ranked": ranked, "evidence": sorted(ring.evidence),
                                    "skeleton": sorted(ring.skeleton), "candidates": num_candidate_pages})  # fmt: skip

        RingManager.select = select  # type: ignore[method-assign]

    def uninstall(self) -> None:
        RingManager.select = self._orig  # type: ignore[method-assign]


class ExactPrefillSpy:
    """Wraps Scheduler._shape: while `on`, a ring sequence's prompt chunks before the last run under the exact
    policy (each attends every page, host pages streamed) and its last chunk and decode steps under the sparse
    one (the final selection, then decode over the ring), so the ring works from KV that sparse prefill did not
    shape."""

    def __init__(self) -> None:
        from services.engine.step.scheduler import Scheduler

        self.cls = Scheduler
        self._orig = Scheduler._shape
        self.on = False

    def install(self) -> None:
        spy = self

        def shape(sched, seq, want):  # type: ignore[no-untyped-def]
            ring = seq.ring
            if spy.on and ring is not None:
                last = seq.num_computed + want >= len(seq.prompt_ids)
                ring.policy = "exact" if seq.in_prefill and not last else "sparse"
            return spy._orig(sched, seq, want)

        self.cls._shape = shape  # type: ignore[method-assign]

    def uninstall(self) -> None:
        self.cls._shape = self._orig  # type: ignore[method-assign]


class HeadSpy:
    """Wraps paged_attention.page_mass (the `exact` query pass's real attention): records each paged layer's
    per-head mass over pages (mean over the scored tokens), so that `head_ranks` can say which heads find the
    needle page."""

    def __init__(self) -> None:
        from services.engine.kv import paged_attention

        self.module = paged_attention
        self._orig = paged_attention.page_mass
        self.layers: list = []

    def install(self) -> None:
        spy = self

        def page_mass(*args, **kwargs):  # type: ignore[no-untyped-def]
            mass = spy._orig(*args, **kwargs)
            spy.layers.append(mass.mean(dim=0).cpu())  # [Hq, Np]
            return mass

        self.module.page_mass = page_mass

    def uninstall(self) -> None:
        self.module.page_mass = self._orig


def head_ranks(layers: list, needle_pages: list[int], excluded: set[int]):  # type: ignore[no-untyped-def]
    """[L, Hq] rank of the best-ranked needle page by each head's mass (0 = first), excluded pages skipped."""
    mass = torch.stack(layers)  # [L, Hq, Np]
    for p in excluded:
        if p < mass.shape[-1]:
            mass[..., p] = -1.0
    order = mass.argsort(dim=-1, descending=True)
    ranks = torch.full(mass.shape[:2], mass.shape[-1], dtype=torch.long)
    for p in needle_pages:
        if p < mass.shape[-1]:
            ranks = torch.minimum(ranks, (order == p).int().argmax(dim=-1))
    return ranks


def _token_index(tok, text: str, char: int) -> int:  # type: ignore[no-untyped-def]
    return len(tok.encode(text[:char], add_special_tokens=False))


def build_requests(tok, cases: list[tasks.Case], span: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    """What the cache guard sends the engine for each case: token ids and the query span's start. Span
    `append` (an upper bound, not a request a user sends): a question-first chat's question is appended to the
    prompt and is the query span (what re-reading the question after the document could give the selection)."""
    core = GuardCore(tok, max_sessions=4096, query_span="question" if span == "append" else span)
    out = []
    for case in cases:
        prepared = core.prepare(PromptRequest(messages=case.messages, prompt_text=case.prompt))
        ids = list(prepared.token_ids)
        text = tok.decode(ids)
        needles = [_token_index(tok, text, text.find(value)) for value in case.answers]
        query_start = prepared.query_start if prepared.query_start is not None else -1
        if span == "append" and case.shape == "chat_qfirst" and case.messages:
            question = case.messages[-1]["content"].partition("\n\n")[0]
            query_start = len(ids)
            ids = ids + tok.encode("\n\n" + question, add_special_tokens=False)
        question = None if span == "append" else prepared.question
        out.append({"case": case, "ids": ids, "query_start": query_start, "needle_tokens": needles,
                    "question": question, "question_alone": prepared.question_alone})  # fmt: skip
    return out


def stream(engine, req: dict[str, Any], params: SamplingParams) -> tuple[list[int], str, Done]:  # type: ignore[no-untyped-def]
    """Submit one request (its query span from `req`) and collect its answer: (token ids, text, Done)."""
    qs = req["query_start"] if req["query_start"] >= 0 else None
    seq = engine.submit(req["case"].case_id, req["ids"], params, query_start=qs, question=req.get("question"),
                        question_alone=req.get("question_alone", False))  # fmt: skip
    ids: list[int] = []
    text = ""
    while True:
        ev = seq.events.get()
        if isinstance(ev, Chunk):
            ids.extend(ev.token_ids)
            text += ev.text
        elif isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        elif isinstance(ev, Done):
            return ids, text, ev


def run_one(engine, req: dict[str, Any], bias: dict[int, float], max_tokens: int = 0) -> tuple[str, Done]:  # type: ignore[no-untyped-def]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens or req["case"].max_tokens, logit_bias=bias)
    _, text, done = stream(engine, req, params)
    return text, done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", default="4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--cases", type=int, default=2, help="cases per (length, depth)")
    p.add_argument("--tasks", default="single_number")
    p.add_argument("--shapes", default="chat_qlast")
    p.add_argument("--kinds", default="prose,code,logs")
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--variants", default="dense,sparse,oracle")
    p.add_argument("--query-span", default="question", choices=["turn", "question"])
    p.add_argument(
        "--split",
        default="tuning",
        choices=["tuning", "heldout"],
        help="tune on tuning; heldout only to report a rule chosen on tuning",
    )
    p.add_argument("--out", default="")
    p.add_argument("--max-tokens", type=int, default=0, help="override every case's (1: selection only)")
    p.add_argument("--dump-mass", default="", help="torch.save every case's per-head page masses here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    lengths = [int(x) for x in a.lengths.split(",")]
    context = -(-(max(lengths) + 512) // 64) * 64
    spy = SelectionSpy()
    spy.install()
    heads = HeadSpy()
    heads.install()
    exact_prefill = ExactPrefillSpy()
    exact_prefill.install()
    head_table: dict[str, list] = {}
    dumps: list[dict[str, Any]] = []
    results: dict[str, list[dict[str, Any]]] = {}
    procs: list = []
    try:
        base = EngineConfig(model=a.model, device=a.device, max_context=context, kv_capacity=context,
                            host_kv_mib=2048, prefill_chunk=512, max_running=1)  # fmt: skip
        cases: list[tasks.Case] = []
        by_span: dict[str, list[dict[str, Any]]] = {}
        for spec in a.variants.split(","):
            name, cfg, oracle, span = _parse_variant(spec, base, a.pool)
            # a store of its own: a variant must not adopt the pages another variant computed
            store, procs = start_store(2048)
            engine, _ = build_engine(replace(cfg, kvstore_addrs=(store,)))
            tok = engine.tokenizer

            def count(text: str, tok=tok) -> int:  # type: ignore[no-untyped-def]
                return len(tok.encode(text, add_special_tokens=False))

            if not cases:
                split = SPLITS[a.split]
                kinds = [k for k in split.kinds if k[0] in a.kinds.split(",")]
                digits = tasks.digit_tokens(tok.encode)
                cases = []
                for length in lengths:
                    for depth in (float(x) for x in a.depths.split(",")):
                        for i in range(a.cases):
                            rng = random.Random(f"probe:{length}:{depth}:{i}")
                            task = a.tasks.split(",")[i % len(a.tasks.split(","))]
                            shape = a.shapes.split(",")[(i // len(a.tasks.split(","))) % len(a.shapes.split(","))]
                            kind, half = kinds[rng.randrange(len(kinds))]
                            case = tasks.make_case(split, task, kind, half, length, depth, shape, i, count, digits)
                            cases.append(case)
            span = span or a.query_span
            if span not in by_span:
                by_span[span] = build_requests(tok, cases, span)
            requests = by_span[span]
            rows = []
            t0 = time.perf_counter()
            for req in requests:
                case = req["case"]
                needle_pages = sorted({t // cfg.page_size for t in req["needle_tokens"]})
                spy.records.clear()
                heads.layers.clear()
                spy.force = needle_pages if oracle else []
                exact_prefill.on = name.split("+")[0] in ("xsparse", "xoracle")
                bias = {int(k): float(v) for k, v in case.logit_bias.items()}
                text, done = run_one(engine, req, bias, a.max_tokens)
                rec = spy.records[-1] if spy.records else None
                ranks = [rec["ranked"].index(p) if p in rec["ranked"] else -1 for p in needle_pages] if rec else []
                hit = [p in rec["evidence"] or p in rec["skeleton"] for p in needle_pages] if rec else []
                if heads.layers and rec:
                    excluded = set(range(cfg.protect_pages)) | set(rec["skeleton"])
                    head_table.setdefault(name, []).append(head_ranks(heads.layers, needle_pages, excluded))
                    dumps.append({"variant": name, "case_id": case.case_id, "mass": torch.cat(heads.layers),
                                  "excluded": sorted(excluded), "needle_pages": needle_pages, "ok": None})  # fmt: skip
                rows.append({"case_id": case.case_id, "kind": case.kind, "depth": case.depth, "shape": case.shape,
                             "ok": tasks.score(case, text), "found": tasks.found(case, text), "text": text[:80],
                             "needle_pages": needle_pages,
                             "ranks": ranks, "selected": hit, "candidates": rec["candidates"] if rec else 0,
                             "unverified": done.unverified})  # fmt: skip
            engine.stop()
            for proc in reversed(procs):
                proc.terminate()
            results[name] = rows
            if a.dump_mass:
                torch.save(dumps, a.dump_mass)
            if a.out:  # after every variant: a run cut short keeps what it measured
                Path(a.out).write_text(json.dumps(results, indent=1))
            ok = sum(r["ok"] for r in rows)
            sel = [all(r["selected"]) for r in rows if r["selected"]]
            ranks = sorted(min(r["ranks"]) for r in rows if r["ranks"])
            values = [f for r in rows if len(r["found"]) > 1 for f in r["found"]]  # several answers: how many found
            found = f"  values {sum(values)}/{len(values)}" if values else ""
            print(f"{name:48s} right {ok}/{len(rows)}{found}  needle selected {sum(sel)}/{len(sel)}  "
                  f"ranks {ranks}  {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip
        for name, tables in head_table.items():
            # a case with a question replay scored twice (its layers, then the query span's): the most common shape
            shape = max({t.shape for t in tables}, key=lambda s: sum(t.shape == s for t in tables))
            ranks = torch.stack([t for t in tables if t.shape == shape])  # [cases, L, Hq]
            top1 = (ranks == 0).float().mean(dim=0)
            mrr = (1.0 / (ranks.float() + 1)).mean(dim=0)
            best = torch.argsort(mrr.reshape(-1), descending=True)[:16].tolist()
            hq = ranks.shape[-1]
            print(f"{name}: heads that rank the needle first most often (layer.head top1 mrr):")
            flat_top1, flat_mrr = top1.reshape(-1), mrr.reshape(-1)
            cells = [f"{b // hq}.{b % hq} {float(flat_top1[b]):.2f} {float(flat_mrr[b]):.2f}" for b in best]
            print("  " + "  ".join(cells))
            results.setdefault("_heads", {})[name] = ranks.tolist()
    finally:
        spy.uninstall()
        heads.uninstall()
        exact_prefill.uninstall()
        for proc in reversed(procs):
            proc.terminate()
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
