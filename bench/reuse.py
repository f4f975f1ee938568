"""Time to first token of turn 2 with a cached prefix vs a cold prefill of the same prompt.

    .venv/bin/python bench/reuse.py --prefixes 512,1024,2048,4096      # CPU, embedded SmolLM2
    .venv/bin/python bench/reuse.py --store --prefixes 512,1024         # + the host-store column
    python3 bench/reuse.py --device cuda --model gemma.gguf --store --kv-capacity 4096 \
        --prefixes 4096,16384,30720                                    # Gemma 3, the ring, on a GPU

For each prefix length P: turn 1 = a P-token history + a question, answered (its pages stay in the
engine's prefix cache and are written through to the kvstore); turn 2 = turn 1's prompt + its answer
+ a new question, timed (warm). The cold baseline is the same turn-2 prompt on a fresh namespace
(no page can be shared across namespaces), timed in the same run. Ratio = cold / warm.
With --store (implied by a --kv-capacity below the context: the ring), the bench starts redis and a
kvstore, and a second engine on the same store answers turn 2 too: its device has none of the pages,
so they come from the host store (`host` column: a failed-over or restarted engine's turn 2).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from contextlib import ExitStack  # noqa: E402
from dataclasses import replace  # noqa: E402

from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed  # noqa: E402


def ttft(engine, prompt: list[int], namespace: str, max_tokens: int) -> tuple[float, Done, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.submit(f"reuse-{t0}", prompt, params, namespace=namespace)
    first, out = None, []
    while True:
        ev = seq.events.get()
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, Chunk):
            first = first or time.perf_counter()
            out.extend(ev.token_ids)
        if isinstance(ev, Done):
            assert first is not None
            return first - t0, ev, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prefixes", default="512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--kv-capacity", type=int, default=0, help="device pool tokens; 0: the whole context")
    p.add_argument("--prefill-chunk", type=int, default=1024)
    p.add_argument("--store", action="store_true", help="a kvstore and a second engine: the host column")
    p.add_argument("--host-kv-mib", type=int, default=4096)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    prefixes = [int(x) for x in a.prefixes.split(",")]
    context = -(-(max(prefixes) + 256) // 64) * 64
    kv_capacity = a.kv_capacity or max(context, 8192)
    with ExitStack() as stack:
        cfg = EngineConfig(model=a.model, device=a.device, max_context=context, kv_capacity=kv_capacity,
                           prefill_chunk=a.prefill_chunk)  # fmt: skip
        if a.store or kv_capacity < context:
            from bench.store import kvstore, redis_server

            url = stack.enter_context(redis_server())
            stack.enter_context(kvstore(url, a.host_kv_mib))
            cfg = replace(cfg, redis_url=url, host_kv_mib=a.host_kv_mib)
        engine, info = build_engine(cfg)
        stack.callback(engine.stop)
        other = None
        if cfg.redis_url:
            other, _ = build_engine(replace(cfg, replica_id="reuse-other"))
            stack.callback(other.stop)
        rows = _measure(engine, other, info.vocab_size, prefixes, a.repeats)
    print(
        f"\nmodel {info.model_id}, device {info.device}, {info.dtype}, threads {torch.get_num_threads()}, "
        f"pool {info.kv_capacity} tokens{' (ring)' if info.kv_capacity < context else ''}, median of {a.repeats}"
    )
    print(f"{'prefix':>7} {'turn-2 prompt':>13} {'cached':>7} | {'TTFT warm':>10} {'TTFT host':>10} "
          f"{'TTFT cold':>10} | {'cold/warm':>9} {'cold/host':>9}")  # fmt: skip
    for n, total, frac, warm, host, cold in rows:
        host_ms = f"{host * 1000:>8.0f}ms" if host else f"{'-':>10}"
        ratio = f"{cold / host:>9.1f}" if host else f"{'-':>9}"
        print(f"{n:>7} {total:>13} {frac:>6.1%} | {warm * 1000:>8.0f}ms {host_ms} {cold * 1000:>8.0f}ms | "
              f"{cold / warm:>9.1f} {ratio}")  # fmt: skip
    return 0


def _measure(engine, other, vocab_size: int, prefixes: list[int], repeats: int) -> list[tuple]:  # type: ignore[no-untyped-def]
    """Per prefix: (P, turn-2 tokens, cached share, TTFT warm, TTFT on the other engine or 0, TTFT cold)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in prefixes:
        warm_s, host_s, cold_s, cached = [], [], [], []
        for r in range(repeats):
            history = torch.randint(100, vocab_size, (n,), generator=gen).tolist()
            question = torch.randint(100, vocab_size, (24,), generator=gen).tolist()
            _, _, answer = ttft(engine, history + question, f"warm-{n}-{r}", 16)
            turn2 = history + question + answer + torch.randint(100, vocab_size, (24,), generator=gen).tolist()
            t_warm, done, _ = ttft(engine, turn2, f"warm-{n}-{r}", 1)
            if other is not None:
                engine.write_through.flush()
                t_host, host_done, _ = ttft(other, turn2, f"warm-{n}-{r}", 1)
                assert host_done.cached_tokens > 0, "the other engine found nothing in the host store"
                host_s.append(t_host)
            t_cold, cold_done, _ = ttft(engine, turn2, f"cold-{n}-{r}", 1)
            assert cold_done.cached_tokens == 0
            warm_s.append(t_warm)
            cold_s.append(t_cold)
            cached.append(done.cached_tokens / len(turn2))
        host = statistics.median(host_s) if host_s else 0.0
        rows.append((n, len(turn2), statistics.median(cached), statistics.median(warm_s), host,
                     statistics.median(cold_s)))  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
