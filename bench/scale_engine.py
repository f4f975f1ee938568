"""bench/scale.py's engine side: the real engine core in process (scheduler, paged pool, decode graphs, sampler;
no gRPC), one request per thread, each one's arrivals timed; the engine rows of a run (TTFT and decode at one
prompt, N prompts at once, batched decode, the long dense session, logits at 2K)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.scale_model import HBM_BYTES_PER_S
from services.engine.step.sampling import SamplingParams
from services.engine.step.sequence import Chunk, Done, Failed

if TYPE_CHECKING:
    from bench.scale import Run

ROWS = {"ttft", "decode", "concurrent", "batch", "long", "logits"}  # the rows engine_rows measures


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


def engine_requests(engine, prompts: list[list[int]], new_tokens: int, tag: str, strict: bool = True) -> list[Stream]:  # type: ignore[no-untyped-def]  # noqa: E501
    """Submit every prompt at once (greedy, no EOS stop) and collect each one's arrivals on its own thread;
    `strict`: raise when any failed or came short, else each failure is its stream's `error` (a refusal at
    submission too)."""
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
        try:
            seq = engine.submit(f"{tag}-{i}", prompt, params, namespace=tag)
        except Exception as exc:  # noqa: BLE001 -- admission refused it: strict raises below, else it is counted
            st.error, st.end = f"{type(exc).__name__}: {exc}", time.perf_counter()
            streams.append(st)
            continue
        th = threading.Thread(target=drain, args=(seq, st), daemon=True)
        th.start()
        streams.append(st)
        threads.append(th)
    for th in threads:
        th.join()
    bad = [s.error for s in streams if s.error or len(s.tokens) != new_tokens]
    if bad and strict:
        raise RuntimeError(f"{len(bad)} of {len(streams)} requests failed or came short: {bad[:3]}")
    return streams


def aggregate_decode(streams: list[Stream]) -> float:
    """Tokens per second over all streams between the last first token and the last token (decode only)."""
    start = max(s.arrivals[0][0] for s in streams)
    end = max(s.end for s in streams)
    tokens = sum(n for s in streams for t, n in s.arrivals if t > start)
    return tokens / max(end - start, 1e-9)


def decoding_together(streams: list[Stream]) -> tuple[float, float, int]:
    """(tok/s, seconds, tokens) between the last first token and the first stream's last token: the window where
    every stream decodes (no prefill left, nobody finished), so the batch is the whole set; (0, 0, 0) when that
    window is empty (a stream finished before the last one started: ask for more new tokens)."""
    start = max(s.arrivals[0][0] for s in streams)
    end = min(s.arrivals[-1][0] for s in streams)
    if end <= start:
        return 0.0, 0.0, 0
    tokens = sum(n for s in streams for t, n in s.arrivals if start < t <= end)
    return tokens / (end - start), end - start, tokens


def single_decode(st: Stream, new_tokens: int) -> float:
    return (new_tokens - 1) / max(st.end - st.arrivals[0][0], 1e-9)


def warm_graphs(run: Run, engine, max_batch: int, contexts: list[int]) -> dict[str, Any]:  # type: ignore[no-untyped-def]  # noqa: E501
    """Capture, before a row is timed, the decode graphs it will replay: every batch bucket up to `max_batch`
    (sequences finish one by one, so a row of N meets each power of two below N) at the window buckets of
    `contexts` tokens, as transformers' compiled step is warmed before its timed run. Without it the engine
    captures a bucket at its first step, inside the row (host time: an eager step, a synchronize, the capture).
    --no-warm-graphs: the old behaviour. Only between rows (DecodeGraphs.warm_up: no live sequence)."""
    decode = engine.runner.decode
    if run.a.no_warm_graphs or decode is None or not decode.capture:
        return {}
    t0 = time.perf_counter()
    size = engine.pool.page_size
    widths = [-(-c // size) * size for c in contexts]  # a read set holds whole pages
    batches = [1 << k for k in range(max(max_batch, 1).bit_length() + 1) if 1 << k < 2 * max_batch]
    n = decode.warm_up(batches, widths)
    return {"warm_captures": n, "warm_capture_s": round(time.perf_counter() - t0, 2)}


class Captures:
    """The decode graphs captured while a row ran (a capture inside a timed row is host time the row pays)."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.decode = engine.runner.decode
        self.n0, self.s0 = self._now()

    def _now(self) -> tuple[int, float]:
        return (self.decode.num_captures, self.decode.capture_s) if self.decode is not None else (0, 0.0)

    def since(self) -> dict[str, Any]:
        n, sec = self._now()
        return {"captures_in_row": n - self.n0, "capture_s_in_row": round(sec - self.s0, 2)}


