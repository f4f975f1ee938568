"""The step schedule of N prompts of L tokens + T new tokens submitted at once (bench/scale.py's concurrent row),
counted on a CPU: per forward launch, the prefill tokens, the sequences they come from, and a decode launch's
burst steps. The schedule depends on the scheduler only, not on the model's speed, so a small model shows what
the production-size run launched (issue 26: 32 x 8K + 128 took 12.9 s at 00236b4 and 15.2 s at 2a15acb).

    .venv/bin/python bench/schedule_count.py --model /tmp/tiny --prompts 32 --prompt-len 8192 --new-tokens 128 \\
        --prefill-chunk 16384 --decode-burst 8

(--model: any HF directory whose positions cover L + T, e.g. bench/scale.py's tiny shape with
max_position_embeddings raised). Prints one JSON line. Run from each checkout to compare two commits.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed, Sequence  # noqa: E402
from services.engine.step.work import Work  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk", type=int, default=16384)
    p.add_argument("--decode-burst", type=int, default=8, help="as on CUDA (config.BURST_ON_CUDA)")
    a = p.parse_args()
    n, length, new = a.prompts, a.prompt_len, a.new_tokens
    cfg = EngineConfig(
        model=a.model, device="cpu", max_waiting=256, max_context=length + new, kv_capacity=n * (length + new + 64),
        prefill_chunk=a.prefill_chunk, max_running=max(64, n), decode_burst=a.decode_burst,
    )  # fmt: skip
    engine, _ = build_engine(cfg)
    launches: list[tuple[int, int, int, int]] = []  # (prefill tokens, decode rows, burst steps, prefill sequences)
    real = engine.runner.launch

    def counted(works: list[Work]):  # type: ignore[no-untyped-def]
        prefill = [w for w in works if w.seq.in_prefill or w.num_new > 1]
        launches.append(
            (sum(w.num_new for w in prefill), len(works) - len(prefill), max(w.num_steps for w in works), len(prefill))
        )
        return real(works)

    engine.runner.launch = counted  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    prompts = [torch.randint(100, 500, (length,), generator=gen).tolist() for _ in range(n)]
    first_launch: dict[int, int] = {}
    t0 = time.perf_counter()
    seqs = [engine.submit(f"r{i}", prompt, params, namespace="schedule") for i, prompt in enumerate(prompts)]

    def drain(i: int, seq: Sequence) -> None:
        while True:
            ev = seq.events.get()
            if isinstance(ev, Chunk):
                first_launch.setdefault(i, len(launches))
            if isinstance(ev, Done | Failed):
                return

    threads = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(seqs)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    engine.stop()
    prefill = [x for x in launches if x[0]]
    decode = [x for x in launches if not x[0]]
    print(json.dumps(dict(
        launches=len(launches), prefill_launches=len(prefill), decode_only_launches=len(decode),
        decode_only_steps=sum(x[2] for x in decode),
        burst_sizes=dict(sorted(collections.Counter(x[2] for x in decode).items())),
        prefill_sequences_per_launch=dict(sorted(collections.Counter(x[3] for x in prefill).items())),
        prefill_tokens_per_launch=dict(sorted(collections.Counter(x[0] for x in prefill).items())),
        last_first_token_at_launch=max(first_launch.values()), wall_s=round(wall, 2),
        overlapped_launches=engine.stats.overlapped_steps_total,
    )))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
