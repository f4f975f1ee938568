"""Drive the real stack over HTTP (openai SDK) with the long-context grid; print a table with Wilson 95%
intervals, write every answer to JSON.

    .venv/bin/python -m bench.longeval.run --split tuning --lengths 4096 --per-cell 4 --configs dense,sparse
    python -m bench.longeval.run --split heldout --lengths 4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --per-cell 4

Configurations: `dense` (a stack whose pool holds the whole context: no ring), `sparse` / `exact` /
`shard` (a stack with a `--pool`-token pool; the request's kvmem.over_pool_policy), `off` (the same pool
with KVMEM_RETRIEVAL=0: the ring keeps no evidence, the negative control). Each stack is started with
deploy.launcher.Stack (what `make run` and the e2e tests start: redis, kvstore, engine, cache guard,
gateway as processes) and stopped after its configurations ran.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai

from bench.longeval.split import SPLITS
from bench.longeval.tasks import NUMERIC, SHAPES, TASKS, Case, digit_tokens, found, make_case, score
from deploy.launcher import LaunchConfig, Stack
from services.common.model_files import resolve_model_path
from services.common.tokenizer import load_tokenizer

logger = logging.getLogger("bench.longeval")
CONFIGS = ("dense", "sparse", "off", "exact", "shard")
RETRIEVAL_TASKS = tuple(t for t in TASKS if t != "fwe")
# selection variants (a configuration `sparse@v1` runs the ring stack with that environment): v0 is the ring
# before issue 25 (the query from the start of the last user turn, the Quest bound, mass summed over heads, recent
# pages competing, three picks with seam neighbours, decode re-selections replacing the set); v1 the question's
# span, recent pages out, decode re-selections keeping the prompt's best 4 pages; v2 = v1 with per-head votes
# (top 4); v3 (the defaults since 2026-12-02, spelled out) below. Each variant sets every option it depends on.
_BOUND = {"KVMEM_RING_QUERY_PASS": "bound", "KVMEM_RING_SCORE_FROM": "0", "KVMEM_NEIGHBOR_PAGES": "1"}
VARIANTS: dict[str, dict[str, str]] = {
    "v0": {**_BOUND, "KVMEM_CACHEGUARD_QUERY_SPAN": "turn", "KVMEM_RING_VOTE_TOP": "0", "KVMEM_RING_ANCHOR_PAGES": "0",
           "KVMEM_RING_EXCLUDE_RECENT": "0"},
    "v1": {**_BOUND, "KVMEM_CACHEGUARD_QUERY_SPAN": "question", "KVMEM_RING_VOTE_TOP": "0",
           "KVMEM_RING_ANCHOR_PAGES": "4", "KVMEM_RING_EXCLUDE_RECENT": "1"},
    "v2": {**_BOUND, "KVMEM_CACHEGUARD_QUERY_SPAN": "question", "KVMEM_RING_VOTE_TOP": "4",
           "KVMEM_RING_ANCHOR_PAGES": "4", "KVMEM_RING_EXCLUDE_RECENT": "1"},
    # v3: the question's own real attention picks the pages (the last chunk attends every page), the upper half
    # of the layers' heads summed, no seam neighbours (nine picks, not three), decode keeping the best 4
    "v3": {"KVMEM_CACHEGUARD_QUERY_SPAN": "question", "KVMEM_RING_QUERY_PASS": "exact", "KVMEM_RING_HEAD_FUSION": "sum",
           "KVMEM_RING_SCORE_FROM": "0.5", "KVMEM_NEIGHBOR_PAGES": "0", "KVMEM_RING_ANCHOR_PAGES": "4",
           "KVMEM_RING_VOTE_TOP": "0", "KVMEM_RING_EXCLUDE_RECENT": "0", "KVMEM_RING_READ_AHEAD": "0",
           "KVMEM_RING_FOLLOW_COPY": "0", "KVMEM_RESCORE_INTERVAL": "16", "KVMEM_RING_QUESTION_REPLAY": "0"},
}  # fmt: skip
# v3 with every layer scoring (Gemma 3's global layers are 5, 11 and 17: the upper half leaves two of three voting)
VARIANTS["v3all"] = {**VARIANTS["v3"], "KVMEM_RING_SCORE_FROM": "0"}
# v4: every layer scores, each head's candidate mass as shares, a page ranked by its largest share in any one head
# (`max`: the head that singles a page out decides) or by the shares weighted by each head's concentration (`peak`)
VARIANTS["v4max"] = {**VARIANTS["v3all"], "KVMEM_RING_HEAD_FUSION": "max"}
VARIANTS["v4peak"] = {**VARIANTS["v3all"], "KVMEM_RING_HEAD_FUSION": "peak"}
# decode re-selection (issue 25 item 3, the `recite` task): v3 with each decode pick's next page(s) read ahead
# (ra1, ra2), and v3 with no decode re-selection at all (the prompt's selection kept to the end: its control)
VARIANTS["ra1"] = {**VARIANTS["v3"], "KVMEM_RING_READ_AHEAD": "1"}
VARIANTS["ra2"] = {**VARIANTS["v3"], "KVMEM_RING_READ_AHEAD": "2"}
VARIANTS["noresel"] = {**VARIANTS["v3"], "KVMEM_RESCORE_INTERVAL": "0"}
# copy following (ring_follow_copy): each decode re-selection leads with the pages where the answer's last 4 tokens
# occur in the prompt, alone (follow) and with the prompt's read-ahead of 4 pages (followra4), and that read-ahead
# alone (ra4)
VARIANTS["follow"] = {**VARIANTS["v3"], "KVMEM_RING_FOLLOW_COPY": "4"}
VARIANTS["ra4"] = {**VARIANTS["v3"], "KVMEM_RING_READ_AHEAD": "4"}
VARIANTS["followra4"] = {**VARIANTS["follow"], "KVMEM_RING_READ_AHEAD": "4"}
VARIANTS["followra1"] = {**VARIANTS["follow"], "KVMEM_RING_READ_AHEAD": "1"}
VARIANTS["followra2"] = {**VARIANTS["follow"], "KVMEM_RING_READ_AHEAD": "2"}
# the defaults since 2026-12-06: v3 with copy following and a read-ahead of 2 (= followra2)
VARIANTS["v4"] = dict(VARIANTS["followra2"])
# the defaults since 2026-12-06 (later): v4 with the question replay (a long chat message's first paragraph read
# again after the document, alone when it is the question of a question-first chat)
VARIANTS["v5"] = {**VARIANTS["v4"], "KVMEM_RING_QUESTION_REPLAY": "1"}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score 95% interval of k successes in n trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def build_cases(args: argparse.Namespace, count, digits: tuple[int, ...]) -> list[Case]:
    split = SPLITS[args.split]
    kinds = [k for k in split.kinds if not args.kinds or k[0] in args.kinds.split(",")]
    tasks = args.tasks.split(",")
    shapes = args.shapes.split(",")
    cases = []
    for length in (int(x) for x in args.lengths.split(",")):
        # k: the length's running case number; task k mod T and shape (k + k // lcm(T, S)) mod S give each
        # (task, shape) pair once in every T x S cases, and consecutive cases (one depth's cell) differ in both
        k, lcm = 0, math.lcm(len(tasks), len(shapes))
        for depth in (float(x) for x in args.depths.split(",")):
            for i in range(args.per_cell):
                # a balanced, seeded assignment of task, shape and haystack to the cell's cases (an earlier rule,
                # before 2026-12-02, tied each task to one shape whenever the depths were alike modulo the tasks)
                rng = random.Random(f"{split.seed}:{length}:{depth}:{i}")
                task = tasks[k % len(tasks)]
                shape = shapes[(k + k // lcm) % len(shapes)]
                k += 1
                if shape == "completion_digits" and task not in NUMERIC:
                    shape = "completion"
                kind, half = kinds[rng.randrange(len(kinds))]
                if task == "codeqa" and "code" in [k for k, _ in kinds]:
                    kind, half = next(k for k in kinds if k[0] == "code")
                if task == "recite" and kind == "prose" and len(kinds) > 1:  # its passage is docstring sentences
                    others = [k for k in kinds if k[0] != "prose"]
                    kind, half = others[rng.randrange(len(others))]
                cases.append(make_case(split, task, kind, half, length, depth, shape, i, count, digits))
    return cases


def ask(client: openai.OpenAI, model: str, case: Case, policy: str | None) -> dict[str, Any]:
    extra = {"kvmem": {"over_pool_policy": policy}} if policy else None
    t0 = time.perf_counter()
    try:
        if case.messages is not None:
            r = client.chat.completions.create(model=model, messages=case.messages, max_tokens=case.max_tokens,
                                               temperature=0, extra_body=extra)  # fmt: skip
            text = r.choices[0].message.content or ""
        else:
            r = client.completions.create(model=model, prompt=case.prompt, max_tokens=case.max_tokens, temperature=0,
                                          logit_bias=case.logit_bias or None, extra_body=extra)  # fmt: skip
            text = r.choices[0].text
    except openai.APIError as exc:
        return {"case_id": case.case_id, "error": f"{type(exc).__name__}: {exc}"[:300], "correct": False,
                "latency_s": time.perf_counter() - t0}  # fmt: skip
    plan = (r.model_extra or {}).get("kvmem", {}).get("plan", {})
    return {
        "case_id": case.case_id, "text": text, "correct": score(case, text), "latency_s": time.perf_counter() - t0,
        "prompt_tokens": r.usage.prompt_tokens if r.usage else None, "plan": plan, "found": found(case, text),
        "completion_tokens": r.usage.completion_tokens if r.usage else None,
    }  # fmt: skip


def ttft(client: openai.OpenAI, model: str, case: Case, policy: str | None) -> float:
    """Seconds to the first streamed token (chat) of one case, cold: a nonce ahead of the first message keeps the
    stack's prefix cache (which holds the case if it was asked) out of it."""
    extra = {"kvmem": {"over_pool_policy": policy}} if policy else None
    messages = [dict(m) for m in case.messages or []]
    messages[0]["content"] = f"[{uuid.uuid4().hex[:12]}] {messages[0]['content']}"
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, extra_body=extra)  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