def tag_len(n: int) -> str:
    return f"{round(n / 1024)}k"


def prompts_of(gen: torch.Generator, vocab: int, count: int, length: int) -> list[list[int]]:
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@contextmanager
def built(run: Run, model_dir: Path, **config: Any) -> Iterator[Any]:
    """An engine over the run's model with these EngineConfig fields, stopped and its memory freed after."""
    from services.engine.builder import build_engine
    from services.engine.config import EngineConfig

    config.setdefault("decode_burst", run.a.decode_burst)  # 0: the device's default (8 on CUDA, 1 on the CPU)
    # the first --prefill-modes value is every engine's mode (EngineConfig.prefill_attention), set before the build
    # (which warms that mode's prompt kernels: paged_attention.warm_prompt_attention); the TTFT row goes through the
    # others too (ModelRunner.prefill_attention), then back to it
    config.setdefault("prefill_attention", run.a.prefill_modes.split(",")[0])
    cfg = EngineConfig(model=str(model_dir), device=str(run.device), max_waiting=256, **config)
    t0 = time.perf_counter()
    engine, _ = build_engine(cfg)
    print(
        f"engine built in {time.perf_counter() - t0:.1f} s (pool {cfg.pool_tokens} tokens, "
        f"{engine.pool.nbytes / 2**30:.1f} GiB, kv {cfg.kv_format}, ring budget {cfg.ring_budget or 'off'})",
        flush=True,
    )
    try:
        yield engine
    finally:
        engine.stop()
        del engine
        gc.collect()
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def engine_rows(run: Run, model_dir: Path, out_dir: Path | None) -> None:
    """The dense rows (ttft, decode, concurrent, batch, long, logits) on one bf16 engine whose pool holds them all."""
    a = run.a
    cap = max(
        a.ttft_len + 256,
        run.conc * (run.conc_len + a.new_tokens + 64),
        a.long_len + 256,
        max(a.batch_list or [1]) * (a.batch_len + a.new_tokens + 64),
    )
    max_context = max(a.ttft_len, run.conc_len + a.new_tokens, a.long_len, a.batch_len + a.new_tokens)
    config = dict(
        max_context=max_context, kv_capacity=cap, prefill_chunk=a.prefill_chunk, max_running=max(64, run.conc)
    )
    with built(run, model_dir, **config) as engine:
        _engine_rows(run, engine, out_dir)
    del engine  # the name outlives the with: unbound, the engine's pool can be freed before the next one's
    _free(run)
    if "concurrent" not in a.rows.split(","):
        return
    for kv in [k for k in a.concurrent_kv.split(",") if k != "auto"]:
        # the concurrent row again over another KV page format (--concurrent-kv): an engine of its own, sized to
        # the row (the dense engine above is the model's own format, bf16 on this shape)
        conc_config = dict(
            kv_format=kv,
            max_context=run.conc_len + a.new_tokens,
            kv_capacity=run.conc * (run.conc_len + a.new_tokens + 64),
            prefill_chunk=a.prefill_chunk,
            max_running=max(64, run.conc),
        )
        with built(run, model_dir, **conc_config) as engine:
            engine_requests(engine, prompts_of(run.gen, run.shape.vocab, 1, 64), 4, "warm")
            concurrent_row(run, engine, kv)
        del engine
        _free(run)


def _free(run: Run) -> None:
    gc.collect()
    if run.device.type == "cuda":
        torch.cuda.empty_cache()


