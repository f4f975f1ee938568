"""Structured output through the real stack: N random JSON schemas (tests/engine/schema_gen.py: nested objects,
arrays, enums, numbers, required and optional fields; seeded, the same on every machine) sent to the gateway over
HTTP with the openai SDK as `response_format: {type: json_schema, json_schema: {schema, strict: true}}`, greedy,
`--concurrency` requests in flight (a new one starts as soon as one ends). Every answer must parse and validate
against its schema (`jsonschema`), whatever its finish_reason: one that finished (`stop`) is `valid`; one the
budget ended (`length`) is `closed` when the engine's budget-aware completion closed it into a valid document
(grammar.py), `truncated` when it is an unfinished document (as OpenAI, vLLM and SGLang return it). Truncated,
invalid and errors are each a failure of the run.

    python -m bench.schema_validity --count 200 --concurrency 16 --max-tokens 1024 --out bench/results/x.json

`--first` picks the schemas (0..199 is the reported set; the prompt and max_tokens were chosen on 1000..1031);
`--ids` runs some again (e.g. the truncated ones with a larger max_tokens and `--max-context`).
Without `--url` the bench launches its own stack (deploy.launcher, its own redis) on `--port` and stops it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import jsonschema
import openai

from deploy.launcher import LaunchConfig, Stack
from tests.engine.schema_gen import random_schema

logger = logging.getLogger(__name__)

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You answer with one JSON object. Keep every string value short."


@dataclass
class Outcome:
    schema_id: int
    verdict: str  # valid | closed | invalid | truncated | error
    finish_reason: str
    completion_tokens: int
    seconds: float
    detail: str = ""  # why invalid / the error
    text: str = ""


def messages(schema: dict[str, Any]) -> list[dict[str, str]]:
    user = f"Give an example object for this JSON schema: {json.dumps(schema)}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def judge(schema_id: int, schema: dict[str, Any], text: str, finish: str, tokens: int, secs: float) -> Outcome:
    """The verdict of one answer: valid (stop) or closed (length) when it parses and validates against its schema;
    truncated when the budget ended it and it does not parse; invalid otherwise."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError as exc:
        verdict = "truncated" if finish == "length" else "invalid"
        return Outcome(schema_id, verdict, finish, tokens, secs, f"JSONDecodeError: {str(exc)[:300]}", text)
    except jsonschema.ValidationError as exc:
        return Outcome(schema_id, "invalid", finish, tokens, secs, f"ValidationError: {str(exc)[:300]}", text)
    verdict = {"stop": "valid", "length": "closed"}.get(finish, "invalid")
    return Outcome(schema_id, verdict, finish, tokens, secs, "" if verdict != "invalid" else f"finish {finish}", text)


def ask(client: openai.OpenAI, schema_id: int, max_tokens: int, frequency_penalty: float = 0.0) -> Outcome:
    schema = random_schema(schema_id)
    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(
            model=MODEL, messages=messages(schema), temperature=0, max_tokens=max_tokens,  # type: ignore[arg-type]
            frequency_penalty=frequency_penalty,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{schema_id}", "schema": schema, "strict": True}},
        )  # fmt: skip
    except openai.APIError as exc:
        return Outcome(schema_id, "error", "", 0, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"[:300])
    choice = r.choices[0]
    tokens = r.usage.completion_tokens if r.usage else 0
    text = choice.message.content or ""
    return judge(schema_id, schema, text, choice.finish_reason or "", tokens, time.perf_counter() - t0)


@contextmanager
def stack_at(url: str, port: int, max_context: int) -> Iterator[str]:
    if url:
        yield url
        return
    cfg = LaunchConfig(port=port, host_kv_mib=256, max_context=max_context, kv_capacity=16384, ready_timeout_s=600)
    s = Stack(cfg, echo=False)
    s.start()
    try:
        yield s.url
    finally:
        s.stop()


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=200)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--ids", default="", help="comma-separated schema ids instead of --first/--count")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--max-context", type=int, default=2048)
    ap.add_argument("--url", default="", help="a running gateway (default: launch a stack)")
    ap.add_argument("--port", type=int, default=18210)
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="the request's own (default 0: none)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ids = [int(i) for i in a.ids.split(",")] if a.ids else list(range(a.first, a.first + a.count))
    started_at = os.environ.get("KVMEM_COMMIT") or commit()  # the code the stack runs (HEAD may move meanwhile)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    t_start = time.perf_counter()
    with stack_at(a.url, a.port, a.max_context) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=1800)
        t_start = time.perf_counter()

        def one(i: int) -> None:
            o = ask(client, i, a.max_tokens, a.frequency_penalty)
            with lock:
                outcomes.append(o)
                n = len(outcomes)
                where = f"[{n:>3}/{len(ids)} {time.perf_counter() - t_start:6.0f} s] schema {i}"
                print(f"{where}: {o.verdict} ({o.finish_reason}, {o.completion_tokens} tokens, {o.seconds:.0f} s) "
                      f"{o.detail}", flush=True)  # fmt: skip

        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(one, ids))
    wall = time.perf_counter() - t_start
    outcomes.sort(key=lambda o: o.schema_id)
    counts = {v: sum(o.verdict == v for o in outcomes) for v in ("valid", "closed", "invalid", "truncated", "error")}
    tokens = [o.completion_tokens for o in outcomes]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": started_at,
        "model": MODEL, "schemas": a.ids or f"{ids[0]}..{ids[-1]}", "concurrency": a.concurrency,
        "max_tokens": a.max_tokens, "max_context": a.max_context, "frequency_penalty": a.frequency_penalty,
        "wall_s": round(wall, 1), "completion_tokens_total": sum(tokens),
        "completion_tokens_max": max(tokens, default=0), **counts,
    }  # fmt: skip
    print(json.dumps(summary))
    for o in outcomes:
        if o.verdict not in ("valid", "closed"):
            print(f"  schema {o.schema_id}: {o.verdict} {o.detail} :: {o.text[:300]!r}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"summary": summary, "outcomes": [asdict(o) for o in outcomes]}, f, indent=1)


if __name__ == "__main__":
    main()