PAGE_TOKENS = 64  # the engine's default page size: a --pool-ratio pool is whole pages


def pool_for(args: argparse.Namespace, length: int | None) -> int:
    """A ring stack's kv capacity: --pool tokens, or with --pool-ratio R, a length's prompt / R in whole pages."""
    if not args.pool_ratio or length is None:
        return int(args.pool)
    return max(PAGE_TOKENS, int(length / args.pool_ratio) // PAGE_TOKENS * PAGE_TOKENS)


def stack_for(
    config: str, args: argparse.Namespace, length: int | None = None
) -> tuple[str, LaunchConfig, dict[str, str]]:
    """(stack key, launch config, extra environment) of a configuration (`name` or `name@variant`); with
    --pool-ratio every configuration has a stack per prompt length (`length`), its key suffixed `:length`."""
    max_context = min(max(int(x) for x in args.lengths.split(",")) + 2048, args.max_context)
    suffix = f":{length}" if length is not None else ""
    name, _, variant = config.partition("@")
    if variant:
        key, cfg, env = stack_for(name, args, length)
        key = config if args.stack_per_config else f"{key.removesuffix(suffix)}@{variant}"
        return key + suffix, cfg, {**env, **VARIANTS[variant]}
    if config == "dense":
        dense = LaunchConfig(model=args.model, port=args.port, max_context=max_context, kv_capacity=max_context,
                             host_kv_mib=args.host_kv_mib, ready_timeout_s=600)  # fmt: skip
        return "dense" + suffix, dense, {}
    cfg = LaunchConfig(model=args.model, port=args.port, max_context=max_context, kv_capacity=pool_for(args, length),
                       host_kv_mib=args.host_kv_mib, ready_timeout_s=600)  # fmt: skip
    if config == "off":
        return "off" + suffix, cfg, {"KVMEM_RETRIEVAL": "0"}
    return (config if args.stack_per_config else "ring") + suffix, cfg, {}


def run(args: argparse.Namespace, partial: Path | None = None) -> dict[str, Any]:
    """Every configuration's answers; with `partial`, what has been answered so far is rewritten there after each
    configuration (a run cut short keeps it)."""
    tok = load_tokenizer(resolve_model_path(args.model))
    count = lambda s: len(tok.encode(s))  # noqa: E731
    t0 = time.time()
    cases = build_cases(args, count, digit_tokens(tok.encode))
    logger.info("%d cases built in %.1f s", len(cases), time.time() - t0)
    by_id = {c.case_id: c for c in cases}
    configs = args.configs.split(",")
    groups: dict[str, list[str]] = defaultdict(list)
    launch: dict[str, tuple[LaunchConfig, dict[str, str]]] = {}
    only: dict[str, int | None] = {}  # stack key -> the one prompt length it answers (--pool-ratio), or None
    lengths = sorted({c.length for c in cases})
    for c in configs:
        for length in lengths if args.pool_ratio else [None]:  # dense too: the lengths' stacks run at once
            key, cfg, env = stack_for(c, args, length)
            groups[key].append(c)
            launch[key] = (cfg, env)
            only[key] = length
    # asked in one seeded shuffled order, the same for every configuration: a run cut by --budget-s keeps a uniform
    # sample of the grid, paired across configurations as far as each got
    asked = random.Random(0).sample(cases, len(cases))
    results: dict[str, list[dict[str, Any]]] = defaultdict(list)
    ttfts: dict[str, list[float]] = {}
    lock = threading.Lock()

    def one_stack(key: str, port: int) -> None:
        cfg, env = launch[key]
        cfg = dataclasses.replace(cfg, port=port, extra_env=tuple(sorted(env.items())))
        stack = Stack(cfg, echo=False)
        stack.start()
        try:
            client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=args.timeout)
            model = client.models.list().data[0].id
            for config in groups[key]:
                base = config.partition("@")[0]
                policy = {"dense": None, "off": "sparse"}.get(base, base)
                t1 = time.time()
                stop_at = t1 + args.budget_s if args.budget_s else float("inf")

                def job(case: Case, policy: str | None = policy, stop_at: float = stop_at) -> dict[str, Any] | None:
                    return ask(client, model, case, policy) if time.time() < stop_at else None

                mine = [c for c in asked if only[key] is None or c.length == only[key]]
                with ThreadPoolExecutor(args.concurrency) as pool:
                    done = [r for r in pool.map(job, mine) if r is not None]
                with lock:
                    results[config].extend(done)
                    if partial is not None:
                        partial.write_text(json.dumps({"cases": {c.case_id: c.record() for c in cases},
                                                       "results": results}, indent=1))  # fmt: skip
                right = sum(r["correct"] for r in done)
                logger.info("%s (stack %s, pool %d): %d/%d right (%d asked) in %.0f s", config, key,
                            cfg.kv_capacity, right, len(done), len(mine), time.time() - t1)  # fmt: skip
                longest = max(x.length for x in cases)
                if args.ttft and only[key] in (None, longest):  # the longest prompts' stack (--pool-ratio) times them
                    chat = [c for c in cases if c.messages is not None and c.length == longest]
                    ttfts[config] = [ttft(client, model, c, policy) for c in chat[: args.ttft]]
        finally:
            stack.stop()

    keys = list(groups)
    if args.parallel_stacks:
        with ThreadPoolExecutor(len(keys)) as pool:
            list(pool.map(one_stack, keys, [args.port + 10 * i for i in range(len(keys))]))
    else:
        for key in keys:
            one_stack(key, args.port)
    return {"cases": {c.case_id: c.record() for c in cases}, "results": dict(results), "ttft_s": ttfts, "by_id": by_id}