def concurrent_row(run: Run, engine, kv: str) -> None:  # type: ignore[no-untyped-def]
    """N prompts of L tokens submitted at once, once per --concurrent-chunks budget; the first --concurrent-kv
    format's best wall is the row's engine_wall_s, every format's under row[kv] (kv: an EngineConfig.kv_format)."""
    a, sh = run.a, run.shape
    row = run.row("concurrent")
    best: dict[str, Any] = {}
    for chunk in [int(c) for c in a.concurrent_chunks.split(",")]:
        _chunked(engine, chunk)
        # two untimed prompts of the row's length first, as the TTFT row warms its own: one-time costs of the
        # prompt shapes (cuDNN plans, a FlashAttention-4 compile) stay out of the row, as a serving process pays
        # them once; transformers' compiled generate is warmed before its timed run too
        engine_requests(engine, prompts_of(run.gen, sh.vocab, 2, run.conc_len), 2, f"warm-conc-{chunk}")
        prompts = prompts_of(run.gen, sh.vocab, run.conc, run.conc_len)  # fresh: no prefix reuse
        warm = warm_graphs(run, engine, run.conc, [run.conc_len + 1, run.conc_len + a.new_tokens])
        caps = Captures(engine)
        t0 = time.perf_counter()
        res = engine_requests(engine, prompts, a.new_tokens, f"conc-{kv}-{chunk}")
        wall = max(s.end for s in res) - t0
        warm |= caps.since()
        last_first = max(s.arrivals[0][0] for s in res) - t0
        row[f"engine_wall_s_chunk{chunk}" + ("" if kv == "auto" else f"_{kv}")] = round(wall, 3)
        print(
            f"engine concurrent {run.conc}x{run.conc_len} kv {kv} chunk {chunk}: wall {wall:.2f} s, "
            f"prefill {run.conc * run.conc_len / last_first:.0f} tok/s, ttft max {last_first:.2f} s; {warm}",
            flush=True,
        )
        if not best or wall < best["engine_wall_s"]:
            best = dict(
                engine_wall_s=round(wall, 3),
                prefill_tok_s=round(run.conc * run.conc_len / last_first),
                ttft_max_s=round(last_first, 3),
                ttft_mean_s=round(statistics.mean(s.ttft for s in res), 3),
                decode_agg_tok_s=round(aggregate_decode(res), 1),
                chunk=chunk,
                kv_format=kv,
                **warm,
            )
    row[kv] = best
    if kv == a.concurrent_kv.split(",")[0]:
        row.update(best)
    row["limit_prefill_s"] = round(run.conc * run.limit_prefill_s(run.conc_len), 3)
    run.save()


def _chunked(engine, chunk: int) -> None:  # type: ignore[no-untyped-def]
    engine.scheduler.prefill_chunk = chunk
    engine.limits = dataclasses.replace(engine.limits, prefill_chunk=chunk)


