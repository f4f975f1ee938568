"""The configuration sweeps behind two kernel choices (CUDA; printed, raw in bench/results/kernel_sweep_h200.txt).

    PYTHONPATH=. python3 bench/kernel_sweep.py [--only linear|attention]

- kernels/layer/linear_triton.py `config`: every (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K) at Gemma 3 270M's
  four projections, batch 1 and 8, against F.linear (cuBLAS); the four best and the heuristic's time per shape.
- kernels/attention/decode_attention_triton.py `block_rows` / split size: rows per loop step and per split, at
  windows of 512 (a sliding layer's ring), 2K and 4K rows, batch 1, Gemma's 4 query heads over 1 KV head of 256.

Times are microseconds per call, from CUDA-graph replays of 18 calls on 18 distinct weights / pools (as one
decode step's layers; nothing stays in L2).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import graph_timing  # noqa: E402
from services.engine.kernels.attention import decode_attention_triton as dat  # noqa: E402
from services.engine.kernels.layer import linear_triton as lt  # noqa: E402

LAYERS = 18
SHAPES = ((1536, 640), (640, 1024), (4096, 640), (640, 2048))  # qkv, o, gate/up, down


def per_call_us(fn: Callable[[], object], reps: int = 50) -> float:
    """Mean time of one of the LAYERS calls `fn` makes, replayed as a CUDA graph (bench/graph_timing.py)."""
    return graph_timing.per_call_us(fn, LAYERS, reps)


def linear_sweep(dev: torch.device) -> None:
    configs = list(itertools.product([16, 32], [64, 128, 256], [4], [4, 6], [1, 2, 4, 8]))  # 4 warps won every shape
    for m in (1, 8):
        for n, k in SHAPES:
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(LAYERS)]
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = per_call_us(lambda x=x, ws=ws: [F.linear(x, w) for w in ws])
            timed = []
            for cfg in configs:
                try:
                    timed.append((per_call_us(lambda x=x, ws=ws, cfg=cfg: [lt.linear(x, w, cfg=cfg) for w in ws]), cfg))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"  {cfg}: {type(exc).__name__}")
            timed.sort()
            heuristic = per_call_us(lambda x=x, ws=ws: [lt.linear(x, w) for w in ws])
            best = ", ".join(f"{c} {t:.2f}" for t, c in timed[:4])
            chosen = f"heuristic {lt.config(n, k)} {heuristic:.2f} us"
            print(f"M={m} N={n} K={k}: cublas {base:.2f} us | {chosen} | best {best}")


def attention_sweep(dev: torch.device) -> None:
    real_block_rows = dat.block_rows
    rows_total = 8192
    ks = [torch.randn(rows_total, 1, 256, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    vs = [torch.randn(rows_total, 1, 256, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    q = torch.randn(1, 4, 256, device=dev, dtype=torch.bfloat16)
    try:
        for width, window in ((512, 512), (2048, None), (4096, None)):
            rows = torch.randperm(rows_total, device=dev)[:width][None].contiguous()
            key_pos = torch.arange(width, device=dev)[None].contiguous()
            q_pos = torch.tensor([width - 1], device=dev)
            cells = []
            for step in (32, 64):
                dat.block_rows = lambda w, step=step: step  # type: ignore[assignment]
                t = per_call_us(
                    lambda rows=rows, key_pos=key_pos, q_pos=q_pos, window=window: [
                        dat.decode_attention(q, ks[i], vs[i], rows, key_pos, q_pos, 0.0625, window)
                        for i in range(LAYERS)
                    ]
                )
                cells.append(f"{step}-row steps, {dat.split_rows(1, 1, width)}-row splits: {t:.2f} us")
            print(f"attention W={width}: " + " | ".join(cells) + f" | block_rows picks {real_block_rows(width)}")
    finally:
        dat.block_rows = real_block_rows


def main() -> int:
    if not torch.cuda.is_available():
        print("kernel_sweep.py needs a CUDA device")
        return 2
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None  # linear or attention
    dev = torch.device("cuda")
    if only in (None, "linear"):
        linear_sweep(dev)
    if only in (None, "attention"):
        attention_sweep(dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
