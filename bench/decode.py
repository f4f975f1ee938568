"""Prefill and decode tokens/s of the KVMem engine vs transformers' `generate`, same model and prompt.

    .venv/bin/python bench/decode.py                    # CPU, embedded SmolLM2 GGUF, pool = context
    PYTHONPATH=. python3 bench/decode.py --device cuda --model gemma3-270m-random \\
        --contexts 2048,8192,32768 --kv-capacity 4096   # GPU: Gemma 3 270M shapes, the ring

`gemma3-270m-random` is Gemma 3 270M's architecture (transformers' Gemma3TextConfig with the 270M
shapes: vocab 262144, hidden 640, 18 layers, 4 heads / 1 KV head of 256, MLP 2048, sliding window 512
on 5 of every 6 layers, RoPE 10K local / 1M global, 32768 positions, tied embeddings,
query_pre_attn_scalar 256) with RANDOM weights (transformers' seeded initialisation), saved once and
loaded by both sides: the numbers are speeds, not quality. Its tokenizer is a word-level stand-in
over the same vocabulary (the engine needs one to detokenize).

With --kv-capacity below --max-context the engine runs the ring (device pool of kv_capacity tokens,
the rest of the context in a host KV store): the bench starts redis-server and one kvstore process
(bench/store.py) and gives the engine their URL. Both sides run greedy, no EOS stop, the same prompt
token ids. Engine numbers go through the real engine core (scheduler, ring, paged KV pool, decode
runner, sampler, detokenizer) in-process, without gRPC; decode is measured in three modes on the same
prompt (a namespace per mode, so no prefix reuse), and the token streams are compared: `graphs` (the
decode runner's CUDA graphs, decode bursts of up to --decode-burst steps per host round trip, each
burst launched before the one before it is read: the engine's default), `serial` (the same bursts, each
read before the next is scheduled: the overlap's baseline), `steps` (the graphs one step per round trip:
the burst's baseline) and `eager` (no graphs, bursts on). transformers runs `generate` (bf16,
attn_implementation="eager", its default cache); its decode is timed per token with a streamer over
--hf-new-tokens tokens (default: as many as the engine's), after the engine's background work (page
writes to the host store, pins) has drained: it runs in this process and its decode is host-bound. Ratios
are engine / transformers. The bandwidth column is the share of the H200's HBM bandwidth (4.8 TB/s) the graph
decode reaches counting only the weight bytes one decode step reads (every parameter once:
the tied embedding is the LM head).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.model_files import resolve_model_path  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.ring.host_pages import KVStoreHostPages  # noqa: E402
from services.engine.step.sampling import SamplingParams  # noqa: E402
from services.engine.step.sequence import Chunk, Done, Failed  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
RANDOM_GEMMA = "gemma3-270m-random"


def gemma3_270m_config():  # type: ignore[no-untyped-def]
    """transformers' Gemma3TextConfig with Gemma 3 270M's shapes (the rest are the class defaults,
    which match 270M: gelu-tanh, rms eps 1e-6, RoPE 1M global / 10K local, no softcaps)."""
    from transformers import Gemma3TextConfig

    s, f = "sliding_attention", "full_attention"
    return Gemma3TextConfig(
        vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, sliding_window=512, layer_types=([s] * 5 + [f]) * 3,
        max_position_embeddings=32_768, query_pre_attn_scalar=256, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip


def write_random_gemma(directory: Path, seed: int, device: torch.device):  # type: ignore[no-untyped-def]
    """Seeded random Gemma 3 270M (bf16) saved as an HF directory with a word-level tokenizer;
    returns the transformers model (eager attention) on `device`."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoModelForCausalLM

    cfg = gemma3_270m_config()
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(str(directory))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = HFTokenizer(WordLevel(vocab, unk_token="t3"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "unk_token": "t3"})
    )
    return model


