"""Needle retrieval through the ring: unlimited pool (dense) vs ring with retrieval vs ring without
retrieval (the negative control) vs exact, on locally generated passkey / multi-key / variable-tracking
prompts, in one run.

    .venv/bin/python bench/needle.py --lengths 2048,4096 --cases 10            # CPU, small
    python bench/needle.py --device cuda --lengths 2048,4096,8000 --cases 20   # H200 (see bench/RESULTS.md)

Needs a kvstore (the ring's host copy): --kvstore ADDR, or the bench starts redis-server and one
kvstore process itself. Greedy decoding; a case is right when the needle's number appears in the
first tokens of the answer. Retrieval proves itself when ring ~ dense while the control falls far below.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.longeval.tasks import digit_tokens  # noqa: E402
from services.cacheguard.renderer import ChatRenderer  # noqa: E402
from services.common.tokenizer import Tokenizer  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed  # noqa: E402

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NAMES = ["ALPHA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL"]
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)


@dataclass(frozen=True)
class Case:
    task: str
    length: int
    depth: float
    prompt_text: str  # rendered chat prompt plus the start of the answer
    question_text: str
    answer: str


def _haystack(tok: Tokenizer, target_tokens: int) -> list[str]:
    n = max(1, target_tokens // len(tok.encode(FILLER)))
    return [FILLER] * n


def make_case(
    task: str, length: int, depth: float, rng: random.Random, tok: Tokenizer, render, fmt: str = "raw"
) -> Case:
    key = str(rng.randrange(10000, 99999))
    filler = _haystack(tok, length - 120)
    at = int(len(filler) * depth)
    if task == "passkey":
        needles = [(at, f"The pass key is {key}. Remember it. {key} is the pass key. ")]
        question, prefix = "What is the pass key?", "The pass key is"
    elif task == "multikey":
        names = rng.sample(NAMES, 4)
        spots = sorted(rng.sample(range(len(filler)), 3))
        needles = [
            (s, f"The pass key for {n} is {rng.randrange(10000, 99999)}. ")
            for s, n in zip(spots, names[1:], strict=True)
        ]
        needles.append((at, f"The pass key for {names[0]} is {key}. "))
        question, prefix = f"What is the pass key for {names[0]}?", f"The pass key for {names[0]} is"
    elif task == "vartrack":
        a, b = rng.sample(NAMES, 2)
        later = min(len(filler), at + max(1, (len(filler) - at) // 2))
        needles = [(at, f"VAR {a} = {key}. "), (later, f"VAR {b} = VAR {a}. ")]
        question, prefix = f"What is the value of VAR {b}?", f"The value of VAR {b} is"
    else:
        raise ValueError(task)
    parts = list(filler)
    for spot, text in sorted(needles, reverse=True):
        parts.insert(spot, text)
    user = INTRO + "".join(parts) + "\n\n" + question
    if fmt == "chat":
        prompt = render([{"role": "user", "content": user}]) + prefix
    else:
        prompt = user + " " + prefix
    return Case(task, length, depth, prompt, question, key)


def digit_bias(tok: Tokenizer) -> dict[int, float]:
    """logit_bias that confines greedy decoding to the digit tokens (MODELS.md: Gemma 3 base completes
    "The pass key is" with words unless decoding is restricted; whenever it emits a number it is right)."""
    return {i: 100.0 for i in sorted(digit_tokens(tok.encode))}


def run_case(
    engine, tok: Tokenizer, case: Case, max_new: int, bias: dict[int, float] | None = None
) -> tuple[bool, str, float, dict]:
    ids = tok.encode(case.prompt_text, add_special_tokens=True)  # BOS where the model wants it (Gemma)
    q_at = case.prompt_text.rfind(case.question_text)
    query_start = min(len(ids) - 1, len(tok.encode(case.prompt_text[:q_at], add_special_tokens=True)))
    params = SamplingParams(temperature=0.0, max_tokens=max_new, logit_bias=dict(bias or {}))
    t0 = time.perf_counter()
    seq = engine.submit(f"{case.task}-{case.length}-{case.depth:.2f}", ids, params, query_start=query_start)
    text, done = "", None
    while done is None:
        ev = seq.events.get()
        if isinstance(ev, Chunk):
            text += ev.text
        elif isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        else:
            done = ev
    assert isinstance(done, Done)
    meta = {"prompt_tokens": len(ids), "policy": done.prefill_policy, "unverified": done.unverified}
    return case.answer in text, text, time.perf_counter() - t0, meta


def start_store(host_kv_mib: int) -> tuple[str, list[subprocess.Popen]]:
    """redis-server + one kvstore process on loopback; returns the kvstore address."""

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    redis_port, store_port = port(), port()
    redis_exe = shutil.which("redis-server") or "redis-server"
    procs = [
        subprocess.Popen(
            [redis_exe, "--port", str(redis_port), "--save", "", "--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL
        )
    ]
    time.sleep(0.5)
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "services.kvstore", "--listen-addr", f"127.0.0.1:{store_port}", "--host-kv-mib",
         str(host_kv_mib), "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--replica-id", f"needle-{store_port}"],
        cwd=Path(__file__).resolve().parents[1], stderr=subprocess.DEVNULL,
    ))  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", store_port), timeout=0.2).close()
            time.sleep(0.5)
            return f"127.0.0.1:{store_port}", procs
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("kvstore did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", default="2048,4096")
    p.add_argument("--tasks", default="passkey,multikey,vartrack")
    p.add_argument("--cases", type=int, default=10, help="cases per (task, length)")
    p.add_argument("--pool", type=int, default=1024, help="device pool (tokens) of the ring configurations")
    p.add_argument(
        "--configs",
        default="dense,ring,noretrieval,exact",
        help="comma list of dense, ring, noretrieval, exact; ring:S sets retrieval_share S; ring@FMT the KV format "
        '("/" for ",": ring@nvfp4/global=bf16)',
    )
    p.add_argument("--kvstore", default="")
    p.add_argument("--host-kv-mib", type=int, default=8192)
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--out", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", action="store_true", help="decode digits only (logit_bias; for base models)")
    p.add_argument("--max-cases", default="", help="cap per config, e.g. exact=12 (cases spread over the cells)")
    p.add_argument(
        "--format",
        default="raw",
        choices=["raw", "chat"],
        help="raw completion (the classic passkey prompt) or the model's chat template",
    )
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    lengths = [int(x) for x in a.lengths.split(",")]
    tasks = a.tasks.split(",")
    procs: list[subprocess.Popen] = []
    store = a.kvstore
    if not store:
        store, procs = start_store(a.host_kv_mib)
    try:
        return _bench(a, lengths, tasks, store)
    finally:
        for proc in reversed(procs):
            proc.terminate()


def _bench(a: argparse.Namespace, lengths: list[int], tasks: list[str], store: str) -> int:
    context = max(lengths) + 512
    context = -(-context // 64) * 64
    base = EngineConfig(
        model=a.model,
        device=a.device,
        max_context=context,
        kv_capacity=context,
        kvstore_addrs=(store,),
        host_kv_mib=a.host_kv_mib,
        prefill_chunk=512,
        max_running=1,
    )
    ring = replace(base, kv_capacity=a.pool)
    configs = {
        "dense": base,
        "ring": ring,
        "noretrieval": replace(ring, retrieval=False),
        "exact": replace(ring, prefill_policy="exact"),
    }
    chosen = a.configs.split(",")
    for name in chosen:  # "ring:0.8": retrieval_share 0.8; "ring@fp8": KV format fp8 ("/" for ",": nvfp4/global=bf16)
        kind, _, spec = name.partition("@")
        kind, _, share = kind.partition(":")
        if name not in configs:
            configs[name] = replace(configs[kind], retrieval_share=float(share or configs[kind].retrieval_share),
                                    kv_format=spec.replace("/", ",") if spec else configs[kind].kv_format)  # fmt: skip
    caps = {k: int(v) for k, v in (x.split("=") for x in a.max_cases.split(",") if x)}
    results: dict[str, list[dict]] = {}
    cases: list[Case] | None = None
    tok = None
    for name in chosen:
        engine, info = build_engine(configs[name])
        tok = engine.tokenizer
        if cases is None:
            render = ChatRenderer(tok.info).render
            rng = random.Random(a.seed)
            cases = [
                make_case(task, length, (i + 0.5) / a.cases, rng, tok, render, a.format)
                for length in lengths for task in tasks for i in range(a.cases)
            ]  # fmt: skip
        rows = []
        bias = digit_bias(tok) if a.digits else None
        for case in _subset(cases, caps.get(name.split(":")[0])):
            ok, text, secs, meta = run_case(engine, tok, case, a.max_new, bias)
            rows.append({"task": case.task, "length": case.length, "depth": case.depth, "ok": ok, "text": text,
                         "seconds": secs, **meta})  # fmt: skip
        results[name] = rows
        engine.stop()
        print(
            f"{name}: {sum(r['ok'] for r in rows)}/{len(rows)} in {sum(r['seconds'] for r in rows):.0f} s", flush=True
        )
    _print_table(results, lengths, tasks, a)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def _subset(cases: list[Case], cap: int | None) -> list[Case]:
    """At most `cap` cases, taken evenly across the list (so every task and length keeps some)."""
    if cap is None or cap >= len(cases):
        return cases
    step = len(cases) / cap
    return [cases[int(i * step)] for i in range(cap)]


def _print_table(results: dict[str, list[dict]], lengths: list[int], tasks: list[str], a: argparse.Namespace) -> None:
    names = list(results)
    decoding = "greedy, digits only" if a.digits else "greedy"
    print(f"\nmodel {a.model}, device {a.device}, ring pool {a.pool} tokens, {a.cases} cases per cell, {decoding}")
    print(f"{'task':<10} {'length':>7} | " + " | ".join(f"{n:>11}" for n in names))
    for task in tasks:
        for length in lengths:
            cells = []
            for n in names:
                rows = [r for r in results[n] if r["task"] == task and r["length"] == length]
                cells.append(f"{sum(r['ok'] for r in rows):>4}/{len(rows):<3}   ")
            print(f"{task:<10} {length:>7} | " + " | ".join(f"{c:>11}" for c in cells))
    totals = []
    for n in names:
        rows = results[n]
        acc = 100.0 * sum(r["ok"] for r in rows) / max(1, len(rows))
        totals.append(f"{acc:>10.1f}%")
    print(f"{'all':<10} {'':>7} | " + " | ".join(totals))
    secs = [f"{sum(r['seconds'] for r in results[n]) / max(1, len(results[n])):>10.2f}s" for n in names]
    print(f"{'s/case':<10} {'':>7} | " + " | ".join(secs))
    flagged = [f"{sum(r['unverified'] for r in results[n]):>11}" for n in names]
    print(f"{'unverified':<10} {'':>7} | " + " | ".join(flagged))


if __name__ == "__main__":
    sys.exit(main())
