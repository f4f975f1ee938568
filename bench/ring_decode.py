"""How often should the ring re-select evidence during decode? Decode speed, restores and passkey
accuracy per `rescore_interval`, plus the cost of scoring itself.

    .venv/bin/python bench/ring_decode.py --intervals 0,1,4,16,64,dense --cases 6

For each interval an engine is built in-process (the real model, a ring pool of --pool tokens
inside a --context logical context; bench/needle.py's redis + kvstore processes hold the host
copies) and reads --cases passkey prompts of about --length tokens, then decodes --new-tokens
tokens greedily with EOS ignored. Per step the engine thread records the time, the tokens out and
the ring's restore counters, so decode tokens/s, restores and restored bytes cover the decode
steps only (from the step that produced the first token to the last one); the time spent in
`RingManager.select` and in host restores is measured by wrapping them. `dense` is the reference
without a ring (pool = context). A case is right when the key appears in the answer.

Decode steps always score pages (one query token x every layer) whatever the interval; the interval
only decides how often the accumulated scores re-select evidence (and so how often pages move).
The microbenchmark times that scoring: `summaries.page_scores` for one decode token of one layer
over --micro-pages pages.

CPU runs are slow (a 3K-token ring prefill takes a minute on 2 busy cores), so results go to --out
one case at a time and the run stops after --max-seconds; the same command resumes. The table is
printed (and with --append-results added to bench/RESULTS.md) once every case is done.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import random
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.needle import make_case, start_store  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.ring.summaries import mean_key_scores, page_scores  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed  # noqa: E402

HEADING = "## Ring: decode re-selection interval (bench/ring_decode.py)"


@dataclass
class StepLog:
    """Filled by the engine thread: one row per step of the request being measured."""

    seq: object | None = None
    rows: list[tuple[float, int, int, int, float, float, int]] = field(default_factory=list)
    select_s: float = 0.0
    restore_s: float = 0.0
    num_selects: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def instrument(engine, log: StepLog) -> None:  # type: ignore[no-untyped-def]
    """Wrap engine.step, ring.select and ring._restore (instance attributes; engine code untouched)."""
    ring = engine.ring
    step = engine.step

    def timed_step() -> None:
        step()
        seq = log.seq
        if seq is None:
            return
        restores = ring.num_restores if ring is not None else 0
        nbytes = ring.restored_bytes if ring is not None else 0
        with log.lock:
            log.rows.append((time.perf_counter(), len(seq.output_ids), restores, nbytes,  # type: ignore[attr-defined]
                             log.select_s, log.restore_s, log.num_selects))  # fmt: skip

    engine.step = timed_step
    if ring is None:
        return
    select, restore = ring.select, ring._restore

    def timed_select(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return select(*args, **kwargs)
        finally:
            log.select_s += time.perf_counter() - t0
            log.num_selects += 1

    def timed_restore(*args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return restore(*args, **kwargs)
        finally:
            log.restore_s += time.perf_counter() - t0

    ring.select = timed_select
    ring._restore = timed_restore


def run_case(engine, log: StepLog, tok, case, new_tokens: int, request_id: str) -> dict:  # type: ignore[no-untyped-def]
    ids = tok.encode(case.prompt_text)
    q_at = case.prompt_text.rfind(case.question_text)
    query_start = min(len(ids) - 1, len(tok.encode(case.prompt_text[:q_at])))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    with log.lock:
        log.rows = []
    t0 = time.perf_counter()
    # a namespace per request: no page is shared with an earlier case (device cache or host store)
    seq = engine.submit(request_id, ids, params, namespace=request_id, query_start=query_start)
    log.seq = seq
    text, done = "", None
    while done is None:
        ev = seq.events.get()
        if isinstance(ev, Chunk):
            text += ev.text
        elif isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        else:
            done = ev
    total_s = time.perf_counter() - t0
    assert isinstance(done, Done) and done.completion_tokens == new_tokens, done
    deadline = time.monotonic() + 10  # the engine thread logs the last step just after publishing it
    while time.monotonic() < deadline:
        with log.lock:
            rows = list(log.rows)
        if rows and rows[-1][1] >= new_tokens:
            break
        time.sleep(0.01)
    log.seq = None
    first = next(r for r in rows if r[1] >= 1)
    last = next(r for r in rows if r[1] >= new_tokens)
    steps = last[1] - first[1]
    decode_s = last[0] - first[0]
    prefix = tok.decode(tok.encode(text)[:12])
    return {
        "task": case.task, "length": case.length, "depth": case.depth, "answer": case.answer,
        "prompt_tokens": len(ids), "policy": done.prefill_policy, "unverified": done.unverified,
        "ok": case.answer in text, "ok_first12": case.answer in prefix, "text": text,
        "prefill_s": round(first[0] - t0, 3), "total_s": round(total_s, 3), "decode_steps": steps,
        "decode_s": round(decode_s, 4), "restores": last[2] - first[2], "restored_bytes": last[3] - first[3],
        "select_s": round(last[4] - first[4], 5), "restore_s": round(last[5] - first[5], 5),
        "selects": last[6] - first[6],
    }  # fmt: skip


def microbench(pages: int, layers: int, repeat: int) -> dict:
    """Seconds per call of the decode-time scoring of one layer: one query token over `pages` pages."""
    torch.manual_seed(0)
    q = torch.randn(1, 9, 64)
    kmin, kmax = torch.randn(pages, 3, 64) - 1, torch.randn(pages, 3, 64) + 1
    kmean = torch.randn(pages, 3, 64)
    scale = 64**-0.5
    out = {}
    for name, fn in (
        ("page_scores", lambda: page_scores(q, kmin, kmax, scale)),
        ("mean_key_scores", lambda: mean_key_scores(q, kmean, scale)),
        ("select_argsort", lambda: torch.argsort(torch.rand(pages), descending=True, stable=True).tolist()),
    ):
        for _ in range(50):
            fn()
        best = float("inf")
        for _ in range(30):  # best of 30 batches: the VM is shared
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            best = min(best, (time.perf_counter() - t0) / repeat)
        out[name] = best
    out["page_scores_per_token"] = out["page_scores"] * layers
    out["pages"], out["layers"] = pages, layers
    return out


def config_for(name: str, a: argparse.Namespace, store: str) -> EngineConfig:
    dense = name == "dense"
    return EngineConfig(
        model=a.model, device="cpu", max_context=a.context, kv_capacity=a.context if dense else a.pool,
        kvstore_addrs=(store,), host_kv_mib=a.host_kv_mib, prefill_chunk=512, max_running=1,
        rescore_interval=0 if dense else int(name), num_threads=a.threads,
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--intervals", default="0,1,4,16,64,dense", help="rescore_interval values; dense = no ring")
    p.add_argument("--cases", type=int, default=6)
    p.add_argument("--tasks", default="passkey")
    p.add_argument("--length", type=int, default=3072, help="prompt length target (tokens)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--host-kv-mib", type=int, default=2048)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--micro-pages", type=int, default=64)
    p.add_argument("--micro-repeat", type=int, default=200)
    p.add_argument("--out", default=str(ROOT / "bench/results/ring_decode_cpu.jsonl"))
    p.add_argument("--max-seconds", type=float, default=480.0, help="stop starting new cases after this")
    p.add_argument("--append-results", action="store_true", help="add the table to bench/RESULTS.md")
    p.add_argument("--note", default="", help="a closing paragraph for bench/RESULTS.md (the conclusion)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("services.kvstore.client").setLevel(logging.ERROR)  # pin renewals after the store stops
    start = time.monotonic()
    names = a.intervals.split(",")
    out = Path(a.out)
    done: dict[tuple, dict] = {}
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done[(r["config"], r["task"], r["depth"], r["answer"])] = r
    expected = a.cases * len(a.tasks.split(","))
    procs: list[subprocess.Popen] = []
    try:
        if sum(1 for k in done if k[0] in names) < expected * len(names):
            store, procs = start_store(a.host_kv_mib)
            _run_all(names, a, store, done, out, start)
    finally:
        for proc in reversed(procs):
            proc.terminate()
    rows = {n: [r for r in done.values() if r["config"] == n] for n in names}
    missing = sum(max(0, expected - len(rows[n])) for n in names)
    if missing:
        print(f"{missing} case(s) left; run the same command again to continue")
        return 0
    default_threads = torch.get_num_threads()
    micro = {}
    for threads in sorted({1, default_threads}):  # the run's setting (--threads 1) and torch's default
        torch.set_num_threads(threads)
        micro[threads] = microbench(a.micro_pages, 30, a.micro_repeat)
    torch.set_num_threads(default_threads)
    lines = table(rows, micro, a)
    print("\n".join(lines))
    if a.append_results:
        append_results(lines, a)
    return 0


def _run_all(names: list[str], a: argparse.Namespace, store: str, done: dict, out: Path, start: float) -> None:
    """Case by case, every configuration in turn (so that the shared machine's load falls on all of them
    alike): one ring engine whose rescore_interval is set before each request, one dense engine."""
    engines: dict[str, object] = {}
    try:
        for i in range(a.cases * len(a.tasks.split(","))):
            for name in names:
                kind = "dense" if name == "dense" else "ring"
                if kind not in engines:
                    engines[kind] = build_engine(config_for(name, a, store))[0]
                    engines[kind].bench_log = StepLog()  # type: ignore[attr-defined]
                    instrument(engines[kind], engines[kind].bench_log)  # type: ignore[attr-defined]
                engine = engines[kind]
                tok = engine.tokenizer  # type: ignore[attr-defined]
                case = make_cases(a, tok)[i]
                key = (name, case.task, case.depth, case.answer)
                if key in done:
                    continue
                if time.monotonic() - start > a.max_seconds:
                    return
                if kind == "ring":  # the engine reads limits.rescore_interval at every decode step
                    ring = engine.ring  # type: ignore[attr-defined]
                    ring.limits = replace(ring.limits, rescore_interval=int(name))
                log = engine.bench_log  # type: ignore[attr-defined]
                row = {"config": name, **run_case(engine, log, tok, case, a.new_tokens, f"{name}-{i}-{a.seed}")}
                done[key] = row
                out.parent.mkdir(parents=True, exist_ok=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"interval {name} case {i}: ok {row['ok']}, prefill {row['prefill_s']:.0f} s, decode "
                      f"{row['decode_steps'] / row['decode_s']:.1f} tok/s, restores {row['restores']}, "
                      f"selects {row['selects']}, answer {row['text'][:40]!r}", flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.stop()  # type: ignore[attr-defined]


def make_cases(a: argparse.Namespace, tok) -> list:  # type: ignore[no-untyped-def]
    rng = random.Random(a.seed)
    return [
        make_case(task, a.length, (i + 0.5) / a.cases, rng, tok, None, "raw")
        for task in a.tasks.split(",") for i in range(a.cases)
    ]  # fmt: skip


def table(rows: dict[str, list[dict]], micro: dict[int, dict], a: argparse.Namespace) -> list[str]:
    """Markdown: per interval, decode tokens/s, restores, bytes, time in select/restore, accuracy."""
    head = ("| rescore_interval | cases | decode tok/s, median of cases (min-max) | ms/token (all cases) | "
            "restores/case (decode) | restored MB/case | restore ms/token | select ms/token | selects/case | "
            "passkey right |")  # fmt: skip
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, rs in rows.items():
        steps = sum(r["decode_steps"] for r in rs)
        secs = sum(r["decode_s"] for r in rs)
        tps = sorted(r["decode_steps"] / r["decode_s"] for r in rs)
        median = tps[len(tps) // 2] if len(tps) % 2 else (tps[len(tps) // 2 - 1] + tps[len(tps) // 2]) / 2
        label = "dense (no ring)" if name == "dense" else name
        n = len(rs)
        restores = sum(r["restores"] for r in rs) / n
        mbytes = sum(r["restored_bytes"] for r in rs) / n / 1e6
        restore_ms = 1000 * sum(r["restore_s"] for r in rs) / steps
        select_ms = 1000 * sum(r["select_s"] for r in rs) / steps
        selects = sum(r["selects"] for r in rs) / n
        right = sum(r["ok"] for r in rs)
        out.append(
            f"| {label} | {n} | {median:.1f} ({tps[0]:.1f}-{tps[-1]:.1f}) | {1000 * secs / steps:.1f} | "
            f"{restores:.1f} | {mbytes:.1f} | "
            f"{restore_ms:.2f} | {select_ms:.3f} | {selects:.1f} | {right}/{n} |"
        )
    any_micro = next(iter(micro.values()))
    out += [
        "",
        f"Scoring microbenchmark (one decode token, {any_micro['pages']} pages, SmolLM2 shapes: 9 query heads, "
        f"3 KV heads, head_dim 64; best of 30 batches of {a.micro_repeat} calls):",
        "",
        "| operation | torch threads | µs per layer | µs per token (30 layers) |",
        "|---|---|---|---|",
    ]
    for threads, m in micro.items():
        out += [
            f"| summaries.page_scores (Quest bound + softmax) | {threads} | {1e6 * m['page_scores']:.1f} | "
            f"{1e6 * m['page_scores_per_token']:.0f} |",
            f"| summaries.mean_key_scores | {threads} | {1e6 * m['mean_key_scores']:.1f} | "
            f"{1e6 * m['mean_key_scores'] * 30:.0f} |",
            f"| argsort of {m['pages']} page scores (select's core, once per selection) | {threads} | "
            f"{1e6 * m['select_argsort']:.1f} | - |",
        ]
    return out


def append_results(lines: list[str], a: argparse.Namespace) -> None:
    """Append (never rewrite) to bench/RESULTS.md: re-read just before writing."""
    path = ROOT / "bench/RESULTS.md"
    text = path.read_text() if path.exists() else ""
    block = [
        "", HEADING, "",
        f"- Date: {datetime.date(2026, 11, 29)}. Hardware: 2-core CPU VM (no GPU), shared with other runs.",
        f"- Command: `.venv/bin/python bench/ring_decode.py --intervals {a.intervals} --cases {a.cases}"
        f"{f' --threads {a.threads}' if a.threads else ''}` "
        "(resumable; run until it prints the table, then `--append-results`).",
        f"- {a.model} fp32 on CPU, max_context {a.context}, kv_capacity {a.pool} (ring, sparse policy, engine "
        f"defaults otherwise), {a.tasks} prompts of ~{a.length} tokens (raw format), greedy, {a.new_tokens} new "
        "tokens with EOS ignored; decode figures cover the steps after the first token.",
        "", *lines,
        *(["", a.note] if a.note else []),
    ]  # fmt: skip
    sep = "" if text.endswith("\n") or not text else "\n"
    with path.open("a") as f:
        f.write(sep + "\n".join(block) + "\n")


if __name__ == "__main__":
    sys.exit(main())
