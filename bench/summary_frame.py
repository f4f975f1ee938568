"""Which frame should page summaries live in: after RoPE (what attention sees) or before (content)?

For passkey / multikey prompts (bench/needle.py's make_case, raw format) the real model reads the
prompt once through a recording attention backend: the post-RoPE queries of the question tokens
(from the question text to the end) and the post-RoPE keys of every token. Pre-RoPE queries and keys
are recovered by rotating back (RoPE with the sine negated; checked by rotating forward again).
Keys are split into 64-token pages, and every scorer ranks the needle's page among the pages before
the question, aggregated exactly as services/engine/ring/summaries.py does (softmax over pages per
(layer, query token, head), summed):

    quest_post  post-RoPE Quest bound (min/max): what the engine uses (summaries.page_scores)
    mean_post   post-RoPE mean key (summaries.mean_key_scores)
    mean_pre    pre-RoPE mean key with pre-RoPE queries (content frame)
    quest_pre   pre-RoPE Quest bound with pre-RoPE queries
    exact       reference, not a summary: the question's real attention mass per page

The needle's rank is the better of the page holding the needle sentence's first token and the next
page (a sentence may straddle the seam; the ring pulls neighbours too).

    .venv/bin/python bench/summary_frame.py --lengths 2048,4096 --cases 10

One forward of 4096 tokens takes about a minute on a loaded 2-core CPU, so the run keeps each
case's result in --out and stops after --max-seconds; running the same command again resumes.
The table is printed (and with --append-results added to bench/RESULTS.md) once every case is done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.needle import make_case  # noqa: E402
from services.common.model_files import resolve_model_path  # noqa: E402
from services.common.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from services.engine.kv.attention import ContiguousKV  # noqa: E402
from services.engine.models.llama import apply_rope  # noqa: E402
from services.engine.ring.summaries import mean_key_scores, page_scores  # noqa: E402

SCORERS = ["quest_post", "mean_post", "mean_pre", "quest_pre", "exact"]
TOPK = (2, 4, 8)
HEADING = "## Ring: summary frame (bench/summary_frame.py)"


class RecordingKV(ContiguousKV):
    """ContiguousKV that also keeps, per layer, the post-RoPE queries of tokens >= query_start."""

    def __init__(self, num_layers: int, query_start: int) -> None:
        super().__init__(num_layers, initial_capacity=4096)
        self.query_start = query_start
        self.queries: list[torch.Tensor | None] = [None] * num_layers  # [Tq, Hq, D] each

    def attend(self, layer_idx, q, k, v, scale, window=None, stored=False, partial=False):  # type: ignore[no-untyped-def]
        first = self._lengths[layer_idx]  # position of q[0]
        lo = max(0, self.query_start - first)
        if lo < q.shape[0]:
            prev = self.queries[layer_idx]
            part = q[lo:].detach().clone()
            self.queries[layer_idx] = part if prev is None else torch.cat([prev, part])
        return super().attend(layer_idx, q, k, v, scale, window, stored)


def needle_token(tok: Tokenizer, prompt: str, ids: list[int], answer: str) -> int:
    """Index of the first token of the sentence that holds `answer` (the needle asked about)."""
    at = prompt.rfind("The pass key", 0, prompt.find(answer))
    assert at >= 0, answer
    idx = len(tok.encode(prompt[:at].rstrip(" ")))
    assert "The" in tok.decode(ids[idx : idx + 2]), (idx, tok.decode(ids[idx - 2 : idx + 4]))
    return idx


def pre_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Undo RoPE: rotate by the opposite angle (the model's apply_rope with the sine negated)."""
    return apply_rope(x, cos, -sin)


def page_summaries(k: torch.Tensor, num_pages: int, page_size: int) -> tuple[torch.Tensor, ...]:
    """k: [Hkv, T, D] -> kmin, kmax, kmean: [Np, Hkv, D] over the first num_pages full pages."""
    pages = k[:, : num_pages * page_size].reshape(k.shape[0], num_pages, page_size, k.shape[2]).transpose(0, 1)
    return pages.amin(dim=2), pages.amax(dim=2), pages.mean(dim=2)


