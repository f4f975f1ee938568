"""Soak: N concurrent streams against the whole supervised stack for M minutes, RSS sampled per process.

    python -m bench.soak --minutes 10 --concurrency 64 [--engines 2 --kvstores 2] [--out bench/results/soak.json]

Every worker loops: a streamed chat request (its own session, a turn added each time, so prefixes are
reused and the session grows until it is reset), read to `[DONE]`. An error is a non-200 status, an SSE
error event, a stream without `[DONE]`, or a transport error. The RSS of every service process (and redis)
is sampled every --sample-s seconds; the table compares the first sample after warm-up with the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx
import psutil

from deploy.launcher import LaunchConfig, Stack

MODEL = "SmolLM2-135M-Instruct"  # the embedded model's id: the gateway answers 404 model_not_found to others

logger = logging.getLogger("bench.soak")
MIB = 1 << 20


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.tokens = 0
        self.latencies: list[float] = []
        self.ttfts: list[float] = []


async def one_stream(http: httpx.AsyncClient, messages: list[dict[str, str]], session: str, max_tokens: int,
                     tally: Tally) -> str | None:  # fmt: skip
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.monotonic()
    text: list[str] = []
    first = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r:
            if r.status_code != 200:
                tally.errors[f"http {r.status_code}"] += 1
                await r.aread()
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    tally.ok += 1
                    tally.latencies.append(time.monotonic() - started)
                    if first is not None:
                        tally.ttfts.append(first - started)
                    return "".join(text)
                event = json.loads(payload)
                if "error" in event:
                    tally.errors[f"error event {event['error'].get('code')}"] += 1
                    return None
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        first = first or time.monotonic()
                        text.append(delta)
                        tally.tokens += 1  # one delta per token chunk (an estimate when chunks merge)
            tally.errors["no [DONE]"] += 1
    except httpx.HTTPError as exc:
        tally.errors[type(exc).__name__] += 1
    return None


async def worker(index: int, url: str, until: float, max_tokens: int, tally: Tally) -> None:
    turns = 0
    session = f"soak-{index}-0"
    messages: list[dict[str, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        while time.monotonic() < until:
            if turns % 6 == 0:  # a fresh session every 6 turns: the context stays bounded
                session = f"soak-{index}-{turns}"
                messages = [{"role": "system", "content": f"You are soak assistant {index}. Answer briefly."}]
            messages.append({"role": "user", "content": f"Question {turns}: name a colour and a number."})
            answer = await one_stream(http, messages, session, max_tokens, tally)
            messages.append({"role": "assistant", "content": answer or ""})
            turns += 1


def sample_rss(stack: Stack) -> dict[str, float]:
    """MiB of resident memory per service process (and redis)."""
    out: dict[str, float] = {}
    names = [c.spec.name for c in stack.children] + (["redis"] if stack._redis is not None else [])
    for name in names:
        try:
            out[name] = psutil.Process(stack.pid(name)).memory_info().rss / MIB
        except (psutil.Error, KeyError, AssertionError):
            out[name] = float("nan")
    return out


def sampler(stack: Stack, every_s: float, stop: threading.Event, samples: list[tuple[float, dict[str, float]]]) -> None:
    started = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - started, sample_rss(stack)))
        stop.wait(every_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kvstores", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS 'start' is the first sample after this")
    p.add_argument("--port", type=int, default=18350)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    cfg = LaunchConfig(port=a.port, num_engines=a.engines, num_kvstores=a.kvstores, host_kv_mib=256,
                       max_context=2048, kv_capacity=4096, ready_timeout_s=600)  # fmt: skip
    stack = Stack(cfg, echo=False)
    stack.start()
    samples: list[tuple[float, dict[str, float]]] = []
    stop = threading.Event()
    thread = threading.Thread(target=sampler, args=(stack, a.sample_s, stop, samples), daemon=True)
    tally = Tally()
    try:
        thread.start()
        started = time.monotonic()
        until = started + a.minutes * 60

        async def run() -> None:
            await asyncio.gather(*(worker(i, stack.url, until, a.max_tokens, tally) for i in range(a.concurrency)))

        asyncio.run(run())
        elapsed = time.monotonic() - started
        stop.set()
        thread.join()
        samples.append((elapsed, sample_rss(stack)))
        restarts = dict(stack.restarts)
    finally:
        stop.set()
        stack.stop()

    warm = next((s for t, s in samples if t >= a.warmup_s), samples[0][1])
    first, last = samples[0][1], samples[-1][1]
    peak: dict[str, float] = defaultdict(float)
    for _, s in samples:
        for name, mib in s.items():
            peak[name] = max(peak[name], mib)
    num_errors = sum(tally.errors.values())
    lat = sorted(tally.latencies)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m bench.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
        "cpu_count": os.cpu_count(),
        "minutes": round(elapsed / 60, 2),
        "concurrency": a.concurrency,
        "streams_ok": tally.ok,
        "errors": num_errors,
        "error_kinds": dict(tally.errors),
        "restarts": restarts,
        "streams_per_s": round(tally.ok / elapsed, 2),
        "deltas_per_s": round(tally.tokens / elapsed, 1),
        "latency_p50_s": round(statistics.median(lat), 2) if lat else None,
        "latency_p99_s": round(lat[int(0.99 * (len(lat) - 1))], 2) if lat else None,
        "ttft_p50_s": round(statistics.median(tally.ttfts), 2) if tally.ttfts else None,
        "rss_mib": {
            name: {
                "first": round(first[name], 1),
                "after_warmup": round(warm[name], 1),
                "end": round(last[name], 1),
                "peak": round(peak[name], 1),
            }
            for name in last
        },  # fmt: skip
        "samples": [(round(t, 1), {k: round(v, 1) for k, v in s.items()}) for t, s in samples],
    }
    out = sys.stdout
    out.write(f"\nsoak: {report['minutes']} min, {a.concurrency} concurrent streams, {os.cpu_count()} CPUs\n")
    out.write(f"streams ok {tally.ok}, errors {num_errors} {dict(tally.errors)}, restarts {restarts}\n")
    out.write(f"{report['streams_per_s']} streams/s, latency p50 {report['latency_p50_s']} s "
              f"p99 {report['latency_p99_s']} s, ttft p50 {report['ttft_p50_s']} s\n\n")  # fmt: skip
    out.write(f"{'process':<12} {'first MiB':>10} {'warm MiB':>10} {'end MiB':>10} {'peak MiB':>10} {'end-warm':>9}\n")
    for name, r in report["rss_mib"].items():
        out.write(f"{name:<12} {r['first']:>10.1f} {r['after_warmup']:>10.1f} {r['end']:>10.1f} {r['peak']:>10.1f} "
                  f"{r['end'] - r['after_warmup']:>+9.1f}\n")  # fmt: skip
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if num_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
