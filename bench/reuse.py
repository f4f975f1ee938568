"""Time to first token of turn 2 with a cached prefix vs a cold prefill of the same prompt.

    .venv/bin/python bench/reuse.py --prefixes 512,1024,2048,4096      # CPU, embedded SmolLM2

For each prefix length P: turn 1 = a P-token history + a question, answered (its pages stay in the
engine's prefix cache and are written through to the kvstore); turn 2 = turn 1's prompt + its answer
+ a new question, timed (warm). The cold baseline is the same turn-2 prompt on a fresh namespace
(no page can be shared across namespaces), timed in the same run. Ratio = cold / warm.
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

from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from services.engine.sequence import Chunk, Done, Failed  # noqa: E402


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
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    prefixes = [int(x) for x in a.prefixes.split(",")]
    context = -(-(max(prefixes) + 256) // 64) * 64
    engine, info = build_engine(EngineConfig(model=a.model, device=a.device, max_context=context,
                                             kv_capacity=max(context, 8192), prefill_chunk=1024))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in prefixes:
        warm_s, cold_s, cached = [], [], []
        for r in range(a.repeats):
            history = torch.randint(100, info.vocab_size, (n,), generator=gen).tolist()
            question = torch.randint(100, info.vocab_size, (24,), generator=gen).tolist()
            _, _, answer = ttft(engine, history + question, f"warm-{n}-{r}", 16)
            turn2 = history + question + answer + torch.randint(100, info.vocab_size, (24,), generator=gen).tolist()
            t_warm, done, _ = ttft(engine, turn2, f"warm-{n}-{r}", 1)
            t_cold, cold_done, _ = ttft(engine, turn2, f"cold-{n}-{r}", 1)
            assert cold_done.cached_tokens == 0
            warm_s.append(t_warm)
            cold_s.append(t_cold)
            cached.append(done.cached_tokens / len(turn2))
        rows.append((n, len(turn2), statistics.median(cached), statistics.median(warm_s), statistics.median(cold_s)))
    engine.stop()
    print(
        f"\nmodel {info.model_id}, device {info.device}, {info.dtype}, threads {torch.get_num_threads()}, "
        f"median of {a.repeats}"
    )
    print(f"{'prefix':>7} {'turn-2 prompt':>13} {'cached':>7} | {'TTFT warm':>10} {'TTFT cold':>10} {'cold/warm':>10}")
    for n, total, frac, warm, cold in rows:
        print(f"{n:>7} {total:>13} {frac:>6.1%} | {warm * 1000:>8.0f}ms {cold * 1000:>8.0f}ms {cold / warm:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
