"""Where the engine's step loop synchronises the host with the device (CUDA).

A host synchronisation inside a step leaves the device idle while the host builds the rest of that step: a
prompt chunk whose index tensors are copied from pageable memory waits for the chunk before it to finish,
then the device waits for the host. This runs one long prompt in chunks and N prompts at once (prefill, then
greedy decode) on the real engine core with `torch.cuda.set_sync_debug_mode("warn")` and counts each
synchronising call by the engine frames above it, so the list of sites is a table, not a guess.

    python bench/sync_sites.py --shape tiny --prompt-len 8192 --chunk 2048 --concurrent 8x2048
    python bench/sync_sites.py --model-dir /tmp/m8b --prompt-len 32640 --chunk 8192 --concurrent 32x8192

The decode path's syncs are expected once a burst (reading its tokens); a prompt chunk that samples nothing
should have none.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale_engine import engine_requests, prompts_of  # noqa: E402
from bench.scale_model import SHAPES, write_random_llama  # noqa: E402

ROOT = str(Path(__file__).resolve().parents[1])


class Sites:
    """Synchronising calls counted by the engine thread's frames (the innermost `depth` under services/)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.counts: collections.Counter[tuple[str, ...]] = collections.Counter()
        self.lock = threading.Lock()

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:  # type: ignore[no-untyped-def]
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "/services/" in f.filename]
        key = tuple(f"{f.filename.split('/services/')[-1]}:{f.lineno} {f.name}" for f in frames[-self.depth :])
        with self.lock:
            self.counts[key or ("(outside services/)",)] += 1

    def table(self, title: str) -> str:
        lines = [f"{title}: {sum(self.counts.values())} synchronising calls at {len(self.counts)} sites"]
        for key, n in self.counts.most_common():
            lines.append(f"  {n:6d}  " + "  <-  ".join(reversed(key)))
        return "\n".join(lines)


def count_sites(engine, prompts: list[list[int]], new_tokens: int, tag: str, depth: int) -> Sites:  # type: ignore[no-untyped-def]  # noqa: E501
    """The synchronising calls while `prompts` run at once on `engine` (started), by site."""
    sites = Sites(depth)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = sites.record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine_requests(engine, prompts, new_tokens, tag)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sites


def measure(engine, title: str, prompts: list[list[int]], new_tokens: int, depth: int) -> str:  # type: ignore[no-untyped-def]
    return count_sites(engine, prompts, new_tokens, title.split()[0], depth).table(title)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default="", help="an HF directory (default: a random --shape model in a temp dir)")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens a step")
    p.add_argument("--concurrent", default="8x2048", help="NxL prompts at once ('' to skip)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--depth", type=int, default=3, help="engine frames that name a site")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sync_sites needs CUDA: the CPU has no host-device synchronisation to find")
    from services.engine.builder import build_engine
    from services.engine.config import EngineConfig

    device = torch.device("cuda")
    model_dir = Path(a.model_dir) if a.model_dir else Path(tempfile.mkdtemp(prefix="kvmem-sync-"))
    if not (model_dir / "config.json").exists():
        write_random_llama(model_dir, a.shape, device)
    conc, conc_len = (int(x) for x in a.concurrent.split("x")) if a.concurrent else (0, 0)
    cap = max(a.prompt_len + a.new_tokens, conc * (conc_len + a.new_tokens + 64)) + 1024
    cfg = EngineConfig(
        model=str(model_dir), device="cuda", max_context=max(a.prompt_len, conc_len) + a.new_tokens + 64,
        kv_capacity=cap, prefill_chunk=a.chunk, max_running=max(64, conc), max_waiting=256,
    )  # fmt: skip
    engine, _ = build_engine(cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.runner.model.config.vocab_size
    try:
        engine_requests(engine, prompts_of(gen, vocab, 1, a.prompt_len), a.new_tokens, "warm")  # one-time costs
        if conc:
            engine_requests(engine, prompts_of(gen, vocab, conc, conc_len), a.new_tokens, "warmc")
        prompt = prompts_of(gen, vocab, 1, a.prompt_len)
        print(measure(engine, f"one prompt of {a.prompt_len} in chunks of {a.chunk}", prompt, a.new_tokens, a.depth))
        if conc:
            prompts = prompts_of(gen, vocab, conc, conc_len)
            print(measure(engine, f"{conc}x{conc_len} at once + {a.new_tokens}", prompts, a.new_tokens, a.depth))
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