def table(out: dict[str, Any], by: str) -> list[str]:
    """Rows of right/n (Wilson 95%) per configuration, grouped by a case field."""
    cases = out["by_id"]
    configs = list(out["results"])
    keys = sorted({getattr(c, by) for c in cases.values()}, key=str)
    lines = [f"| {by} | " + " | ".join(configs) + " |", "|---|" + "---|" * len(configs)]
    for k in [*keys, "all (retrieval tasks)"]:
        cells = []
        for config in configs:
            rs = [r for r in out["results"][config] if (getattr(cases[r["case_id"]], by) == k) or
                  (k == "all (retrieval tasks)" and cases[r["case_id"]].task in RETRIEVAL_TASKS)]  # fmt: skip
            n, right = len(rs), sum(r["correct"] for r in rs)
            lo, hi = wilson(right, n)
            cells.append(f"{right}/{n} = {100 * right / max(n, 1):.0f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.longeval.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--split", choices=sorted(SPLITS), default="tuning")
    p.add_argument("--model", default=os.environ.get("KVMEM_MODEL", "embedded:smollm2"))
    p.add_argument("--lengths", default="4096")
    p.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--per-cell", type=int, default=2, help="cases per (length, depth) cell")
    p.add_argument("--tasks", default="single_number,single_word,single_uuid,multikey,codeqa")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--kinds", default="", help="haystack kinds to keep (default: the split's)")
    p.add_argument("--configs", default="dense,sparse,off")
    p.add_argument("--max-context", type=int, default=8192, help="the stacks' cap (SmolLM2 has 8,192 positions)")
    p.add_argument("--pool", type=int, default=1024, help="ring stacks' kv capacity in tokens")
    p.add_argument(
        "--pool-ratio",
        type=float,
        default=0,
        help="instead of --pool: a ring stack per prompt length, its pool the length / this, in pages",
    )
    p.add_argument("--host-kv-mib", type=int, default=1024)
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--ttft", type=int, default=0, help="also stream this many chat cases at the longest length")
    p.add_argument("--parallel-stacks", action="store_true", help="start the stacks at once (a GPU host)")
    p.add_argument("--stack-per-config", action="store_true", help="one stack per configuration (run at once)")
    p.add_argument("--budget-s", type=float, default=0, help="stop asking a configuration after this long")
    p.add_argument("--label", default="")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"longeval_{args.split}_{args.label or time.strftime('%H%M')}"
    out = run(args, partial=Path(args.out, name + ".partial.json"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    head = (f"longeval {args.split} split, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
            f"{platform.node()} python {platform.python_version()}, "
            f"pool {f'length / {args.pool_ratio:g}' if args.pool_ratio else args.pool}, "
            f"{' '.join(sys.argv[1:])}")  # fmt: skip
    text = [head, ""]
    for by in ("task", "shape", "length", "depth", "kind"):
        text += table(out, by) + [""]
    for config, ts in out["ttft_s"].items():
        if ts:
            ts = sorted(ts)
            text.append(f"TTFT {config}: median {ts[len(ts) // 2]:.2f} s over {len(ts)} chat cases")
    print("\n".join(text))
    del out["by_id"]
    Path(args.out, name + ".json").write_text(json.dumps({"head": head, **out}, indent=1))
    Path(args.out, name + ".txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