def exact_mass(q: torch.Tensor, k: torch.Tensor, num_pages: int, page_size: int, scale: float) -> torch.Tensor:
    """The question's real attention mass per candidate page (softmax over the candidate keys):
    q: [Tq, Hq, D], k: [Hkv, T, D] -> [Np], unit mass per (query token, head) like the scorers."""
    group = q.shape[1] // k.shape[0]
    keys = k[:, : num_pages * page_size].repeat_interleave(group, dim=0)  # [Hq, Np * page, D]
    probs = torch.softmax(torch.bmm(q.transpose(0, 1), keys.transpose(1, 2)) * scale, dim=-1)  # [Hq, Tq, K]
    return probs.reshape(*probs.shape[:2], num_pages, page_size).sum(dim=(0, 1, 3))


@torch.inference_mode()
def score_case(model, tok: Tokenizer, case, page_size: int) -> dict:  # type: ignore[no-untyped-def]
    """One forward over the prompt; the five scorers' page scores over the pages before the question."""
    cfg = model.config
    ids = tok.encode(case.prompt_text)
    q_at = case.prompt_text.rfind(case.question_text)
    query_start = len(tok.encode(case.prompt_text[:q_at]))
    needle = needle_token(tok, case.prompt_text, ids, case.answer)
    kv = RecordingKV(cfg.num_layers, query_start)
    t0 = time.perf_counter()
    model(torch.tensor(ids), torch.arange(len(ids)), kv)
    forward_s = time.perf_counter() - t0
    num_pages = query_start // page_size  # pages wholly before the question's page
    scale = cfg.head_dim**-0.5
    pos = torch.arange(len(ids))
    cos, sin = model.rotary(pos, torch.float32).rows  # [T, 1, D]
    scores = {name: torch.zeros(num_pages, dtype=torch.float64) for name in SCORERS}
    worst = 0.0
    for layer in range(cfg.num_layers):
        k_post = kv.layer_kv(layer)[0].float()  # [Hkv, T, D]
        q_post = kv.queries[layer]
        assert q_post is not None and q_post.shape[0] == len(ids) - query_start
        kp = k_post.transpose(0, 1)  # [T, Hkv, D]
        k_pre = pre_rope(kp, cos, sin)
        q_pre = pre_rope(q_post, cos[query_start:], sin[query_start:])
        worst = max(
            worst,
            float((apply_rope(k_pre, cos, sin) - kp).abs().max()),
            float((apply_rope(q_pre, cos[query_start:], sin[query_start:]) - q_post).abs().max()),
        )
        kmin, kmax, kmean = page_summaries(k_post, num_pages, page_size)
        kmin_pre, kmax_pre, kmean_pre = page_summaries(k_pre.transpose(0, 1), num_pages, page_size)
        scores["quest_post"] += page_scores(q_post, kmin, kmax, scale).double()
        scores["mean_post"] += mean_key_scores(q_post, kmean, scale).double()
        scores["mean_pre"] += mean_key_scores(q_pre, kmean_pre, scale).double()
        scores["quest_pre"] += page_scores(q_pre, kmin_pre, kmax_pre, scale).double()
        scores["exact"] += exact_mass(q_post, k_post, num_pages, page_size, scale).double()
    assert worst < 1e-4, f"RoPE inversion does not round-trip: max error {worst}"
    total = cfg.num_layers * cfg.num_heads * (len(ids) - query_start)
    for name in SCORERS:  # unit mass per (layer, query token, head): the built-in check
        assert abs(float(scores[name].sum()) - total) < 1e-3 * total, (name, float(scores[name].sum()), total)
    return {
        "task": case.task, "length": case.length, "depth": case.depth, "prompt_tokens": len(ids),
        "query_start": query_start, "query_tokens": len(ids) - query_start, "needle_token": needle,
        "needle_page": needle // page_size, "num_pages": num_pages, "forward_s": round(forward_s, 2),
        "roundtrip_err": worst, "scores": {n: [round(float(x), 4) for x in s] for n, s in scores.items()},
    }  # fmt: skip


