"""Over-pool accuracy: `shard` vs `sparse` vs `exact` vs an unlimited pool, on a generated suite.

    .venv/bin/python bench/overflow.py                          # every config, the whole suite
    .venv/bin/python bench/overflow.py --configs shard,unlimited --quick

The suite: a pass key hidden at several depths of a document about four times the pool, exact
aggregations over log/CSV records spread across the document, and unanswerable questions. Each
config answers every case through the real stack (launcher, real model):
- shard / sparse / exact: a pool of --pool tokens (context --max-context), over_pool_policy as named;
- unlimited: a pool as large as the context, so every prompt is one direct call (a plain engine).
An answer is correct, refused (a visible L3 refusal), flagged (wrong, but `kvmem.plan.unverified`
says so) or **silently wrong** (wrong and not flagged): the number that must be 0 for `shard`.
sparse/exact need an engine with a ring; without one they print "n/a (engine has no ring)".
"""

from __future__ import annotations

import argparse
import logging
import random
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.launcher import LaunchConfig, Stack, free_port  # noqa: E402

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
DECLINES = re.compile(
    r"not found|no (pass ?key|launch code)|does not (contain|mention|say|include)|doesn't|cannot|can't|unable|"
    r"not (mentioned|provided|given|specified|stated)|unknown|could not answer",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # passkey, aggregate, unanswerable
    messages: list[dict[str, str]]
    is_correct: Callable[[str], bool]


def haystack(rng: random.Random, num_sentences: int, insert: str | None, depth: float) -> str:
    sentences = [rng.choice(FILLER) for _ in range(num_sentences)]
    if insert is not None:
        sentences.insert(int(depth * num_sentences), insert)
    return " ".join(sentences)


def passkey_case(depth: float, seed: int, num_sentences: int) -> Case:
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    text = haystack(rng, num_sentences, f"The pass key is {key}. Remember it. {key} is the pass key.", depth)
    content = f"There is a pass key hidden in the text below. Find it.\n\n{text}\n\nWhat is the pass key?"
    return Case(f"passkey@{depth:.2f}", "passkey", [{"role": "user", "content": content}], lambda a: key in a)


def has_number(answer: str, number: int) -> bool:
    return re.search(rf"(?<![\d.]){number}(?![\d]|\.\d)", answer) is not None


def log_cases(seed: int, num_lines: int) -> list[Case]:
    rng = random.Random(seed)
    lines = []
    for i in range(num_lines):
        status = "FAILED" if rng.random() < 0.12 else "OK"
        user = rng.choice(["ann", "bob", "cy", "dee"])
        lines.append(
            f"2026-03-{i % 28 + 1:02d} 10:{i % 60:02d}:{i % 50:02d} job={1000 + i} user={user} status={status} "
            f"bytes={rng.randint(10, 999)}"
        )
    failed = [ln for ln in lines if "status=FAILED" in ln]
    failed_bytes = sum(int(ln.rsplit("bytes=", 1)[1]) for ln in failed)
    bob = sum(1 for ln in lines if "user=bob " in ln)
    doc = "\n".join(lines)

    def ask(question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Job log:\n\n{doc}\n\n{question}"}]

    return [
        Case(
            "count FAILED", "aggregate", ask("How many jobs have status=FAILED?"), lambda a: has_number(a, len(failed))
        ),
        Case(
            "sum bytes",
            "aggregate",
            ask("What is the total bytes of the FAILED jobs?"),
            lambda a: has_number(a, failed_bytes),
        ),
        Case("count user", "aggregate", ask("How many jobs did user bob run?"), lambda a: has_number(a, bob)),
    ]


def csv_cases(seed: int, num_rows: int) -> list[Case]:
    rng = random.Random(seed)
    rows = [(1000 + i, rng.choice(["Oslo", "Rome", "Lima", "Kyiv"]), rng.randint(5, 500)) for i in range(num_rows)]
    doc = "order_id,city,amount\n" + "\n".join(f"{o},{c},{a}" for o, c, a in rows)
    oslo = sum(1 for _, c, _ in rows if c == "Oslo")

    def ask(question: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Orders:\n\n{doc}\n\n{question}"}]

    return [
        Case("csv count", "aggregate", ask("How many rows have city Oslo?"), lambda a: has_number(a, oslo)),
        Case("csv semantic", "aggregate", ask("How many orders were shipped to Oslo?"), lambda a: has_number(a, oslo)),
    ]


def unanswerable_cases(seed: int, num_sentences: int) -> list[Case]:
    rng = random.Random(seed)
    no_key = haystack(rng, num_sentences, None, 0)
    with_key = haystack(rng, num_sentences, "The pass key is 31337. Remember it.", 0.5)
    intro = "There is a pass key hidden in the text below. Find it.\n\n"
    return [
        Case(
            "no pass key",
            "unanswerable",
            [{"role": "user", "content": f"{intro}{no_key}\n\nWhat is the pass key?"}],
            bool,
        ),
        Case(
            "launch code",
            "unanswerable",
            [{"role": "user", "content": f"{with_key}\n\nWhat is the launch code?"}],
            bool,
        ),
    ]


def suite(quick: bool, doc_sentences: int, doc_lines: int) -> list[Case]:
    depths = (0.1, 0.5, 0.9) if quick else (0.05, 0.3, 0.5, 0.7, 0.95)
    cases = [passkey_case(d, 100 + k, doc_sentences) for k, d in enumerate(depths)]
    cases += log_cases(7, doc_lines)
    cases += csv_cases(9, doc_lines * 4)
    cases += unanswerable_cases(11, doc_sentences)
    return cases[:-1] if quick else cases


@dataclass
class Outcome:
    case: str
    kind: str
    verdict: str  # correct, refused, flagged, silent_wrong
    level: str
    seconds: float
    answer: str


def judge(case: Case, answer: str, plan: dict[str, Any]) -> str:
    refused = plan.get("level") == "L3"
    if case.kind == "unanswerable":
        if refused or DECLINES.search(answer):
            return "correct"
    elif refused:
        return "refused"
    elif case.is_correct(answer):
        return "correct"
    return "flagged" if plan.get("unverified") else "silent_wrong"


def run_config(stack: Stack, label: str, policy: str, cases: list[Case], max_tokens: int) -> list[Outcome]:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=1200)
    outcomes = []
    served = client.models.list().data[0].id  # another name is a 404 model_not_found
    for case in cases:
        t0 = time.perf_counter()
        try:
            r = client.chat.completions.create(
                model=served,
                messages=case.messages,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=max_tokens,
                extra_body={"kvmem": {"over_pool_policy": policy}},
            )
            answer = r.choices[0].message.content or ""
            plan = dict((r.model_extra or {}).get("kvmem", {}).get("plan") or {})
        except openai.APIStatusError as exc:  # a visible error is not a silent answer
            answer, plan = f"HTTP {exc.status_code}: {exc.message}", {"level": "L3"}
        seconds = time.perf_counter() - t0
        outcome = Outcome(case.name, case.kind, judge(case, answer, plan), str(plan.get("level", "?")), seconds, answer)
        outcomes.append(outcome)
        print(
            f"  {label:9s} {case.name:14s} {outcome.verdict:12s} {outcome.level:4s} {seconds:6.1f} s  "
            f"{' '.join(answer.split())[:90]!r}",
            flush=True,
        )
    return outcomes


def start_stack(pool: int, max_context: int) -> Stack:
    host_kv_mib = max(512, max_context // 8)  # the ring's start-up guard: the host store holds the context
    stack = Stack(
        LaunchConfig(port=free_port(), host_kv_mib=host_kv_mib, max_context=max_context, kv_capacity=pool),
        echo=False,
    )
    stack.start()
    return stack


def has_ring(stack: Stack) -> bool:
    card = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"][0]["kvmem"]
    return bool(card["max_context"] > card["kv_capacity"])


def table(results: dict[str, list[Outcome] | None], cases: list[Case]) -> str:
    kinds = ["passkey", "aggregate", "unanswerable"]
    counts = {k: sum(1 for c in cases if c.kind == k) for k in kinds}
    head = "| config | " + " | ".join(f"{k} ({counts[k]})" for k in kinds)
    head += " | correct | refused | flagged wrong | **silent wrong** | s/case |"
    lines = [head, "|" + "---|" * (len(kinds) + 6)]
    for name, outcomes in results.items():
        if outcomes is None:
            lines.append(f"| {name} | " + " | ".join(["n/a (engine has no ring)"] + [""] * (len(kinds) + 4)) + " |")
            continue
        per_kind = [f"{sum(o.verdict == 'correct' for o in outcomes if o.kind == k)}/{counts[k]}" for k in kinds]
        totals = [sum(o.verdict == v for o in outcomes) for v in ("correct", "refused", "flagged", "silent_wrong")]
        seconds = sum(o.seconds for o in outcomes) / len(outcomes)
        lines.append(
            f"| {name} | " + " | ".join(per_kind) + f" | {totals[0]}/{len(outcomes)} | {totals[1]} | {totals[2]} "
            f"| **{totals[3]}** | {seconds:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="shard,sparse,exact,unlimited")
    p.add_argument("--pool", type=int, default=1024, help="device pool of shard/sparse/exact (tokens)")
    p.add_argument("--max-context", type=int, default=8192)
    p.add_argument("--doc-sentences", type=int, default=880, help="haystack sentences (~4.5 tokens each)")
    p.add_argument("--doc-lines", type=int, default=120, help="log records (~38 tokens each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="fewer cases")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the stacks on the way out
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    cases = suite(a.quick, a.doc_sentences, a.doc_lines)
    print(f"{len(cases)} cases; configs {', '.join(configs)}; pool {a.pool}, context {a.max_context}", flush=True)
    results: dict[str, list[Outcome] | None] = {}
    small = [c for c in configs if c != "unlimited"]
    if small:
        stack = start_stack(a.pool, a.max_context)
        try:
            ring = has_ring(stack)
            for policy in small:
                if policy in ("sparse", "exact") and not ring:
                    results[policy] = None
                    continue
                results[policy] = run_config(stack, policy, policy, cases, a.max_tokens)
        finally:
            stack.stop()
    if "unlimited" in configs:
        stack = start_stack(a.max_context, a.max_context)
        try:
            results["unlimited"] = run_config(stack, "unlimited", "shard", cases, a.max_tokens)  # all fit: L1
        finally:
            stack.stop()
    print()
    print(table({c: results[c] for c in configs if c in results}, cases))
    return 0


if __name__ == "__main__":
    sys.exit(main())
