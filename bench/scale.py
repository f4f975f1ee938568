"""Production-size rows (issue 26): the engine and transformers on Llama-3.1-8B's shape, same process, same weights.

    PYTHONPATH=. python3 bench/scale.py --device cuda --rows ttft,decode,concurrent,batch,long,logits \
        --prefill-modes triton,flash --repeats 1 --chunks 8192 --concurrent-chunks 16384 --batches 8,32,64 \
        --batch-len 2048 --long-len 131072 --out bench/results/scale_h200.json     # the H200 run (RESULTS)
    .venv/bin/python bench/scale.py --shape tiny --device cpu --ttft-len 96 --concurrent 4x64 \\
        --new-tokens 8 --batches 2 --batch-len 64 --long-len 0 --out /tmp/scale.json    # the plumbing, on a CPU

The model is RANDOM weights with Llama-3.1-8B's shape (vocab 128256, hidden 4096, MLP 14336, 32 layers, 32
heads / 8 KV heads of 128, llama3 RoPE scaling factor 8 over 8192 original positions, untied head; the numbers
are speeds, not quality), written once per run with save_pretrained (bf16, initialised on the device) to
--model-dir (default /dev/shm) and loaded by both sides; its tokenizer is a word-level stand-in. Every row is
engine first (the real engine core in process: scheduler, paged pool, decode graphs, sampler; no gRPC), then
transformers (attn_implementation="sdpa", a StaticCache and generate's torch.compile of the decode step:
the strongest peer runnable on that machine), each beside its physical limit:

- prefill: FLOPs / the bf16 matmul rate measured in this run (8192^3 products): 2 x non-embedding
  parameters x tokens for the projections plus 2 x layers x heads x head_dim x T^2 for causal attention;
- decode: bytes one step must read (every weight once, the embedding table's one row excepted, plus each
  sequence's K/V) / 4.8 TB/s (the H200's HBM).

Rows (written to --out as {"date", "commit", "device", "rows": {NAME: {...}}}):
  <shape>_ttft_<L>k          engine_s, peer_s, limit_s (time to first token, one prompt of --ttft-len tokens)
  <shape>_decode_<L>k        engine_tok_s, peer_tok_s, hbm_frac (of the bytes-per-step limit), weight_frac
                             (of the weight-only limit, the issue's "weight-bandwidth limit"), limit_tok_s
  <shape>_concurrent_<N>x<L>k  engine_wall_s, peer_wall_s, prefill_tok_s (engine: prompt tokens / time to the
                             last first token), ttft_max_s, limit_prefill_s
  <shape>_decode_batch       per batch B: aggregate decode tok/s of B sequences of --batch-len tokens, limit
  <shape>_128k               dense_ttft_s, dense_decode_tok_s (engine, everything in HBM); ring_* need a kvstore
  <shape>_ring_32x32k        not run here: see `not_run`
  <shape>_logits_2k          cosine and argmax of the engine's forward against transformers' on one prompt
  attention_<n>x<T>          the prefill attention alone (--attn-bench / --only-attn) on the last n-token chunk
                             of a T-token prompt: masked memory-efficient SDPA (the engine before issue 26),
                             causal_sdpa (torch's FlashAttention-2), flex_attention with a block mask (compiled),
                             kernels/prefill_attention_triton.py over scattered pool rows in five configurations
                             (the engine's default now), and the K/V gather the non-Triton paths need, as TFLOP/s
--prefill-modes runs the TTFT row once per KVMEM_PREFILL_ATTENTION value (triton, flash, masked).
A row that could not run records why ("not_run"), never a number it did not measure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_model import HBM_BYTES_PER_S, SHAPES, Shape, matmul_tflops, peer_generate, write_random_llama  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from services.engine.sequence import Chunk, Done, Failed  # noqa: E402

logger = logging.getLogger(__name__)

# -- the engine side --------------------------------------------------------------------------------


@dataclasses.dataclass
class Stream:
    """One request's arrivals: (time, tokens) per chunk."""

    t0: float
    arrivals: list[tuple[float, int]] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    end: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.arrivals[0][0] - self.t0


