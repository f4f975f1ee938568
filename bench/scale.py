"""Production-size rows (issue 26): the engine and transformers on Llama-3.1-8B's shape, same process, same weights.

    PYTHONPATH=. python3 bench/scale.py --device cuda --rows ttft,decode,concurrent,long,logits --repeats 1 \
        --chunks 8192,16384,32768 --profile --batches "" --model-dir /tmp/m8b --reuse-model   # the H200 run
    PYTHONPATH=. python3 bench/scale.py --device cuda --rows ring --no-peer --model-dir /tmp/m8b --reuse-model \
        --ring-sessions 32 --long-len 131072     # the ring rows (redis-server on PATH, bench/scale_ring.py)
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
                             (of the weight-only limit, the issue's "weight-bandwidth limit"), limit_tok_s;
                             with --rows ring also ring_decode_tok_s, ring_ttft_s, ring_limit_decode_tok_s (one
                             session through the ring, fp8, --ring-budget resident: bench/scale_ring.py)
  <shape>_concurrent_<N>x<L>k  engine_wall_s, peer_wall_s, prefill_tok_s (engine: prompt tokens / time to the
                             last first token), ttft_max_s, limit_prefill_s; --concurrent-kv fp8,...: the row
                             again on an engine of each KV format, under row[format]
  <shape>_decode_batch       per batch B: aggregate decode tok/s of B sequences of --batch-len tokens, limit
  <shape>_128k               dense_ttft_s, dense_decode_tok_s (engine, bf16, everything in HBM); with --rows ring
                             also ring_* and dense_fp8_* (bench/scale_ring.py)
  <shape>_ring_32x32k        --rows ring: --ring-sessions fp8 sessions through the ring and dense (scale_ring.py):
                             completed, mean_ttft_s, agg_decode_tok_s (every session decoding), tail_decode_tok_s,
                             the same with dense_; fp8_attention_in_place (KVMEM_FP8_ATTENTION)
  <shape>_logits_<L>k        cosine and argmax of the engine's forward against transformers' on one prompt of each
                             --logits-len (the engine's model over its contiguous reference attention)
  attention_<n>x<T>          the prefill attention alone (--attn-bench / --only-attn) on the last n-token chunk
                             of a T-token prompt: masked memory-efficient SDPA (the engine before issue 26),
                             causal_sdpa (torch's FlashAttention-2), flex_attention with a block mask (compiled),
                             kernels/attention/prefill_attention_triton.py over scattered pool rows in five
                             configurations (the engine's default now), and the K/V gather the non-Triton paths
                             need, as TFLOP/s
Before each timed row the decode graphs it will replay are captured (scale_engine.warm_graphs: every batch bucket
up to the row's batch at its window bucket, as the peer's compiled step is warmed first); the rows record
captures_in_row (0 when the warm-up covered the row) and --no-warm-graphs restores capture at first use.
--prefill-modes runs the TTFT row once per prefill attention mode (EngineConfig.prefill_attention: cudnn, fa4,
triton, flash, masked).
--profile adds kernel tables by phase (bench/scale_profile.py). The pieces: scale_engine.py (the engine side),
scale_peer.py (transformers), scale_ring.py, scale_attention.py, scale_profile.py, scale_model.py (shapes, the
random model, the limits). A row that could not run records why ("not_run"), never a number it did not measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scale_attention, scale_engine, scale_peer, scale_ring  # noqa: E402
from bench.scale_engine import prompts_of, tag_len  # noqa: E402
from bench.scale_model import SHAPES, Shape, matmul_tflops, write_random_llama  # noqa: E402

logger = logging.getLogger(__name__)


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
            "logits": f"{a.shape}_logits",  # + _<L>k per --logits-len
        }
        self.prompts = {
            "ttft": prompts_of(self.gen, self.shape.vocab, a.repeats, a.ttft_len - a.new_tokens),
            "concurrent": prompts_of(self.gen, self.shape.vocab, conc, conc_len),
        }
        self.engine_tokens: list[int] = []
        self.t_start = time.perf_counter()
        self.save: Callable[[], None] = lambda: None  # main's: the rows so far to --out

    def row(self, key: str) -> dict[str, Any]:
        return self.rows.setdefault(self.names[key], {})

    def past_deadline(self, what: str, row: dict[str, Any], key: str) -> bool:
        """Whether --deadline-s has passed (then `row[key]` says so and `what` is not run: a device call's time
        left for the rows that matter more)."""
        if not self.a.deadline_s or time.perf_counter() - self.t_start < self.a.deadline_s:
            return False
        row[key] = f"not run: --deadline-s {self.a.deadline_s} passed before {what}"
        print(row[key], flush=True)
        return True

    def limit_prefill_s(self, tokens: int, past: int = 0) -> float:
        return self.shape.prefill_flops(tokens, past) / (self.tflops * 1e12) if self.tflops else float("nan")


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
    p.add_argument(
        "--rows", default="ttft,decode,concurrent,batch,long,logits", help="rows to run (ring: bench/scale_ring.py)"
    )
    p.add_argument("--no-peer", action="store_true", help="engine only")
    p.add_argument(
        "--ring-decode-row",
        default="on",
        choices=["on", "off"],
        help="--rows ring: one --ttft-len session alone through the ring (the decode row's ring_* keys)",
    )
    p.add_argument(
        "--ring-no-dense", action="store_true", help="the ring rows without their dense runs (an 80 GB card: no room)"
    )
    p.add_argument("--attn-bench", action="store_true", help="the prefill attention variants alone")
    p.add_argument("--attn-flex", action="store_true", help="flex_attention among the variants (compiled)")
    p.add_argument("--only-attn", action="store_true", help="the attention variants and nothing else (no model)")
    p.add_argument(
        "--prefill-modes",
        default="cudnn,triton",
        help="prefill attention modes for the TTFT row; the first is every engine's (EngineConfig.prefill_attention)",
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
    p.add_argument(
        "--concurrent-kv",
        default="auto",
        help="KV page formats of the concurrent row (EngineConfig.kv_format; auto: the dense rows' engine, bf16 on "
        "these shapes; others build an engine each); the first is the row's engine_wall_s, each under row[format]",
    )
    p.add_argument("--batches", default="8,32,64", help="decode batch sizes ('' to skip)")
    p.add_argument("--batch-len", type=int, default=2048, help="prompt tokens of each batched-decode sequence")
    p.add_argument("--long-len", type=int, default=131_072, help="the long dense session (0: skip)")
    p.add_argument("--logits-len", default="2048", help="prompt lengths of the logits rows, comma-separated")
    p.add_argument("--ring-sessions", type=int, default=32, help="sessions of the ring row (ring and dense)")
    p.add_argument("--ring-len", type=int, default=32_768, help="prompt + new tokens of each ring-row session")
    p.add_argument("--ring-budget", type=int, default=4096, help="resident tokens per sequence through the ring")
    p.add_argument(
        "--ring-headroom", type=int, default=1024, help="pool tokens a ring session beyond its budget: room for both "
        "read sets while a re-selection takes effect inside a decode burst (scheduler.py)",
    )  # fmt: skip
    p.add_argument(
        "--ring-new-tokens", type=int, default=256, help="new tokens of each ring-row session (outlast the prefill)"
    )
    p.add_argument(
        "--deadline-s", type=float, default=0.0, help="--rows ring: a long session not started by then is skipped"
    )
    p.add_argument("--ring-arena-dir", default=scale_ring.arena_dir_default(), help="the kvstore's arena")
    p.add_argument(
        "--no-warm-graphs", action="store_true", help="no decode-graph capture before each row (warm_graphs)"
    )
    p.add_argument(
        "--decode-burst",
        type=int,
        default=0,
        help="greedy decode steps a launch (0: the engine's default for the "
        "device, 8 on CUDA and 1 on the CPU; set 8 to see the CUDA schedule's bursts in a CPU run)",
    )
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
        scale_attention.attention_bench(run)
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
        rows = set(a.rows.split(","))
        if a.attn_bench and device.type == "cuda":
            scale_attention.attention_bench(run)
        if rows & scale_engine.ROWS:
            scale_engine.engine_rows(run, model_dir, out_dir)
            save()
        if "ring" in rows:
            scale_ring.ring_rows(run, model_dir)
            save()
        if not a.no_peer and rows & scale_peer.ROWS:
            scale_peer.peer_rows(run, model_dir)
        save(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
