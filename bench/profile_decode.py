"""Where a decode step's time goes (random Gemma 3 270M, CUDA): the diagnostics behind bench/RESULTS.md's decode notes.

    PYTHONPATH=. python3 bench/profile_decode.py --mode kernels   # one 2K step: CUDA-graph replay time, and the
                                                                # eager step under torch.profiler (kernels, GPU busy);
                                                                # --context 30000: a step through the ring (4K pool);
                                                                # --knock split,head: those parts left out (below)
    PYTHONPATH=. python3 bench/profile_decode.py --mode host      # 2K: step wall time vs replay alone, cProfile
    PYTHONPATH=. python3 bench/profile_decode.py --mode ring      # 30K through the ring (4K pool, a kvstore on this
                                                                # host): decode-step phases (which calls make the slow
                                                                # steps slow), step time percentiles, cProfile
    PYTHONPATH=. python3 bench/profile_decode.py --mode gaps      # a 30K request's overlapped decode (--context: other
                                                                # lengths) under torch.profiler: device busy vs span,
                                                                # its idle gaps, the engine phases the host was in;
                                                                # --model-dir D --batch 32 --budget 4096 --kv-format
                                                                # fp8: a production shape's sessions at batch
    PYTHONPATH=. python3 bench/profile_decode.py --mode prefill   # an 8K prompt through the ring: each prefill step's
                                                                # phases, then its kernels under torch.profiler
    PYTHONPATH=. python3 bench/profile_decode.py --mode logits    # the engine's logits after a prefill vs
                                                                # transformers' eager forward (bf16)

The engine is built without its loop thread and stepped here (build_engine(start=False)). Random weights:
speeds and rounding, not quality.

`--knock` (timing only: the tokens are wrong) replaces parts of the step by a buffer of the right shape,
launching nothing: `qk` (the q/k norm + RoPE launch), `split` (the attention's launches), `block` (the
persistent layer kernel), `head` (the vocabulary head, its cast and argmax). The replay without a part, against
the replay with it in the same run, is that part's cost inside the chain of launches, which differs from
its own time under the profiler (programmatic dependent launch overlaps a kernel's start with the one
before; bench/RESULTS.md run 19).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import logging
import os
import pstats
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.decode import write_random_gemma  # noqa: E402
from bench.profile_timeline import (  # noqa: E402
    busy_and_gaps,
    launches_by_source,
    phase_marks,
    phase_stack,
    runtime_calls_while_idle,
)
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402

KNOCKABLE = ("qk", "split", "block", "head")


def knock_out(parts: set[str]) -> None:
    """Replace each named part of the decode step by a cached zero buffer of its output's shape (the module
    docstring); timing only."""
    from services.engine.kernels.attention import decode_attention_triton as attention
    from services.engine.kernels.layer import block_triton, norm_triton
    from services.engine.models import gemma3

    buffers: dict[tuple[object, ...], torch.Tensor] = {}

    def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (shape, dtype, str(device))
        if key not in buffers:
            buffers[key] = torch.zeros(shape, dtype=dtype, device=device)
        return buffers[key]

    def qk(qkv, q_w, k_w, cos, sin, eps, num_q_heads, num_kv_heads, gemma, kv_sink=None, positions=None):  # type: ignore[no-untyped-def]  # noqa: E501
        return zeros((qkv.shape[0], num_q_heads + num_kv_heads, qkv.shape[2]), qkv.dtype, qkv.device)

    def attend(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        return zeros(tuple(q.shape), q.dtype, q.device)

    def block(attn, x, w, *args, **kwargs):  # type: ignore[no-untyped-def]
        n_qkv = w.qkv.shape[0] if w.qkv is not None else 0
        qkv = zeros((1, n_qkv), x.dtype, x.device) if n_qkv else None
        return zeros(tuple(x.shape), x.dtype, x.device), zeros((1, x.shape[1]), x.dtype, x.device), qkv

    def head(self, hidden, argmax):  # type: ignore[no-untyped-def]
        rows = hidden.shape[0]
        token = zeros((rows,), torch.int64, hidden.device) if argmax else None
        return zeros((rows, self.config.vocab_size), torch.float32, hidden.device), token

    if "qk" in parts:
        norm_triton.qk_norm_rope = qk
    if "split" in parts:
        attention.decode_attention = attend
        attention.decode_attention_ring = attend
    if "block" in parts:
        block_triton.block = block
    if "head" in parts:
        gemma3.Gemma3ForCausalLM.head = head


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompt: list[int], new_tokens: int, name: str, prof: cProfile.Profile | None = None) -> list[float]:  # type: ignore[no-untyped-def]  # noqa: E501
    """Step one greedy request to the end; the wall time of each step (decode steps under `prof`)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seq = engine.submit(name, prompt, params, namespace=name)
    engine.poll()
    times = []
    while engine.scheduler.has_work():
        t = time.perf_counter()
        if prof is not None and seq.output_ids:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
        times.append(time.perf_counter() - t)
    return times