def engine_requests(engine, prompts: list[list[int]], new_tokens: int, tag: str) -> list[Stream]:  # type: ignore[no-untyped-def]  # noqa: E501
    """Submit every prompt at once (greedy, no EOS stop) and collect each one's arrivals on its own thread."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    streams: list[Stream] = []
    threads = []

    def drain(seq, st: Stream) -> None:  # type: ignore[no-untyped-def]
        while True:
            ev = seq.events.get()
            now = time.perf_counter()
            if isinstance(ev, Chunk):
                st.arrivals.append((now, len(ev.token_ids)))
                st.tokens.extend(ev.token_ids)
            elif isinstance(ev, Failed):
                st.error, st.end = ev.message, now
                return
            elif isinstance(ev, Done):
                st.end = now
                return

    for i, prompt in enumerate(prompts):
        st = Stream(time.perf_counter())
        seq = engine.submit(f"{tag}-{i}", prompt, params, namespace=tag)
        th = threading.Thread(target=drain, args=(seq, st), daemon=True)
        th.start()
        streams.append(st)
        threads.append(th)
    for th in threads:
        th.join()
    bad = [s.error for s in streams if s.error or len(s.tokens) != new_tokens]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(streams)} requests failed or came short: {bad[:3]}")
    return streams


def aggregate_decode(streams: list[Stream]) -> float:
    """Tokens per second over all streams between the last first token and the last token (decode only)."""
    start = max(s.arrivals[0][0] for s in streams)
    end = max(s.end for s in streams)
    tokens = sum(n for s in streams for t, n in s.arrivals if t > start)
    return tokens / max(end - start, 1e-9)


def single_decode(st: Stream, new_tokens: int) -> float:
    return (new_tokens - 1) / max(st.end - st.arrivals[0][0], 1e-9)


# -- rows --------------------------------------------------------------------------------------------


def tag_len(n: int) -> str:
    return f"{round(n / 1024)}k"


def prompts_of(gen: torch.Generator, vocab: int, count: int, length: int) -> list[list[int]]:
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Run:
    """The rows of one process run."""

    def __init__(self, a: argparse.Namespace, device: torch.device) -> None:
        self.a, self.device = a, device
        self.shape = Shape.of(a.shape)
        self.rows: dict[str, dict[str, Any]] = {}
        self.gen = torch.Generator().manual_seed(a.seed)
        self.tflops = matmul_tflops(device)
        conc, conc_len = (int(x) for x in a.concurrent.split("x"))
        self.conc, self.conc_len = conc, conc_len
        self.names = {
            "ttft": f"{a.shape}_ttft_{tag_len(a.ttft_len)}",
            "decode": f"{a.shape}_decode_{tag_len(a.ttft_len)}",
            "concurrent": f"{a.shape}_concurrent_{conc}x{tag_len(conc_len)}",
            "batch": f"{a.shape}_decode_batch",
            "long": f"{a.shape}_128k",
            "ring": f"{a.shape}_ring_32x32k",
            "logits": f"{a.shape}_logits_2k",
        }
        self.prompts = {
            "ttft": prompts_of(self.gen, self.shape.vocab, a.repeats, a.ttft_len - a.new_tokens),
            "concurrent": prompts_of(self.gen, self.shape.vocab, conc, conc_len),
        }
        self.engine_tokens: list[int] = []
        self.save: Callable[[], None] = lambda: None  # main's: the rows so far to --out

    def row(self, key: str) -> dict[str, Any]:
        return self.rows.setdefault(self.names[key], {})

    def limit_prefill_s(self, tokens: int, past: int = 0) -> float:
        return self.shape.prefill_flops(tokens, past) / (self.tflops * 1e12) if self.tflops else float("nan")

    # engine ----------------------------------------------------------------------------------------

    def engine_rows(self, model_dir: Path, out_dir: Path | None) -> None:
        from services.engine.builder import build_engine
        from services.engine.config import EngineConfig

        a = self.a
        n_ttft = a.ttft_len
        cap = max(
            n_ttft + 256,
            self.conc * (self.conc_len + a.new_tokens + 64),
            a.long_len + 256,
            max(a.batch_list or [1]) * (a.batch_len + a.new_tokens + 64),
        )
        max_context = max(n_ttft, self.conc_len + a.new_tokens, a.long_len, a.batch_len + a.new_tokens)
        cfg = EngineConfig(
            model=str(model_dir),
            device=str(self.device),
            max_context=max_context,
            kv_capacity=cap,
            prefill_chunk=a.prefill_chunk,
            max_running=max(64, self.conc),
            max_waiting=256,
        )
        t0 = time.perf_counter()
        engine, _ = build_engine(cfg)
        print(
            f"engine built in {time.perf_counter() - t0:.1f} s (pool {cfg.pool_tokens} tokens, "
            f"{engine.pool.nbytes / 2**30:.1f} GiB)",
            flush=True,
        )
        try:
            self._engine_rows(engine, out_dir)
        finally:
            engine.stop()
            del engine
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def _chunked(self, engine, chunk: int) -> None:  # type: ignore[no-untyped-def]
        engine.scheduler.prefill_chunk = chunk
        engine.limits = dataclasses.replace(engine.limits, prefill_chunk=chunk)

    def _engine_rows(self, engine, out_dir: Path | None) -> None:  # type: ignore[no-untyped-def]
        a, sh = self.a, self.shape
        rows = set(a.rows.split(","))
        warm = prompts_of(self.gen, sh.vocab, 1, 64)
        engine_requests(engine, warm, 4, "warm")
        chunks = [int(c) for c in a.chunks.split(",")]
        modes = a.prefill_modes.split(",")
        if "ttft" in rows or "decode" in rows:
            # one untimed prompt of the same length first: one-time costs (Triton variants, graph buckets)
            engine_requests(
                engine, prompts_of(self.gen, sh.vocab, 1, a.ttft_len - a.new_tokens), min(24, a.new_tokens), "warm-ttft"
            )
            ttft_row, dec_row = self.row("ttft"), self.row("decode")
            for mode in modes:
                os.environ["KVMEM_PREFILL_ATTENTION"] = mode
                for chunk in chunks:
                    self._chunked(engine, chunk)
                    res = [
                        engine_requests(engine, [p], a.new_tokens, f"ttft-{mode}-{chunk}-{i}")[0]
                        for i, p in enumerate(self.prompts["ttft"])
                    ]
                    ttft = statistics.median(s.ttft for s in res)
                    dec = statistics.median(single_decode(s, a.new_tokens) for s in res)
                    ttft_row[f"engine_s_{mode}_chunk{chunk}"] = round(ttft, 4)
                    dec_row[f"engine_tok_s_{mode}_chunk{chunk}"] = round(dec, 2)
                    print(
                        f"engine ttft {a.ttft_len} chunk {chunk} {mode}: {ttft:.3f} s; decode {dec:.1f} tok/s",
                        flush=True,
                    )
                    if mode == modes[0] and chunk == chunks[0]:
                        ttft_row["engine_s"] = round(ttft, 4)
                        dec_row["engine_tok_s"] = round(dec, 2)
                        self.engine_tokens = res[0].tokens
            os.environ["KVMEM_PREFILL_ATTENTION"] = modes[0]
            self._chunked(engine, chunks[0])
            ttft_row["limit_s"] = round(self.limit_prefill_s(a.ttft_len - a.new_tokens), 4)
            ttft_row["prompt_tokens"] = a.ttft_len - a.new_tokens
            step = sh.decode_bytes([a.ttft_len])
            weights = sh.decode_bytes([])
            dec = dec_row.get("engine_tok_s", 0.0)
            dec_row.update(
                limit_tok_s=round(HBM_BYTES_PER_S / step, 1),
                weight_limit_tok_s=round(HBM_BYTES_PER_S / weights, 1),
                hbm_frac=round(dec * step / HBM_BYTES_PER_S, 3),
                weight_frac=round(dec * weights / HBM_BYTES_PER_S, 3),
                bytes_per_step=step,
                new_tokens=a.new_tokens,
            )
            self.save()
            if a.profile and out_dir is not None and self.device.type == "cuda":
                self._profile(engine, out_dir)
        if "concurrent" in rows:
            row = self.row("concurrent")
            for chunk in [int(c) for c in a.concurrent_chunks.split(",")]:
                self._chunked(engine, chunk)
                prompts = prompts_of(self.gen, sh.vocab, self.conc, self.conc_len)  # fresh: no prefix reuse
                t0 = time.perf_counter()
                res = engine_requests(engine, prompts, a.new_tokens, f"conc-{chunk}")
                wall = max(s.end for s in res) - t0
                last_first = max(s.arrivals[0][0] for s in res) - t0
                row[f"engine_wall_s_chunk{chunk}"] = round(wall, 3)
                print(
                    f"engine concurrent {self.conc}x{self.conc_len} chunk {chunk}: wall {wall:.2f} s, "
                    f"prefill {self.conc * self.conc_len / last_first:.0f} tok/s, ttft max {last_first:.2f} s",
                    flush=True,
                )
                if "engine_wall_s" not in row or wall < row["engine_wall_s"]:
                    row.update(
                        engine_wall_s=round(wall, 3),
                        prefill_tok_s=round(self.conc * self.conc_len / last_first),
                        ttft_max_s=round(last_first, 3),
                        ttft_mean_s=round(statistics.mean(s.ttft for s in res), 3),
                        decode_agg_tok_s=round(aggregate_decode(res), 1),
                        chunk=chunk,
                    )
            self._chunked(engine, chunks[0])
            row["limit_prefill_s"] = round(self.conc * self.limit_prefill_s(self.conc_len), 3)
            self.save()
        if "batch" in rows and a.batch_list:
            row = self.row("batch")
            for b in a.batch_list:
                if b == a.profile_batch and out_dir is not None:
                    self._profile_batch(engine, b, out_dir)
                res = engine_requests(engine, prompts_of(self.gen, sh.vocab, b, a.batch_len), a.new_tokens, f"b{b}")
                agg = aggregate_decode(res)
                limit = HBM_BYTES_PER_S / sh.decode_bytes([a.batch_len] * b) * b
                row[f"b{b}_tok_s"] = round(agg, 1)
                row[f"b{b}_limit_tok_s"] = round(limit, 1)
                print(f"engine batch {b} at {a.batch_len}: {agg:.0f} tok/s (limit {limit:.0f})", flush=True)
            row["context"] = a.batch_len
            self.save()
        if "long" in rows and a.long_len:
            row = self.row("long")
            res = engine_requests(
                engine, prompts_of(self.gen, sh.vocab, 1, a.long_len - a.new_tokens), a.new_tokens, "long"
            )
            st = res[0]
            row.update(
                dense_ttft_s=round(st.ttft, 3),
                dense_decode_tok_s=round(single_decode(st, a.new_tokens), 1),
                dense_limit_ttft_s=round(self.limit_prefill_s(a.long_len - a.new_tokens), 3),
                dense_limit_decode_tok_s=round(HBM_BYTES_PER_S / sh.decode_bytes([a.long_len]), 1),
                ring_not_run="the ring needs redis + a kvstore on the device machine (wheels not carried this run)",
            )
            print(
                f"engine dense {a.long_len}: ttft {st.ttft:.2f} s, decode {row['dense_decode_tok_s']} tok/s", flush=True
            )
            self.save()
        if "logits" in rows:
            self._engine_logits(engine)

    def _engine_logits(self, engine) -> None:  # type: ignore[no-untyped-def]
        from services.engine.attention import ContiguousKV

        model = engine.runner.model
        self.logit_prompt = prompts_of(self.gen, self.shape.vocab, 1, self.a.logits_len)[0]
        with torch.inference_mode():
            ids = torch.tensor(self.logit_prompt, device=self.device)
            hidden = model(ids, torch.arange(len(ids), device=self.device), ContiguousKV(self.shape.layers))
            self.engine_logits = model.logits(hidden[-1:])[0].float().cpu()

    def _profile(self, engine, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
        """Kernel tables of one prompt of --ttft-len and of its decode (torch.profiler)."""
        from torch.profiler import ProfilerActivity, profile

        prompt = prompts_of(self.gen, self.shape.vocab, 1, self.a.ttft_len - self.a.new_tokens)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine_requests(engine, prompt, 2, "profile-prefill")
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
        (out_dir / "profile_prefill.txt").write_text(table)
        print(table[:6000], flush=True)
        prompt = prompts_of(self.gen, self.shape.vocab, 1, self.a.ttft_len - self.a.new_tokens)
        streams: list[Stream] = []
        params = SamplingParams(temperature=0.0, max_tokens=self.a.new_tokens, ignore_eos=True)
        seq = engine.submit("profile-decode", prompt[0], params, namespace="profile-decode")
        first = seq.events.get()  # the first token: the prefill is over
        assert isinstance(first, Chunk), first
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while not isinstance(seq.events.get(), (Done, Failed)):
                pass
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        (out_dir / "profile_decode.txt").write_text(table)
        print(table[:4000], flush=True)
        del streams

    def _profile_batch(self, engine, batch: int, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
        """Kernel table of `batch` sequences of --batch-len tokens decoding together (its prefill included),
        with the wall time beside the device's kernel time (a step the host cannot keep busy shows here)."""
        from torch.profiler import ProfilerActivity, profile

        prompts = prompts_of(self.gen, self.shape.vocab, batch, self.a.batch_len)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            res = engine_requests(engine, prompts, self.a.new_tokens, f"profile-b{batch}")
        wall = time.perf_counter() - t0
        avg = prof.key_averages()
        cuda_us = sum(e.self_device_time_total for e in avg)
        head = (
            f"batch {batch} x {self.a.batch_len} + {self.a.new_tokens}: wall {wall:.2f} s, "
            f"kernels {cuda_us / 1e6:.2f} s, "
            f"decode {aggregate_decode(res):.0f} tok/s under the profiler\n"
        )
        table = head + avg.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        table += "\n" + avg.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        (out_dir / f"profile_batch{batch}.txt").write_text(table)
        print(head + table[-5000:], flush=True)

    # transformers ------------------------------------------------------------------------------------

    def peer_rows(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        a = self.a
        rows = set(a.rows.split(","))
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
        model = model.to(self.device).eval()
        print(f"transformers loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        try:
            if "logits" in rows and hasattr(self, "engine_logits"):
                with torch.inference_mode():
                    ref = model(torch.tensor([self.logit_prompt], device=self.device)).logits[0, -1].float().cpu()
                cos = torch.nn.functional.cosine_similarity(ref, self.engine_logits, dim=0).item()
                self.rows[self.names["logits"]] = dict(
                    cosine=round(cos, 5),
                    same_argmax=bool(ref.argmax() == self.engine_logits.argmax()),
                    max_abs_diff=round((ref - self.engine_logits).abs().max().item(), 4),
                    prompt_tokens=a.logits_len,
                )
                print(f"logits at {a.logits_len}: {self.rows[self.names['logits']]}", flush=True)
            if "ttft" in rows or "decode" in rows:
                r = peer_generate(model, self.prompts["ttft"][:1], a.new_tokens, self.device)
                self.row("ttft")["peer_s"] = round(r["ttft_s"], 4)
                self.row("decode").update(
                    peer_tok_s=round(r["decode_tok_s"], 2),
                    peer_max_step_s=round(r["max_step_s"], 4),
                    peer_median_step_s=round(r["median_step_s"], 4),
                    same_tokens_as_engine=leading_equal(r["tokens"], self.engine_tokens),
                )
                print(f"transformers ttft {r['ttft_s']:.3f} s, decode {r['decode_tok_s']:.1f} tok/s", flush=True)
                self.save()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if "concurrent" in rows:
                r = peer_generate(model, self.prompts["concurrent"], a.new_tokens, self.device)
                self.row("concurrent").update(
                    peer_wall_s=round(r["wall_s"], 3),
                    peer_decode_agg_tok_s=round(r["decode_tok_s"], 1),
                    peer_ttft_s=round(r["ttft_s"], 3),
                    peer_max_step_s=round(r["max_step_s"], 4),
                )
                print(f"transformers concurrent {self.conc}x{self.conc_len}: wall {r['wall_s']:.2f} s", flush=True)
        except torch.OutOfMemoryError as exc:
            print(f"transformers ran out of memory: {exc}", flush=True)
        finally:
            del model
            gc.collect()

    def attention_bench(self) -> None:
        """The prefill attention alone on the last chunk of a --ttft-len prompt (every key visible but the
        chunk's own causal triangle): the engine's masked path, causal_sdpa, flex_attention, the Triton kernel."""
        total = self.a.ttft_len
        for n in (2048, 8192):
            if n <= total:
                res = self._attention_case(n, total)
                self.rows[f"attention_{n}x{tag_len(total)}"] = res
                print(f"attention {n} x {total}: {res}", flush=True)

    def _attention_case(self, n: int, total: int) -> dict[str, Any]:
        import triton.testing as tt

        from services.engine.attention import causal_sdpa, grouped_sdpa, position_mask
        from services.engine.kernels import prefill_attention_triton as pat

        sh, dev = self.shape, self.device
        q = torch.randn(n, sh.heads, sh.head_dim, device=dev, dtype=torch.bfloat16)
        k = torch.randn(sh.kv_heads, total, sh.head_dim, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scale = sh.head_dim**-0.5
        group = sh.heads // sh.kv_heads
        allowed = position_mask(torch.arange(total - n, total, device=dev), torch.arange(total, device=dev))
        mask = torch.zeros(allowed.shape, dtype=q.dtype, device=dev).masked_fill_(~allowed, float("-inf"))
        mask = mask.repeat(group, 1)
        flops = 4 * sh.heads * sh.head_dim * (n * (total - n) + n * n / 2)
        res: dict[str, Any] = {}
        ref = grouped_sdpa(q, k, v, mask, scale)
        fns = {
            "masked_sdpa": lambda: grouped_sdpa(q, k, v, mask, scale),
            "causal_sdpa": lambda: causal_sdpa(q, k, v, scale),
        }
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            off = total - n
            bm = create_block_mask(lambda b, h, qi, ki: ki <= qi + off, None, None, n, total, device=dev)
            flex = torch.compile(flex_attention)
            qh = q.transpose(0, 1)[None].contiguous()
            fns["flex_attention"] = lambda: flex(qh, k[None], v[None], block_mask=bm, scale=scale, enable_gqa=True)[
                0
            ].transpose(0, 1)
        except Exception as exc:  # noqa: BLE001 -- a bench row records why a variant did not run
            res["flex_not_run"] = repr(exc)[:200]

        pool_rows = torch.randperm(total + 4096, device=dev)[:total]  # scattered rows, as pages are
        k_pool = torch.empty(total + 4096, sh.kv_heads, sh.head_dim, device=dev, dtype=k.dtype)
        v_pool = torch.empty_like(k_pool)
        k_pool[pool_rows], v_pool[pool_rows] = k.transpose(0, 1), v.transpose(0, 1)
        for cfg in ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)):
            fns[f"triton_paged_{'_'.join(map(str, cfg))}"] = lambda cfg=cfg: pat.prefill_attention(
                q, k_pool, v_pool, pool_rows, scale, cfg=cfg
            )
        fns["gather_kv"] = lambda: (k_pool.index_select(0, pool_rows), v_pool.index_select(0, pool_rows))
        for name, fn in fns.items():
            try:
                out = fn()
                err = (
                    -1.0 if isinstance(out, tuple) else ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                )
                ms = tt.do_bench(fn, warmup=50, rep=300, return_mode="median")
                res[name] = dict(ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1), rel_err=round(err, 5))
            except Exception as exc:  # noqa: BLE001
                res[name] = dict(not_run=repr(exc)[:200])
        res["matmul_tflops"] = round(self.tflops, 1)
        return res


