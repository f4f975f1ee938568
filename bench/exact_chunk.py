"""The exact policy's last prompt chunk on a CPU: its step's time and where it goes (issue 26, round 10).

The last chunk of an over-budget prompt (`ring_query_pass` exact, the default) attends every page of the prompt,
the host-only ones in staging batches (kv/paged_attention.py `_exact`, ring/exact_attention.py). This runs N
sessions of L tokens through R-token ring budgets on bench/scale_model.py's tiny shape (a real redis-server and
kvstore on this host), times the steps that hold an exact chunk and prints their cProfile table.

    .venv/bin/python bench/exact_chunk.py --sessions 2 --prompt-len 12288 --budget 4096
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ring_host import tiny_model  # noqa: E402
from bench.store import kvstore, redis_server  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=12288)
    p.add_argument("--budget", type=int, default=4096, help="ring budget a session (tokens)")
    p.add_argument("--top", type=int, default=15, help="rows of the cProfile table")
    a = p.parse_args()
    n, length = a.sessions, a.prompt_len
    with ExitStack() as stack:
        model = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmem-exact-chunk-"))
        tiny_model(Path(model), length + 64 + 1024)
        host_mib = n * (length + 256) * 8 // 1024 + 512  # tiny: 2 layers x 2 KV heads x 16 x 2 x 2 bytes a token
        url = stack.enter_context(redis_server())
        stack.enter_context(kvstore(url, host_mib))
        cfg = EngineConfig(
            model=model, device="cpu", max_context=length + 64, kv_format="bf16",
            kv_capacity=n * (a.budget + a.budget // 4) + 256, ring_budget=a.budget, prefill_chunk=8192, max_running=n,
            redis_url=url, host_kv_mib=host_mib,
        )  # fmt: skip
        engine, _ = build_engine(cfg, start=False)
        stack.callback(engine.stop)
        real_launch = engine.runner.launch
        prof = cProfile.Profile()
        times: list[float] = []

        def launch(works):  # type: ignore[no-untyped-def]
            exact = any(w.exact_query for w in works)
            t = time.perf_counter()
            if exact:
                prof.enable()
            try:
                return real_launch(works)
            finally:
                if exact:
                    prof.disable()
                    times.append(time.perf_counter() - t)

        engine.runner.launch = launch  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        gen = torch.Generator().manual_seed(0)
        for i in range(n):
            prompt = torch.randint(100, 500, (length,), generator=gen).tolist()
            engine.submit(f"exact{i}", prompt, params, namespace=f"exact-chunk-{i}")
        engine.poll()
        while engine.scheduler.has_work():
            engine.step()
        print(f"{n} x {length} tokens through {a.budget}-token rings: {len(times)} step(s) with an exact chunk, "
              f"{', '.join(f'{1e3 * t:.1f}' for t in times)} ms")  # fmt: skip
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
