"""The ring's decode at batch on a CPU: the engine's host time a launch, by function (issue 26's ring row).

The H200 ring row (32 sessions of 32K through 4K budgets) decodes with the device ~82% busy: a burst of a few
steps is ~16 ms of device time a step and ~30 ms of host work a launch, so short bursts leave the device idle.
The host's work per launch (scheduling, room-making, restores, post-processing, re-selection) depends on the
scheduler and the ring, not on the model's size, so a tiny model on the CPU shows it. This runs N sessions of L
tokens through budgets of B tokens (a real redis-server and kvstore on this host), then profiles the engine's
steps while every session decodes (cProfile of the engine thread), and prints host ms a launch by function,
the model's forward left out (its time is the CPU's, not the H200's), and what ended the window's bursts
(Scheduler.burst_cuts: a page end, a re-selection, the cap...).

    .venv/bin/python bench/ring_host.py --sessions 32 --prompt-len 8192 --budget 1024 --new-tokens 96

`--model`: an HF directory whose positions cover L + T (default: bench/scale_model.py's tiny shape with its
positions raised, written to a temp dir). Decode bursts as on CUDA (`--decode-burst`, config.BURST_ON_CUDA).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_model import write_random_llama  # noqa: E402
from bench.store import kvstore, redis_server  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed, Sequence  # noqa: E402

# the engine functions whose cumulative host time a launch is reported (forward excluded: see `forward_s`)
PARTS = (
    ("continue_decode", "scheduler.py", "continue_decode"),
    ("schedule", "scheduler.py", "schedule"),
    ("room-making", "scheduler.py", "_make_room_or_raise"),
    ("materialize (restores)", "ring.py", "materialize"),
    ("pool write_pages", "kv_pool.py", "write_pages"),
    ("postprocess", "engine.py", "_postprocess"),
    ("ring after step (select)", "engine.py", "_ring_after_step"),
    ("append (a token)", "engine.py", "_append"),
    ("append run (a burst's tokens)", "engine.py", "_append_run"),
    ("publish pages", "engine.py", "_publish_pages"),
    ("ring snapshot", "engine.py", "_take_ring_snapshot"),
    ("decode run (host part)", "decode_graph.py", "run"),
    ("decode rows_of", "decode_graph.py", "_rows_of"),
    ("decode fill", "decode_graph.py", "_fill"),
    ("page scores", "decode_graph.py", "page_scores"),
)


def tiny_model(directory: Path, positions: int) -> None:
    from bench import scale_model

    shape = dict(scale_model.SHAPES["tiny"])
    shape["max_position_embeddings"] = positions
    scale_model.SHAPES["tiny_long"] = shape
    write_random_llama(directory, "tiny_long", torch.device("cpu"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--budget", type=int, default=1024, help="ring budget a session (tokens)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--decode-burst", type=int, default=8)
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--kv-format", default="bf16")
    p.add_argument(
        "--headroom", type=int, default=-1, help="pool tokens a session beyond its budget (default budget / 4: "
        "room for both read sets of a re-selection taking effect inside a burst)",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=25, help="rows of the cProfile table")
    p.add_argument("--dump", default="", help="write the cProfile stats here (pstats)")
    a = p.parse_args()
    n, length, new = a.sessions, a.prompt_len, a.new_tokens
    headroom = a.budget // 4 if a.headroom < 0 else a.headroom
    with ExitStack() as stack:
        model = a.model
        if not model:
            model = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmem-ring-host-"))
            tiny_model(Path(model), length + new + 1024)
        host_mib = n * (length + new + 256) * 8 // 1024 + 512  # tiny: 2 layers x 2 KV heads x 16 x 2 x 2 bytes
        url = stack.enter_context(redis_server())
        stack.enter_context(kvstore(url, host_mib))
        cfg = EngineConfig(
            model=model, device="cpu", max_waiting=256, max_context=length + new + 64, kv_format=a.kv_format,
            kv_capacity=n * (a.budget + headroom) + 4 * 64, ring_budget=a.budget, prefill_chunk=a.prefill_chunk,
            max_running=n, decode_burst=a.decode_burst, redis_url=url, host_kv_mib=host_mib,
            ring_switch_in_burst=os.environ.get("KVMEM_RING_SWITCH_IN_BURST", "1") != "0",
        )  # fmt: skip
        engine, _ = build_engine(cfg, start=False)  # started once every session is submitted: one schedule
        stack.callback(engine.stop)
        prof = cProfile.Profile()
        window: dict[str, float] = {}
        launches, steps = [0], [0]
        forward_s = [0.0]
        real_step, real_launch = engine.step, engine.runner.launch
        model_forward = engine.runner.model.forward
        all_decoding = threading.Event()

        cuts: list[dict[str, int]] = []  # the scheduler's burst_cuts at the window's start, then at its last launch
        restores: list[tuple[int, int]] = []  # (pages restored, of them fetched ahead) at the same two points

        def step() -> None:  # on the engine thread: profiled while every session decodes
            if all_decoding.is_set() and "t0" not in window:
                window["t0"] = time.perf_counter()
                cuts.append(dict(engine.scheduler.burst_cuts))
                restores.append((engine.ring.num_restores, engine.ring.num_prefetched))
                prof.enable()
            real_step()

        def launch(works):  # type: ignore[no-untyped-def]
            if "t0" in window and "t1" not in window:
                launches[0] += 1
                steps[0] += max(w.num_steps for w in works)
                cuts[1:] = [dict(engine.scheduler.burst_cuts)]  # this launch's burst counted (one step runs many)
                restores[1:] = [(engine.ring.num_restores, engine.ring.num_prefetched)]
            return real_launch(works)

        def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return model_forward(*args, **kwargs)
            finally:
                if "t0" in window and "t1" not in window:
                    forward_s[0] += time.perf_counter() - t

        engine.step = step  # type: ignore[method-assign]
        engine.runner.launch = launch  # type: ignore[method-assign]
        engine.runner.model.forward = forward  # type: ignore[method-assign]
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        prompts = [torch.randint(100, 500, (length,), generator=gen).tolist() for _ in range(n)]
        seqs = [engine.submit(f"r{i}", q, params, namespace=f"ring-host-{i}") for i, q in enumerate(prompts)]
        first: set[int] = set()
        finished: list[int] = []
        lock = threading.Lock()
        t_submit = time.perf_counter()

        def drain(i: int, seq: Sequence) -> None:
            while True:
                ev = seq.events.get()
                if isinstance(ev, Chunk):
                    with lock:
                        first.add(i)
                        if len(first) == n:
                            all_decoding.set()
                if isinstance(ev, Done | Failed):
                    with lock:
                        finished.append(i)
                        if len(finished) == 1 and "t0" in window:  # the window ends when the first one does
                            window["t1"] = time.perf_counter()
                            prof.disable()
                    return

        threads = [threading.Thread(target=drain, args=(i, s)) for i, s in enumerate(seqs)]
        for th in threads:
            th.start()
        engine.start()
        for th in threads:
            th.join()
        prof.disable()
        if "t0" not in window or "t1" not in window or launches[0] == 0:
            print("the sessions never all decoded at once (raise --new-tokens)")
            return 1
        span = window["t1"] - window["t0"]
        stats = pstats.Stats(prof)
        per = launches[0]
        rows = {}
        for label, file, func in PARTS:
            cum = sum(v[3] for k, v in stats.stats.items() if k[0].endswith(file) and k[2] == func)  # type: ignore[attr-defined]
            rows[label] = round(1e3 * cum / per, 2)
        host = span - forward_s[0]
        print(json.dumps(dict(
            sessions=n, prompt_len=length, budget=a.budget, decode_burst=a.decode_burst, launches=per,
            window_s=round(span, 3), prefill_s=round(window["t0"] - t_submit, 1),
            host_ms_a_launch=round(1e3 * host / per, 2), forward_ms_a_launch=round(1e3 * forward_s[0] / per, 2),
            steps_a_launch=round(steps[0] / per, 2),
            ms_a_launch=rows,
            burst_cuts={k: v - cuts[0].get(k, 0) for k, v in cuts[-1].items() if v > cuts[0].get(k, 0)},
            continue_declines=dict(engine.scheduler.continue_declines),  # the whole run
            continue_leaves=engine.scheduler.continue_leaves,
            pages_restored=restores[-1][0] - restores[0][0], of_them_prefetched=restores[-1][1] - restores[0][1],
        )))  # fmt: skip
        if a.dump:
            stats.dump_stats(a.dump)
        stats.sort_stats("tottime").print_stats(a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