def _commit() -> str:
    """KVMEM_COMMIT when set (a copy carried to another machine sits inside some other checkout, whose HEAD is
    not this code's), else this checkout's HEAD."""
    if os.environ.get("KVMEM_COMMIT"):
        return os.environ["KVMEM_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--model-dir", default="", help="where the random model goes (default /dev/shm/kvmem-scale-<shape>)")
    p.add_argument("--reuse-model", action="store_true", help="keep a model already in --model-dir")
    p.add_argument("--rows", default="ttft,decode,concurrent,batch,long,logits", help="engine/peer rows to run")
    p.add_argument("--no-peer", action="store_true", help="engine only")
    p.add_argument("--attn-bench", action="store_true", help="the prefill attention variants alone")
    p.add_argument("--only-attn", action="store_true", help="the attention variants and nothing else (no model)")
    p.add_argument(
        "--prefill-modes",
        default="triton",
        help="KVMEM_PREFILL_ATTENTION values for the TTFT row; the first is the row's",
    )
    p.add_argument("--profile", action="store_true", help="kernel tables of one prefill and its decode (--out-dir)")
    p.add_argument("--profile-batch", type=int, default=0, help="kernel table of this decode batch (--out-dir)")
    p.add_argument("--ttft-len", type=int, default=32_768, help="prompt + new tokens of the TTFT/decode rows")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--chunks",
        default="8192",
        help="prefill chunks (token budget per step) for the TTFT row; the first is the row's",
    )
    p.add_argument("--prefill-chunk", type=int, default=8192)
    p.add_argument("--concurrent", default="32x8192", help="NxL: N prompts of L tokens submitted at once")
    p.add_argument("--concurrent-chunks", default="16384", help="token budgets per step for the concurrent row")
    p.add_argument("--batches", default="8,32,64", help="decode batch sizes ('' to skip)")
    p.add_argument("--batch-len", type=int, default=2048, help="prompt tokens of each batched-decode sequence")
    p.add_argument("--long-len", type=int, default=131_072, help="the long dense session (0: skip)")
    p.add_argument("--logits-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="JSON file for the rows")
    p.add_argument("--out-dir", default=os.environ.get("OUT", ""), help="profiles go here")
    a = p.parse_args()
    a.batch_list = [int(x) for x in a.batches.split(",") if x]
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(a.device)
    out_dir = Path(a.out_dir) if a.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    if a.only_attn:  # no model: the prefill attention variants alone
        run = Run(a, device)
        run.attention_bench()
        print(json.dumps(run.rows, indent=1))
        return 0
    with ExitStack() as stack:
        model_dir = Path(a.model_dir or f"/dev/shm/kvmem-scale-{a.shape}")
        if not (a.reuse_model and (model_dir / "config.json").exists()):
            model_dir.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            write_random_llama(model_dir, a.shape, device, a.seed)
            print(f"random {a.shape} written to {model_dir} in {time.perf_counter() - t0:.1f} s", flush=True)
            if not a.reuse_model:
                import shutil

                stack.callback(shutil.rmtree, model_dir, True)
        os.environ.setdefault("KVMEM_CACHE_DIR", str(model_dir / "cache"))
        run = Run(a, device)
        print(
            f"bf16 matmul: {run.tflops:.0f} TFLOP/s; {a.shape}: {run.shape.params / 1e9:.2f} B parameters", flush=True
        )
        run.rows[run.names["ring"]] = {
            "not_run": "32 x 32K fp8 sessions through the ring need redis + a kvstore "
            "on the device machine, not carried in this run"
        }
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

        def save(final: bool = False) -> None:
            """The rows so far (after every stage: a run cut short keeps what it measured)."""
            doc = {
                "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
                "commit": _commit(),
                "device": name,
                "command": " ".join(sys.argv),
                "matmul_tflops": round(run.tflops, 1),
                "complete": final,
                "rows": run.rows,
            }
            text = json.dumps(doc, indent=1)
            if final:
                print(text)
            if a.out:
                Path(a.out).write_text(text + "\n")
            if out_dir is not None:
                (out_dir / "scale.json").write_text(text + "\n")

        run.save = save
        if a.attn_bench and device.type == "cuda":
            run.attention_bench()
        run.engine_rows(model_dir, out_dir)
        save()
        if not a.no_peer:
            run.peer_rows(model_dir)
        save(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