def _engine_rows(run: Run, engine, out_dir: Path | None) -> None:  # type: ignore[no-untyped-def]
    a, sh = run.a, run.shape
    rows = set(a.rows.split(","))
    warm = prompts_of(run.gen, sh.vocab, 1, 64)
    engine_requests(engine, warm, 4, "warm")
    chunks = [int(c) for c in a.chunks.split(",")]
    modes = a.prefill_modes.split(",")
    if "ttft" in rows or "decode" in rows:
        # one untimed prompt of the same length first: one-time costs (Triton variants, graph buckets)
        engine_requests(
            engine, prompts_of(run.gen, sh.vocab, 1, a.ttft_len - a.new_tokens), min(24, a.new_tokens), "warm-ttft"
        )
        ttft_row, dec_row = run.row("ttft"), run.row("decode")
        for mode in modes:
            engine.runner.prefill_attention = mode
            for chunk in chunks:
                _chunked(engine, chunk)
                # each (mode, chunk size) first untimed: cuDNN plans by shape, and the warm-up above ran at the
                # engine's own prefill_chunk, not necessarily this one
                engine_requests(
                    engine, prompts_of(run.gen, sh.vocab, 1, a.ttft_len - a.new_tokens), 2, f"warm-{mode}-{chunk}"
                )
                res = [
                    engine_requests(engine, [p], a.new_tokens, f"ttft-{mode}-{chunk}-{i}")[0]
                    for i, p in enumerate(run.prompts["ttft"])
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
                    run.engine_tokens = res[0].tokens
        engine.runner.prefill_attention = modes[0]
        _chunked(engine, chunks[0])
        ttft_row["limit_s"] = round(run.limit_prefill_s(a.ttft_len - a.new_tokens), 4)
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
        run.save()
    if "concurrent" in rows and "auto" in run.a.concurrent_kv.split(","):
        concurrent_row(run, engine, "auto")
        _chunked(engine, chunks[0])
    if "batch" in rows and a.batch_list:
        row = run.row("batch")
        for b in a.batch_list:
            if b == a.profile_batch and out_dir is not None:
                _profile().batch(run, engine, b, out_dir)
            warm = warm_graphs(run, engine, b, [a.batch_len + 1, a.batch_len + a.new_tokens])
            caps = Captures(engine)
            res = engine_requests(engine, prompts_of(run.gen, sh.vocab, b, a.batch_len), a.new_tokens, f"b{b}")
            agg = aggregate_decode(res)
            row[f"b{b}_captures_in_row"] = caps.since()["captures_in_row"]
            limit = HBM_BYTES_PER_S / sh.decode_bytes([a.batch_len] * b) * b
            row[f"b{b}_tok_s"] = round(agg, 1)
            row[f"b{b}_limit_tok_s"] = round(limit, 1)
            print(f"engine batch {b} at {a.batch_len}: {agg:.0f} tok/s (limit {limit:.0f})", flush=True)
        row["context"] = a.batch_len
        run.save()
    if "long" in rows and a.long_len:
        row = run.row("long")
        warm_graphs(run, engine, 1, [a.long_len - a.new_tokens + 1, a.long_len])
        caps = Captures(engine)
        res = engine_requests(engine, prompts_of(run.gen, sh.vocab, 1, a.long_len - a.new_tokens), a.new_tokens, "long")
        row["dense_captures_in_row"] = caps.since()["captures_in_row"]
        st = res[0]
        row.update(
            dense_ttft_s=round(st.ttft, 3),
            dense_decode_tok_s=round(single_decode(st, a.new_tokens), 1),
            dense_limit_ttft_s=round(run.limit_prefill_s(a.long_len - a.new_tokens), 3),
            dense_limit_decode_tok_s=round(HBM_BYTES_PER_S / sh.decode_bytes([a.long_len]), 1),
        )
        print(f"engine dense {a.long_len}: ttft {st.ttft:.2f} s, decode {row['dense_decode_tok_s']} tok/s", flush=True)
        run.save()
    if "logits" in rows:
        _engine_logits(run, engine)
    if a.profile and out_dir is not None and run.device.type == "cuda" and rows & {"ttft", "decode"}:
        # last: torch.profiler leaves CUPTI's callbacks installed after it ends (pytorch/pytorch#144455), so the
        # rows timed after it in 2a15acb's run (32 x 8K among them) may have run slower
        _profile().prefill_and_decode(run, engine, out_dir)


def _engine_logits(run: Run, engine) -> None:  # type: ignore[no-untyped-def]
    from services.engine.kv.attention import ContiguousKV

    model = engine.runner.model
    run.logit_prompts, run.engine_logits = {}, {}
    for n in (int(x) for x in str(run.a.logits_len).split(",") if x):
        prompt = run.logit_prompts[n] = prompts_of(run.gen, run.shape.vocab, 1, n)[0]
        with torch.inference_mode():
            ids = torch.tensor(prompt, device=run.device)
            hidden = model(ids, torch.arange(len(ids), device=run.device), ContiguousKV(run.shape.layers))
            run.engine_logits[n] = model.logits(hidden[-1:])[0].float().cpu()
        del hidden


def _profile():  # type: ignore[no-untyped-def]
    """bench/scale_profile.py (imported when asked: it imports this module)."""
    from bench import scale_profile

    return scale_profile