def engine_run(engine, prompt: list[int], new_tokens: int, namespace: str) -> tuple[float, float, list[int]]:  # type: ignore[no-untyped-def]  # noqa: E501
    """(prefill seconds = time to first token, decode seconds for the remaining tokens, the tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.submit(f"bench-{t0}", prompt, params, namespace=namespace)
    first = None
    tokens: list[int] = []
    while True:
        ev = seq.events.get()
        if isinstance(ev, Chunk):
            tokens.extend(ev.token_ids)
            if first is None:
                first = time.perf_counter()
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, Done):
            end = time.perf_counter()
            assert ev.completion_tokens == new_tokens and ev.cached_tokens == 0, ev
            assert first is not None
            return first - t0, end - first, tokens


def drain(engine) -> None:  # type: ignore[no-untyped-def]
    """Wait for the engine's background work (pages being written to the host store, pins on their way):
    transformers runs in this process, and its eager decode is host-bound, so a writer thread still busy
    with the last prompt's pages would slow the baseline down."""
    if engine.write_through is not None:
        engine.write_through.flush()
    if engine.ring is not None and isinstance(engine.ring.host, KVStoreHostPages):
        engine.ring.host.settle()


def hf_load(path: Path, device: torch.device, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


class _TokenTimes:
    """A generate streamer that records when each token is there (synchronising the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter())
        if len(self.times) > 1:  # the first put is the prompt
            self.tokens.extend(int(x) for x in value.reshape(-1).tolist())

    def end(self) -> None:
        pass


@torch.inference_mode()
def hf_run(model, prompt: list[int], new_tokens: int, device: torch.device) -> tuple[float, float, list[int]]:  # type: ignore[no-untyped-def]
    """(prefill seconds, decode seconds of tokens 2..new_tokens, tokens) of one `generate` call."""
    ids = torch.tensor([prompt], device=device)
    times = _TokenTimes(device)
    _sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=times)
    return times.times[1] - t0, times.times[-1] - times.times[1], times.tokens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2", help=f"a model path, embedded:smollm2 or {RANDOM_GEMMA}")
    p.add_argument("--device", default="cpu")
    p.add_argument("--contexts", default="160,1056,4128", help="context lengths: prompt + --new-tokens")
    p.add_argument("--max-context", type=int, default=0, help="0: the largest context (at least 8192)")
    p.add_argument("--kv-capacity", type=int, default=0, help="device pool tokens; 0: = max context (no ring)")
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--host-kv-mib", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-new-tokens", type=int, default=0, help="transformers' tokens per run (0: --new-tokens)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--no-hf", action="store_true", help="engine only")
    p.add_argument("--no-local-ring", action="store_true", help="page the sliding-window layers too")
    p.add_argument("--ring-prefetch-steps", type=int, default=EngineConfig.ring_prefetch_steps,
                   help="EngineConfig.ring_prefetch_steps (0: restores inside the re-selecting step)")  # fmt: skip
    p.add_argument("--decode-burst", type=int, default=8, help="EngineConfig.decode_burst of the graphs mode")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    lens = [int(x) for x in a.contexts.split(",")]
    max_context = a.max_context or max(8192, max(lens))
    kv_capacity = a.kv_capacity or max_context
    hf_tokens = a.hf_new_tokens or a.new_tokens
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmem-bench-")))
        os.environ.setdefault("KVMEM_CACHE_DIR", str(tmp / "cache"))
        hf = None
        t0 = time.perf_counter()
        if a.model == RANDOM_GEMMA:
            model_dir = tmp / "gemma3-270m-random"
            hf = write_random_gemma(model_dir, a.seed, device)
            if a.no_hf:
                hf = None
            model_ref = str(model_dir)
            print(f"random Gemma 3 270M written in {time.perf_counter() - t0:.1f} s", flush=True)
        else:
            model_ref = a.model
        store_kw: dict[str, object] = {}
        if kv_capacity < max_context:  # the ring: host pages in a kvstore
            if shutil.which("redis-server") is None:
                print(
                    "redis-server not found on PATH: the ring needs a host KV store (redis + kvstore); install "
                    "redis (scripts/setup.sh) or run with --kv-capacity >= --max-context",
                    file=sys.stderr,
                )
                return 2
            from bench.store import kvstore, redis_server

            url = stack.enter_context(redis_server())
            arena = "/dev/shm" if shutil.disk_usage("/dev/shm").free > (a.host_kv_mib + 256) << 20 else str(tmp)
            stack.enter_context(kvstore(url, a.host_kv_mib, "--arena-dir", arena))
            store_kw = dict(redis_url=url, host_kv_mib=a.host_kv_mib)
        cfg = EngineConfig(
            model=model_ref, device=a.device, max_context=max_context, kv_capacity=kv_capacity,
            prefill_chunk=a.prefill_chunk, max_running=16, local_ring=not a.no_local_ring,
            ring_prefetch_steps=a.ring_prefetch_steps, decode_burst=a.decode_burst,
            **store_kw,  # type: ignore[arg-type]
        )  # fmt: skip
        engine, info = build_engine(cfg)
        stack.callback(engine.stop)
        decode = engine.runner.decode
        cuda_modes = ["graphs", "serial", "steps", "eager"]
        modes = cuda_modes if device.type == "cuda" and decode is not None else ["eager"]
        if "graphs" in modes:
            t1 = time.perf_counter()  # batch 1, every window bucket up to the pool
            n = decode.warm_up([1], [2**k for k in range(8, 30) if 2**k <= decode.max_window])
            print(f"captured {n} decode graphs in {time.perf_counter() - t1:.1f} s", flush=True)
        if hf is None and not a.no_hf:
            hf = hf_load(resolve_model_path(a.model), device, cfg.torch_dtype)
        weight_bytes = sum(t.numel() * t.element_size() for t in engine.runner.model.parameters())
        gen = torch.Generator().manual_seed(a.seed)
        rows = []
        warm = torch.randint(100, info.vocab_size, (16,), generator=gen).tolist()
        for mode in modes:
            _set_mode(engine, mode, a.decode_burst)
            engine_run(engine, warm, 4, namespace=f"warm-{mode}")
        if hf is not None:
            hf_run(hf, warm, 4, device)
        for n in lens:
            # fresh prompts per repeat: the engine's prefix cache must not turn prefill into a lookup
            plen = n - a.new_tokens
            prompts = [torch.randint(100, info.vocab_size, (plen,), generator=gen).tolist() for _ in range(a.repeats)]
            res: dict[str, list[tuple[float, float, list[int]]]] = {}
            stats: dict[str, tuple[int, int, int]] = {}
            # one untimed request of the same length per mode first: one-time costs (Triton variants for
            # these page counts, graph buckets, registering the host arena) are not decode speed
            warm_n = torch.randint(100, info.vocab_size, (plen,), generator=gen).tolist()
            for mode in modes:
                _set_mode(engine, mode, a.decode_burst)
                engine_run(engine, warm_n, 24, namespace=f"warm-{mode}-{n}")  # past a decode re-selection
            for mode in modes:
                _set_mode(engine, mode, a.decode_burst)
                if decode is not None:
                    before = (decode.num_replays, decode.num_eager, decode.num_captures)
                steps0 = engine.stats.steps_total
                res[mode] = [engine_run(engine, pr, a.new_tokens, f"{mode}-{i}") for i, pr in enumerate(prompts)]
                if decode is not None:
                    stats[mode] = (decode.num_replays - before[0] + decode.num_eager - before[1],
                                   decode.num_captures - before[2], engine.stats.steps_total - steps0)  # fmt: skip
                engine.slots.check_integrity()
            h = None
            if hf is not None:
                drain(engine)
                try:
                    h = [hf_run(hf, pr, hf_tokens, device) for pr in prompts]
                except torch.OutOfMemoryError:
                    print(f"transformers ran out of memory at {n} tokens", flush=True)
                    torch.cuda.empty_cache()
            rows.append((n, res, stats, h))
            _print_row(n, res, stats, h, a.new_tokens, hf_tokens, weight_bytes, modes)
        ring = engine.ring
        print(
            f"\nmodel {info.model_id} ({info.architecture}{', RANDOM weights' if a.model == RANDOM_GEMMA else ''}), "
            f"device {info.device}, dtype {info.dtype}, max_context {max_context}, kv_capacity {info.kv_capacity}"
            f"{' (ring, host store)' if store_kw else ''}, new tokens {a.new_tokens} (transformers {hf_tokens}), "
            f"median of {a.repeats}, weights {weight_bytes / 1e6:.0f} MB"
            + (
                f", ring restores {ring.num_restores} (prefetched {ring.num_prefetched}, prefetch_steps "
                f"{ring.limits.prefetch_steps}) demotions {ring.num_demotions}"
                if ring is not None
                else ""
            )  # fmt: skip
            + f", device KV: slots {engine.pool.nbytes / 2**20:.1f} MiB + local rings "
            f"{engine.pool.local_nbytes / 2**20:.1f} MiB ({len(engine.pool.paged_layers)} paged layers)"
        )
        print(f"{'context':>7} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | "
              + " ".join(f"{'decode ' + m:>13}" for m in modes)
              + f" {'hf':>8} {'ratio':>7} | {'BW frac':>7} | {'runner/steps':>12} | "
              + f"{'same tokens':>11} {'=hf lead':>8}")  # fmt: skip
        for n, res, stats, h in rows:
            _table_line(n, res, stats, h, a.new_tokens, hf_tokens, weight_bytes, modes)
    return 0


def _set_mode(engine, mode: str, burst: int) -> None:  # type: ignore[no-untyped-def]
    """graphs: CUDA graphs and overlapped decode bursts; serial: the bursts read one by one; steps: graphs,
    one step per round trip; eager: no graphs (bursts, overlapped)."""
    if engine.runner.decode is not None:
        engine.runner.decode.capture = mode in ("graphs", "serial", "steps")
    engine.scheduler.decode_burst = 1 if mode == "steps" else burst
    engine.limits = dataclasses.replace(engine.limits, decode_overlap=mode != "serial")


def _medians(runs: list[tuple[float, float, list[int]]], prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s of the prompt, decode tok/s of tokens 2..new_tokens)."""
    prefill = statistics.median(r[0] for r in runs)
    decode = statistics.median(r[1] for r in runs)
    return prompt_len / prefill, (new_tokens - 1) / max(decode, 1e-9)


def _print_row(n, res, stats, h, new_tokens, hf_tokens, weight_bytes, modes) -> None:  # type: ignore[no-untyped-def]
    parts = []
    for m in modes:
        pf, dc = _medians(res[m], n - new_tokens, new_tokens)
        parts.append(f"{m}: prefill {pf:.0f} tok/s, decode {dc:.1f} tok/s, runner steps/steps {stats.get(m)}")
    if h:
        pf, dc = _medians(h, n - new_tokens, hf_tokens)
        parts.append(f"transformers: prefill {pf:.0f} tok/s, decode {dc:.1f} tok/s")
    first = modes[0]
    for m in modes[1:]:  # tokens equal to the first mode's, per prompt: up to where
        lead = [_leading_equal(res[first][i][2], res[m][i][2]) for i in range(len(res[first]))]
        parts.append(f"{m} = {first} for the first {lead} tokens")
    print(f"context {n}: " + "; ".join(parts), flush=True)


def _table_line(n, res, stats, h, new_tokens, hf_tokens, weight_bytes, modes) -> None:  # type: ignore[no-untyped-def]
    first = modes[0]
    ep, _ = _medians(res[first], n - new_tokens, new_tokens)
    decodes = [_medians(res[m], n - new_tokens, new_tokens)[1] for m in modes]
    hp, hd = _medians(h, n - new_tokens, hf_tokens) if h else (float("nan"), float("nan"))
    bw = weight_bytes * decodes[0] / HBM_BYTES_PER_S
    # True, or the modes whose tokens differ from the first mode's on some prompt
    differ = [m for m in modes if any(res[m][i][2] != res[first][i][2] for i in range(len(res[first])))]
    same = "True" if not differ else "!=" + ",".join(differ)
    lead = _leading_equal(res[first][0][2], h[0][2]) if h else 0
    runner = f"{stats[first][0]}/{stats[first][2]}" if first in stats else "-"
    print(f"{n:>7} | {ep:>13.1f} {hp:>9.1f} {ep / hp:>6.2f} | " + " ".join(f"{d:>13.1f}" for d in decodes)
          + f" {hd:>8.1f} {decodes[0] / hd:>7.2f} | {bw:>7.3f} | {runner:>12} | {same:>11} {lead:>8}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