def needle_rank(row: dict, name: str, protect_pages: int) -> int:
    """1-based rank of the needle page (or the next page, whichever is better) among candidate pages
    [protect_pages, num_pages); call only for a needle outside the protected pages."""
    page = row["needle_page"]
    assert page >= protect_pages, (page, protect_pages)
    scores = torch.tensor(row["scores"][name][protect_pages:])
    ranks = torch.empty(len(scores), dtype=torch.long)
    ranks[torch.argsort(scores, descending=True, stable=True)] = torch.arange(1, len(scores) + 1)
    best = [int(ranks[p - protect_pages]) for p in (page, page + 1) if p < row["num_pages"]]
    return min(best)


def table(rows: list[dict], lengths: list[int], protect_pages: int) -> list[str]:
    """Markdown: recall@k and mean rank per scorer and length (and over all cases)."""
    head = "| scorer | length | cases | " + " | ".join(f"recall@{k}" for k in TOPK) + " | mean rank | median rank |"
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in SCORERS:
        for length in [*lengths, 0]:
            sel = [r for r in rows if (r["length"] == length or length == 0) and r["needle_page"] >= protect_pages]
            ranks = [needle_rank(r, name, protect_pages) for r in sel]
            if not ranks:
                continue
            recall = [sum(1 for x in ranks if x <= k) / len(ranks) for k in TOPK]
            ordered = sorted(ranks)
            median = ordered[len(ordered) // 2] if len(ordered) % 2 else sum(ordered[len(ordered) // 2 - 1 :][:2]) / 2
            label = name + (" (reference)" if name == "exact" else "")
            out.append(
                f"| {label} | {length or 'all'} | {len(ranks)} | " + " | ".join(f"{x:.2f}" for x in recall)
                + f" | {sum(ranks) / len(ranks):.1f} | {median:g} |"
            )  # fmt: skip
    return out


def diagnostics(rows: list[dict], protect_pages: int) -> list[str]:
    """Why the scorers differ: per task, paired against the engine's scorer, needle contrast, and where
    the best non-needle pages sit (a positional bias shows as a share far from 0.25)."""
    rows = [r for r in rows if r["needle_page"] >= protect_pages]
    head = ("| scorer | recall@4 passkey | recall@4 multikey | vs quest_post: better / worse / tie | "
            "needle score / mean page score | top-5 non-needle pages in the last quarter |")  # fmt: skip
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for name in SCORERS:
        cells = []
        for task in ("passkey", "multikey"):
            sel = [r for r in rows if r["task"] == task]
            hits = sum(1 for r in sel if needle_rank(r, name, protect_pages) <= 4)
            cells.append(f"{hits}/{len(sel)}")
        mine = [needle_rank(r, name, protect_pages) for r in rows]
        base = [needle_rank(r, "quest_post", protect_pages) for r in rows]
        better = sum(1 for x, y in zip(mine, base, strict=True) if x < y)
        worse = sum(1 for x, y in zip(mine, base, strict=True) if x > y)
        contrast, late, total = 0.0, 0, 0
        for r in rows:
            scores = torch.tensor(r["scores"][name][protect_pages:])
            page = r["needle_page"] - protect_pages
            contrast += float(scores[page : page + 2].max() / scores.mean())
            needle = (page, page + 1)
            order = [int(p) for p in torch.argsort(scores, descending=True) if int(p) not in needle][:5]
            late += sum(1 for p in order if p >= 0.75 * len(scores))
            total += len(order)
        out.append(
            f"| {name} | {cells[0]} | {cells[1]} | {better} / {worse} / {len(rows) - better - worse} | "
            f"{contrast / len(rows):.1f} | {late / total:.2f} |"
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--tasks", default="passkey,multikey")
    p.add_argument("--cases", type=int, default=10, help="cases per (task, length)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--protect-pages", type=int, default=2, help="the engine's protect bucket (128 tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench/results/summary_frame_cpu.jsonl"))
    p.add_argument("--max-seconds", type=float, default=450.0, help="stop starting new cases after this")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--append-results", action="store_true", help="add the tables to bench/RESULTS.md")
    p.add_argument("--note", default="", help="a closing paragraph for bench/RESULTS.md (the conclusion)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    from services.engine.models.loader import load_model

    start = time.monotonic()
    lengths = [int(x) for x in a.lengths.split(",")]
    tasks = a.tasks.split(",")
    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    rng = random.Random(a.seed)
    cases = [
        make_case(task, length, (i + 0.5) / a.cases, rng, tok, None, "raw")
        for length in lengths for task in tasks for i in range(a.cases)
    ]  # fmt: skip
    out = Path(a.out)
    done = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done[(r["task"], r["length"], r["depth"], r["answer"])] = r
    todo = [c for c in cases if (c.task, c.length, c.depth, c.answer) not in done]
    if todo:
        _, model = load_model(path, torch.device("cpu"), torch.float32)
        for case in todo:
            if time.monotonic() - start > a.max_seconds:
                break
            row = {**score_case(model, tok, case, a.page_size), "answer": case.answer}
            done[(case.task, case.length, case.depth, case.answer)] = row
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            ranks = {n: needle_rank(row, n, 0) for n in SCORERS}
            print(f"{case.task} {case.length} depth {case.depth:.2f}: needle page {row['needle_page']}/"
                  f"{row['num_pages']}, forward {row['forward_s']:.0f} s, ranks {ranks}", flush=True)  # fmt: skip
    rows = [done[k] for k in ((c.task, c.length, c.depth, c.answer) for c in cases) if k in done]
    if len(rows) < len(cases):
        print(f"{len(rows)}/{len(cases)} cases done; run the same command again to continue")
        return 0
    all_pages = table(rows, lengths, 0)
    engine_view = table(rows, lengths, a.protect_pages)
    print("\nAll pages before the question:\n" + "\n".join(all_pages))
    print(f"\nEngine candidates (pages >= {a.protect_pages}; cases with the needle in a protected page left out):")
    print("\n".join(engine_view))
    why = diagnostics(rows, a.protect_pages)
    print("\nDiagnostics (engine candidates):\n" + "\n".join(why))
    if a.append_results:
        _append_results(a, rows, all_pages, engine_view + ["", "Diagnostics over the same cases:", "", *why])
    return 0


def _append_results(a: argparse.Namespace, rows: list[dict], all_pages: list[str], engine_view: list[str]) -> None:
    """Append (never rewrite) the tables to bench/RESULTS.md: re-read just before writing."""
    path = ROOT / "bench/RESULTS.md"
    text = path.read_text() if path.exists() else ""
    secs = sum(r["forward_s"] for r in rows) / len(rows)
    block = [
        "", HEADING, "",
        f"- Date: {datetime.date(2026, 11, 29)}. Hardware: 2-core CPU VM (no GPU), shared with other runs.",
        f"- Command: `.venv/bin/python bench/summary_frame.py --lengths {a.lengths} --tasks {a.tasks} "
        f"--cases {a.cases}` (resumable; run until it prints the tables, then `--append-results`).",
        f"- {a.model} (GGUF Q4_1 dequantised to fp32), one forward per prompt ({secs:.0f} s mean), "
        f"{len(rows)} cases, pages of {a.page_size} tokens, raw passkey format (bench/needle.py's make_case).",
        "", "All pages before the question page (rank among them; the needle's page or the next one):", "",
        *all_pages,
        "", f"The engine's candidates: pages >= {a.protect_pages} (the protect bucket is always resident; cases "
        "whose needle lies there need no retrieval and are left out):", "",
        *engine_view,
        *(["", a.note] if a.note else []),
    ]  # fmt: skip
    sep = "" if text.endswith("\n") or not text else "\n"
    with path.open("a") as f:
        f.write(sep + "\n".join(block) + "\n")


if __name__ == "__main__":
    sys.exit(main())
