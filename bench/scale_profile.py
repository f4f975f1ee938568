"""bench/scale.py --profile: kernel tables (torch.profiler) of one prefill and its decode, and of a decode batch."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.scale_engine import Stream, aggregate_decode, engine_requests, prompts_of
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import Chunk, Done, Failed

if TYPE_CHECKING:
    from bench.scale import Run

# kernel name patterns -> the phase they belong to (first match wins); the rest is "other"
PHASES = (
    ("prefill attention", r"flash_attncute"),  # FlashAttention-4's CuTe DSL kernels (their names say cutlass too)
    ("gemm (cuBLAS)", r"nvjet|gemm|cutlass|xmma|cublas"),
    ("projection (Triton, decode rows)", r"_linear_kernel"),
    ("prefill attention", r"_prefill_kernel|flash_fwd|fmha|attention|sdpa|fprop"),
    ("decode attention split", r"_split_kernel"),
    ("decode attention merge", r"_merge_kernel"),
    ("vocab head", r"_head_kernel"),
    ("rms norm", r"rms_norm"),
    ("q/k norm + rope (+ kv write)", r"qk_norm_rope|rope"),
    ("activation x up", r"silu|gelu|_mul_kernel"),
    ("kv write / gather", r"_write_kv|scatter|gather_kernel|dequant|quant"),
    ("step advance", r"_advance_kernel"),
    ("torch elementwise / copies", r"elementwise|vectorized|reduce|index|roll|cat|copy|Memcpy|Memset|fill"),
)


def phase_summary(avg: Any, wall_s: float, units: int, unit: str) -> tuple[str, dict[str, float]]:
    """Device time by phase (ms in all and per `unit`) beside the wall time, from key_averages()."""
    totals: dict[str, float] = {}
    for e in avg:
        us = e.self_device_time_total
        if us <= 0:
            continue
        name = next((ph for ph, pat in PHASES if re.search(pat, e.key)), "other")
        totals[name] = totals.get(name, 0.0) + us / 1e3
    kern = sum(totals.values())
    lines = [f"wall {wall_s * 1e3:.1f} ms, kernels {kern:.1f} ms ({units} {unit}s)"]
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(
            f"  {name:34s} {ms:9.1f} ms  {ms / max(units, 1):8.3f} ms/{unit}  {100 * ms / max(kern, 1e-9):5.1f}%"
        )
    return "\n".join(lines) + "\n", {k: round(v, 2) for k, v in totals.items()} | {"wall_ms": round(wall_s * 1e3, 1)}


def prefill_and_decode(run: Run, engine, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Kernel tables of one prompt of --ttft-len and of its decode (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = prompts_of(run.gen, run.shape.vocab, 1, run.a.ttft_len - run.a.new_tokens)
    chunk = engine.limits.prefill_chunk
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        st = engine_requests(engine, prompt, 2, "profile-prefill")[0]
    chunks = -(-len(prompt[0]) // chunk)
    summary, phases = phase_summary(prof.key_averages(), st.ttft, chunks, "chunk")
    summary = f"prefill of {len(prompt[0])} tokens in chunks of {chunk} (TTFT under the profiler)\n" + summary
    run.rows.setdefault("profile", {})["prefill"] = phases | {"chunk": chunk, "chunks": chunks}
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
    (out_dir / "profile_prefill.txt").write_text(summary + table)
    print(summary + table[:5000], flush=True)
    prompt = prompts_of(run.gen, run.shape.vocab, 1, run.a.ttft_len - run.a.new_tokens)
    streams: list[Stream] = []
    params = SamplingParams(temperature=0.0, max_tokens=run.a.new_tokens, ignore_eos=True)
    seq = engine.submit("profile-decode", prompt[0], params, namespace="profile-decode")
    first = seq.events.get()  # the first token: the prefill is over
    assert isinstance(first, Chunk), first
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while not isinstance(seq.events.get(), (Done, Failed)):
            pass
    wall = time.perf_counter() - t0
    steps = run.a.new_tokens - 1
    summary, phases = phase_summary(prof.key_averages(), wall, steps, "step")
    summary = (
        f"decode at {run.a.ttft_len} tokens, batch 1, {steps} steps (KVMEM_PDL={os.environ.get('KVMEM_PDL', '1')})\n"
        + summary
    )
    run.rows.setdefault("profile", {})["decode"] = phases | {"steps": steps}
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    (out_dir / f"profile_decode_pdl{os.environ.get('KVMEM_PDL', '1')}.txt").write_text(summary + table)
    print(summary + table[:3000], flush=True)
    del streams


def batch(run: Run, engine, batch: int, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """Kernel table of `batch` sequences of --batch-len tokens decoding together (its prefill included),
    with the wall time beside the device's kernel time (a step the host cannot keep busy shows here)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = prompts_of(run.gen, run.shape.vocab, batch, run.a.batch_len)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        res = engine_requests(engine, prompts, run.a.new_tokens, f"profile-b{batch}")
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    cuda_us = sum(e.self_device_time_total for e in avg)
    head = (
        f"batch {batch} x {run.a.batch_len} + {run.a.new_tokens}: wall {wall:.2f} s, "
        f"kernels {cuda_us / 1e6:.2f} s, "
        f"decode {aggregate_decode(res):.0f} tok/s under the profiler\n"
    )
    summary, phases = phase_summary(avg, wall, 1, "run")
    run.rows.setdefault("profile", {})[f"batch{batch}"] = phases
    head += summary
    table = head + avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    table += "\n" + avg.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    (out_dir / f"profile_batch{batch}.txt").write_text(table)
    print(head + table[-5000:], flush=True)


# transformers ------------------------------------------------------------------------------------