def _replay_ms(engine) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    decode = engine.runner.decode
    bufs = next(b for b in decode._buffers.values() if b.graph is not None)
    for _ in range(10):
        bufs.graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        bufs.graph.replay()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / 200, bufs


def kernels(engine, vocab: int, context: int = 2000) -> None:  # type: ignore[no-untyped-def]
    from torch.profiler import ProfilerActivity, profile

    _run(engine, _prompt(context, vocab, 0), 64, "kernels")
    replay, bufs = _replay_ms(engine)
    print(f"graph replay: {replay:.3f} ms per step (batch {bufs.batch}, window {bufs.window})")  # type: ignore[attr-defined]
    decode = engine.runner.decode
    with torch.inference_mode():
        decode._forward(bufs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                decode._forward(bufs)
            torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in events) / 5 / 1000
    print(f"kernels per step: {len(events) / 5:.0f}; GPU busy per step {busy:.3f} ms (eager step, 5 steps below)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))


def host(engine, vocab: int) -> None:  # type: ignore[no-untyped-def]
    _run(engine, _prompt(2000, vocab, 1), 32, "warm")
    times = sorted(_run(engine, _prompt(2000, vocab, 2), 300, "timed")[2:])
    replay, _ = _replay_ms(engine)
    median = times[len(times) // 2]
    print(f"decode step: median {1e3 * median:.3f} ms, mean {1e3 * sum(times) / len(times):.3f} ms; graph replay "
          f"alone {replay:.3f} ms -> host {1e3 * median - replay:.3f} ms a step")  # fmt: skip
    prof = cProfile.Profile()
    _run(engine, _prompt(2000, vocab, 3), 300, "profiled", prof)
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


class _Phases:
    """Wall time of named methods during decode steps: totals, and per step (the slow steps' causes)."""

    def __init__(self, labels: bool = False) -> None:
        self.on = False
        self.labels = labels  # also mark each call as a torch.profiler range named "phase:<name>"
        self.total: dict[str, list[float]] = {}
        self.step: dict[str, float] = {}

    def wrap(self, obj: object, attr: str, name: str) -> None:
        real = getattr(obj, attr)

        def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
            if not self.on:
                return real(*args, **kwargs)
            t = time.perf_counter()
            try:
                if self.labels:
                    with torch.profiler.record_function(f"phase:{name}"):
                        return real(*args, **kwargs)
                return real(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                self.total.setdefault(name, []).append(dt)
                self.step[name] = self.step.get(name, 0.0) + dt

        setattr(obj, attr, timed)


def _ring_phases(engine, labels: bool = False) -> _Phases:  # type: ignore[no-untyped-def]
    phases = _Phases(labels)
    ring, sched = engine.ring, engine.scheduler
    host = ring.host if ring is not None else None
    for attr in ("demote", "materialize", "_restore", "select_deferred", "apply_pending", "select"):
        if ring is not None:
            phases.wrap(ring, attr, f"ring.{attr}")
    for attr in ("pin", "unpin", "wait", "fetch_to"):
        if host is not None:
            phases.wrap(host, attr, f"host.{attr}")
    phases.wrap(sched, "schedule", "scheduler.schedule")
    phases.wrap(engine.runner, "run", "runner.run")
    phases.wrap(engine.runner.decode, "page_scores", "decode.page_scores")
    phases.wrap(engine, "_postprocess", "engine._postprocess")
    phases.wrap(engine, "_launch", "engine._launch")
    phases.wrap(engine, "_publish_pages", "engine._publish_pages")
    phases.wrap(engine, "_ring_after_step", "engine._ring_after_step")
    phases.wrap(engine.runner, "tokens", "runner.tokens")
    phases.wrap(sched, "continue_decode", "scheduler.continue_decode")
    import services.engine.engine as engine_module

    phases.wrap(engine_module, "sample_batch", "sample_batch")  # a prompt's first token: sampled on the host
    phases.wrap(engine, "_take_step", "engine._take_step")
    phases.wrap(engine, "_write_pages", "engine._write_pages")
    if labels:  # finer ranges for the gap attribution (not per-page calls such as slots.register: its ~2,100 ranges in
        # the 32 x 32K window cost ~37 us each under the profiler, 80 ms the host added to the window it measured)
        for attr in ("read_pages", "write_pages"):
            phases.wrap(engine.pool, attr, f"pool.{attr}")
        for attr in ("_fill", "_rows_of", "_summarize_filled_pages", "tokens_to_host"):
            phases.wrap(engine.runner.decode, attr, f"decode.{attr}")
        phases.wrap(engine_module, "to_host", "to_host")
        phases.wrap(sched, "_burst", "scheduler._burst")
        phases.wrap(sched, "_make_room_or_raise", "scheduler._make_room_or_raise")
    if engine.write_through is not None:
        phases.wrap(engine.write_through, "submit", "write_through.submit")
    return phases


def _decode_ms(engine, prompt: list[int], new_tokens: int, name: str) -> float:  # type: ignore[no-untyped-def]
    """Wall ms a token of one request's decode (from its first token to its last)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seq = engine.submit(name, prompt, params, namespace=name)
    engine.poll()
    while not seq.output_ids:
        engine.step()
    t = time.perf_counter()
    while engine.scheduler.has_work():
        engine.step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / (len(seq.output_ids) - 1)


def ring(engine, vocab: int) -> None:  # type: ignore[no-untyped-def]
    _run(engine, _prompt(30000, vocab, 4), 24, "warm")
    # overlapped bursts (the default) against bursts read one by one, alternating, fresh 30K prompts
    timed: dict[bool, list[float]] = {False: [], True: []}
    for i, overlap in enumerate((False, True, False, True)):
        engine.limits = dataclasses.replace(engine.limits, decode_overlap=overlap)
        timed[overlap].append(_decode_ms(engine, _prompt(30000, vocab, 20 + i), 160, f"overlap{i}"))
    print(f"30K decode, 159 tokens: overlapped bursts {' / '.join(f'{t:.3f}' for t in timed[True])} ms a token, "
          f"read one by one {' / '.join(f'{t:.3f}' for t in timed[False])} (overlapped steps "
          f"{engine.stats.overlapped_steps_total})")  # fmt: skip
    engine.limits = dataclasses.replace(engine.limits, decode_overlap=False)  # the phase table: one burst a step
    phases = _ring_phases(engine)
    per_step: list[tuple[float, dict[str, float]]] = []
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    seq = engine.submit("phases", _prompt(30000, vocab, 6), params, namespace="phases")
    engine.poll()
    while engine.scheduler.has_work():
        phases.on, phases.step = bool(seq.output_ids), {}
        t = time.perf_counter()
        engine.step()
        if phases.on:
            per_step.append((time.perf_counter() - t, phases.step))
    phases.on = False
    steps = [t for t, _ in per_step]
    print(f"phases over {len(steps)} decode steps (bursts) at 30K, {len(seq.output_ids) - 1} tokens (wall "
          f"{1e3 * sum(steps):.0f} ms, mean {1e3 * sum(steps) / len(steps):.2f} ms a step, "
          f"{1e3 * sum(steps) / (len(seq.output_ids) - 1):.3f} ms a token): name, calls, total ms, "
          "ms per call")  # fmt: skip
    for name, ts in sorted(phases.total.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:24s} {len(ts):5d} {1e3 * sum(ts):8.1f} {1e3 * sum(ts) / len(ts):7.3f}")
    for t, where in sorted(per_step, key=lambda x: -x[0])[:8]:
        top = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(where.items(), key=lambda kv: -kv[1])[:6])
        print(f"  slow step {1e3 * t:.2f} ms: {top}")
    prof = cProfile.Profile()
    times = _run(engine, _prompt(30000, vocab, 5), 160, "profiled", prof)
    dec = sorted(times[len(times) - len(per_step) :])  # the decode steps (as many as the phases run had)
    decode = engine.runner.decode
    print(f"decode step ms: median {1e3 * dec[len(dec) // 2]:.2f} p90 {1e3 * dec[int(len(dec) * 0.9)]:.2f} max "
          f"{1e3 * dec[-1]:.1f} sum {1e3 * sum(dec):.0f} over {len(dec)}; replays {decode.num_replays} eager "
          f"{decode.num_eager} captures {decode.num_captures}; ring restores {engine.ring.num_restores} "
          f"(prefetched {engine.ring.num_prefetched})")  # fmt: skip
    print("slowest 12 decode steps ms:", [round(1e3 * t, 1) for t in dec[-12:]])
    pstats.Stats(prof).sort_stats("cumulative").print_stats(35)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def gaps(  # type: ignore[no-untyped-def]
    engine, vocab: int, context: int = 30000, batch: int = 1, new_tokens: int = 200, budget: int = 0,
    whole: bool = False, stacks: bool = False,
) -> None:  # fmt: skip
    """`batch` requests' overlapped decode (past the ring budget: through the ring) under torch.profiler: how
    much of its span the device is busy, the idle gaps between its kernels and copies (what ran before and
    after each), and the engine phases (record_function ranges) the host was in during them. The profile
    starts once every request has its first token (all of them decoding together). `whole`: from the
    requests' submission to their last token, prefill included, recording the device only (the host's op
    events would slow a 40K-launch run by seconds): no phases, every request's wall time printed beside."""
    from torch.profiler import ProfilerActivity, profile

    if whole:  # one untimed round of the same shape first (graphs, Triton variants, cuDNN plans)
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for rnd in ("warm", "timed"):
            seqs = [
                engine.submit(f"{rnd}{i}", _prompt(context, vocab, 100 * (rnd == "timed") + i), params,
                              namespace=f"{rnd}{i}")
                for i in range(batch)
            ]  # fmt: skip
            prof = profile(activities=[ProfilerActivity.CUDA]) if rnd == "timed" else None
            t0 = time.perf_counter()
            if prof is not None:
                phases = _ring_phases(engine)  # wall time only: no profiler ranges on the host
                phases.on = True
                prof.start()
            engine.poll()
            while engine.scheduler.has_work():
                engine.step()
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - t0
            if prof is not None:
                prof.stop()
        print(f"{batch} x {context} + {new_tokens} from submission: wall {wall_s:.3f} s (under the profiler)")
        busy_and_gaps(prof, sum(len(s.output_ids) for s in seqs), batch, context)
        print("host phase wall times: name, calls, total ms, ms per call")
        for name, ts in sorted(phases.total.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {name:28s} {len(ts):5d} {1e3 * sum(ts):8.1f} {1e3 * sum(ts) / len(ts):7.3f}")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
        if stacks:  # one more request, the host's Python frames recorded: which engine code launches what
            seq = engine.submit("stacks", _prompt(context, vocab, 300), params, namespace="stacks")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as sprof:
                engine.poll()
                while engine.scheduler.has_work():
                    engine.step()
                torch.cuda.synchronize()
            print(f"one request of {context} + {new_tokens}, {len(seq.output_ids)} tokens, with Python frames:")
            launches_by_source(sprof)
        return
    if batch == 1:
        _run(engine, _prompt(context, vocab, 4), 24, "warm")
    else:  # the batch's decode graphs, captured before the profile (as bench/scale_engine.warm_graphs does)
        size = engine.pool.page_size
        widths = [-(-min(budget or context + new_tokens, context + new_tokens) // size) * size]
        engine.runner.decode.warm_up([1 << k for k in range(batch.bit_length() + 1) if 1 << k < 2 * batch], widths)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    seqs = [
        engine.submit(f"gaps{i}", _prompt(context, vocab, 7 + i), params, namespace=f"gaps{i}") for i in range(batch)
    ]
    engine.poll()
    prof, tokens0 = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]), -1
    phases = _ring_phases(engine, labels=True)
    decode = engine.runner.decode
    captured = {k for k, b in decode._buffers.items() if b.graph is not None}  # (batch, window) buckets warmed
    while engine.scheduler.has_work():
        if tokens0 < 0 and all(s.known_outputs >= 1 for s in seqs):  # one step() runs overlapped bursts on
            tokens0 = sum(s.known_outputs for s in seqs)
            phases.on = True
            prof.start()
        engine.step()
    torch.cuda.synchronize()
    if tokens0 < 0:
        print(f"the requests ended before their first tokens: {[s.status for s in seqs]}")
        return
    prof.stop()
    tokens = sum(len(s.output_ids) for s in seqs) - tokens0
    phases.on = False
    print(f"what ended the decode bursts (the whole run): {dict(engine.scheduler.burst_cuts)}")
    print(f"why the host scheduled rather than continued a burst: {dict(engine.scheduler.continue_declines)}; "
          f"rows that left a continued batch: {engine.scheduler.continue_leaves}")  # fmt: skip
    late = sorted(k for k, b in decode._buffers.items() if b.graph is not None and k not in captured)
    print(f"decode graphs captured after the warm-up (batch, window; their captures are in the window): {late}")
    got = busy_and_gaps(prof, tokens, batch, context)
    if got is None:
        return
    raw, idle = got
    marks = phase_marks(raw)
    waits: dict[str, list[float]] = {}  # the host's synchronising waits, by the phases it was in
    for e in raw:
        if e.device_type() == torch.autograd.DeviceType.CPU and e.name() in (
            "cudaStreamSynchronize",
            "cudaDeviceSynchronize",
            "cudaEventSynchronize",
            "cudaMemcpy",
        ):
            waits.setdefault(f"{e.name()}: {phase_stack(marks, e.start_ns() / 1e3)}", []).append(e.duration_ns() / 1e6)
    print("host synchronisations by phase stack: count, total ms, max ms")
    for key, w in sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:15]:
        print(f"  {len(w):5d} {sum(w):8.1f} {max(w):7.2f}  {key}")
    runtime_calls_while_idle(raw, idle)
    print("phase wall times over the profiled decode: name, calls, total ms, ms per call")
    for name, ts in sorted(phases.total.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:28s} {len(ts):5d} {1e3 * sum(ts):8.1f} {1e3 * sum(ts) / len(ts):7.3f}")
    print("GPU time by kernel (all):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def prefill(engine, vocab: int) -> None:  # type: ignore[no-untyped-def]
    """An 8K prompt through the ring (4K pool): each prefill step's time and phases, then the kernels of a
    second such prefill under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    _run(engine, _prompt(8192, vocab, 7), 1, "warm")
    phases = _ring_phases(engine)
    phases.wrap(engine.runner.pool, "read_page", "pool.read_page")
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seq = engine.submit("prefill", _prompt(8192, vocab, 8), params, namespace="prefill")
    engine.poll()
    steps: list[tuple[float, dict[str, float]]] = []
    while engine.scheduler.has_work():
        phases.on, phases.step = True, {}
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append((time.perf_counter() - t, phases.step))
    phases.on = False
    total = sum(t for t, _ in steps)
    print(f"8K prefill: {len(steps)} steps, {1e3 * total:.0f} ms ({8192 / total:.0f} tok/s), output {seq.output_ids}")
    for t, where in steps:
        top = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(where.items(), key=lambda kv: -kv[1])[:7])
        print(f"  step {1e3 * t:7.1f} ms: {top}")
    for name, ts in sorted(phases.total.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:24s} {len(ts):5d} {1e3 * sum(ts):8.1f} ms")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _run(engine, _prompt(8192, vocab, 9), 1, "profiled")
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20, max_name_column_width=60))


def logits(engine, vocab: int, hf) -> None:  # type: ignore[no-untyped-def]
    import services.engine.engine as engine_module

    captured: list[torch.Tensor] = []
    real = engine_module.sample_batch  # the prompt's last logits are sampled on the host

    def capture(rows, params):  # type: ignore[no-untyped-def]
        captured.append(rows.detach().float().clone())
        return real(rows, params)

    engine_module.sample_batch = capture  # type: ignore[assignment]
    for n, seed in ((2047, 0), (2047, 1), (600, 2), (100, 3)):
        prompt = _prompt(n, vocab, seed)
        captured.clear()
        _run(engine, prompt, 1, f"logits{seed}")
        ours = captured[0][0]
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt], device=ours.device)).logits[0, -1].float()
        top2 = ref.topk(2).values
        diff = (ours - ref).abs()
        print(f"n={n} seed={seed}: max|diff| {diff.max().item():.4f} mean|diff| {diff.mean().item():.4f} std "
              f"{ref.std().item():.3f} | argmax ours {int(ours.argmax())} hf {int(ref.argmax())} | hf top-2 gap "
              f"{float(top2[0] - top2[1]):.4f}")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("kernels", "host", "ring", "gaps", "prefill", "logits"), default="kernels")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="--mode kernels (2,000) and gaps (30,000): the prompt length (past 4,000: the ring)",
    )
    parts = ", ".join(KNOCKABLE)
    p.add_argument("--knock", default="", help=f"--mode kernels: parts left out ({parts}; comma-separated)")
    p.add_argument("--model-dir", default="", help="--mode gaps: an HF directory instead of a random Gemma 3 270M")
    p.add_argument("--batch", type=int, default=1, help="--mode gaps: requests decoding together")
    p.add_argument("--budget", type=int, default=4096, help="--mode gaps with --model-dir: ring budget a sequence")
    p.add_argument(
        "--headroom",
        type=int,
        default=1024,
        help="--mode gaps with --model-dir: pool tokens a sequence "
        "beyond its budget (a re-selection taking effect inside a burst holds both read sets)",
    )
    p.add_argument("--kv-format", default="auto", help="--mode gaps with --model-dir: the engine's kv_format")
    p.add_argument("--token-kib", type=int, default=128, help="--mode gaps with --model-dir: host KiB a token")
    p.add_argument("--new-tokens", type=int, default=200, help="--mode gaps: tokens each request decodes")
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens a step")
    p.add_argument("--whole", action="store_true", help="--mode gaps: from submission (prefill included), device only")
    p.add_argument(
        "--stacks", action="store_true", help="--whole: then one request with Python frames recorded, its device "
        "launches counted by the engine function that made them",
    )  # fmt: skip
    p.add_argument("--dense", action="store_true", help="--mode gaps with --model-dir: no ring, a pool for the batch")
    a = p.parse_args()
    knocked = {part for part in a.knock.split(",") if part}
    if knocked - set(KNOCKABLE) or (knocked and a.mode != "kernels"):
        p.error(f"--knock takes {parts} with --mode kernels")
    knock_out(knocked)
    if a.model_dir and a.mode != "gaps":
        p.error("--model-dir, --batch, --budget and --kv-format are --mode gaps options")
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("profile_decode.py needs a CUDA device")
        return 2
    device = torch.device("cuda")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        os.environ["KVMEM_CACHE_DIR"] = str(tmp / "cache")
        model = a.model_dir or str(tmp / "gemma")
        hf = None if a.model_dir else write_random_gemma(tmp / "gemma", 0, device)
        kw: dict[str, object] = dict(max_context=4096, kv_capacity=4096, max_running=4)
        if a.model_dir and a.dense:  # every request whole in the pool: no ring, no host store
            max_context = -(-((a.context or 30000) + a.new_tokens + 64) // 1024) * 1024
            kw = dict(max_context=max_context, kv_capacity=a.batch * max_context, max_running=max(16, a.batch),
                      kv_format=a.kv_format)  # fmt: skip
        elif a.mode in ("ring", "gaps", "prefill") or (a.context or 0) > 4000:
            from bench.store import kvstore, redis_server

            context = a.context or 30000
            host_mib = 4096
            if a.model_dir:
                host_mib = a.batch * (context + a.new_tokens + 256) * a.token_kib // 1024 + 1024
            url = stack.enter_context(redis_server())
            stack.enter_context(kvstore(url, host_mib, "--arena-dir", "/dev/shm"))
            kw = dict(max_context=32768, kv_capacity=4096, max_running=16, redis_url=url, host_kv_mib=host_mib)
            if a.model_dir:  # a ring budget per sequence inside a pool for the batch
                max_context = -(-(context + a.new_tokens + 64) // 1024) * 1024
                kw = dict(
                    max_context=max_context, kv_capacity=a.batch * (a.budget + a.headroom) + 4 * 64,
                    ring_budget=a.budget, max_running=max(16, a.batch), redis_url=url, host_kv_mib=host_mib,
                    kv_format=a.kv_format, restore_method=os.environ.get("KVMEM_RESTORE_METHOD", "copies"),
                    held_restore_method=os.environ.get("KVMEM_HELD_RESTORE_METHOD", "triton"),
                )  # fmt: skip
        cfg = EngineConfig(model=model, device="cuda", prefill_chunk=a.chunk, **kw)  # type: ignore[arg-type]
        engine, info = build_engine(cfg, start=False)
        stack.callback(engine.stop)
        if a.mode == "logits":
            logits(engine, info.vocab_size, hf)
        else:
            del hf
            if a.mode == "kernels":
                kernels(engine, info.vocab_size, a.context or 2000)
            elif a.mode == "gaps":
                # dense: no budget, so the warm-up captures the window the whole contexts reach (round 18's pdlab
                # warmed 4K windows for 4K + 96-token contexts and captured five 8K buckets inside its window)
                budget = 0 if a.dense else a.budget
                gaps(engine, info.vocab_size, a.context or 30000, a.batch, a.new_tokens, budget, a.whole, a.stacks)
            else:
                {"host": host, "ring": ring, "prefill": prefill}[a.mode](engine, info.vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
