"""Time to first token for prompts of lengths the engine has not seen, with and without cuDNN attention (CUDA).

    PYTHONPATH=. python3 bench/prefill_shapes.py --device cuda

The engine's masked SDPA (services/engine/attention.sdpa) keeps torch from choosing cuDNN, which builds an
execution plan for every new shape; a prefill's key count changes with each chunk, prompt length and ring
selection. This bench prefills fresh random prompts on random-weight Gemma 3 270M (speed, not quality;
4K pool, the ring and a host KV store past it) and times the first token, at each length first with shapes
never seen ("cold") and then again with a fresh prompt of the same length ("again"), for the engine as it is
and for the baseline that lets torch choose (cuDNN allowed). The two variants use lengths 33 tokens apart,
so neither reuses the other's shapes; both first run a short prompt and one past the pool (one-time costs:
library loads, Triton variants, the ring's first use, registering the host arena).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import services.engine.kv.attention as attention  # noqa: E402
from bench.decode import engine_run, write_random_gemma  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402

LENGTHS = (1500, 2600, 3700, 5200, 7000, 9500, 12000)
VARIANTS = ("engine", "cudnn allowed")


def _torch_choice(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:  # noqa: E501
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths (comma-separated)")
    a = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    device = torch.device(a.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print("prefill_shapes.py measures cuDNN attention: it needs a CUDA device")
        return 2
    lengths = [int(x) for x in a.lengths.split(",")]
    engine_sdpa = attention.sdpa
    gen = torch.Generator().manual_seed(0)
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        os.environ["KVMEM_CACHE_DIR"] = str(tmp / "cache")
        write_random_gemma(tmp / "gemma", 0, device)  # the transformers model it returns is not used here
        from bench.store import kvstore, redis_server

        url = stack.enter_context(redis_server())
        stack.enter_context(kvstore(url, 4096, "--arena-dir", "/dev/shm"))
        cfg = EngineConfig(
            model=str(tmp / "gemma"), device="cuda", prefill_chunk=2048, max_context=32768, kv_capacity=4096,
            max_running=16, redis_url=url, host_kv_mib=4096,
        )  # fmt: skip
        engine, info = build_engine(cfg)
        stack.callback(engine.stop)

        def ttft(variant: str, n: int, tag: str) -> float:
            attention.sdpa = engine_sdpa if variant == "engine" else _torch_choice  # grouped_sdpa's call
            try:
                prompt = torch.randint(100, info.vocab_size, (n,), generator=gen).tolist()
                return engine_run(engine, prompt, 1, f"{tag}-{variant}-{n}")[0]
            finally:
                attention.sdpa = engine_sdpa

        for i, variant in enumerate(VARIANTS):  # one-time costs: libraries, Triton variants, the ring's first use
            ttft(variant, 700 + i, "first")
            ttft(variant, 4500 + i, "first")
        cold: dict[str, list[float]] = {v: [] for v in VARIANTS}
        again: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for rounds, store in (("cold", cold), ("again", again)):
            for n in lengths:
                for i, variant in enumerate(VARIANTS):
                    store[variant].append(ttft(variant, n + 33 * i, rounds))
        print(f"time to first token, ms (random Gemma 3 270M, 4K pool, {torch.cuda.get_device_name(device)})")
        head = f"{'length':>7} | {'cold: engine':>12} {'cudnn':>9} {'x':>6} | {'again: engine':>13} {'cudnn':>9}"
        print(f"{head} {'x':>6}")
        for j, n in enumerate(lengths):
            ce, cc, ae, ac = cold["engine"][j], cold[VARIANTS[1]][j], again["engine"][j], again[VARIANTS[1]][j]
            cold_part = f"{1e3 * ce:12.0f} {1e3 * cc:9.0f} {cc / ce:5.2f}x"
            print(f"{n:7d} | {cold_part} | {1e3 * ae:13.0f} {1e3 * ac:9.0f} {ac / ae:5.2f}x")
        for name, store in (("cold", cold), ("again", again)):
            e, c = sum(store["engine"]), sum(store[VARIANTS[1]])
            med = statistics.median(x / y for x, y in zip(store[VARIANTS[1]], store["engine"], strict=True))
            print(f"{name}: all lengths {1e3 * e:.0f} ms (engine) vs {1e3 * c:.0f} ms (cudnn allowed): "
                  f"{c / e:.2f}x, median per length {med:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
