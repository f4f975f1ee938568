"""Prefill and decode tokens/s of the KVMem engine vs transformers' `generate`, same model and prompt.

    .venv/bin/python bench/decode.py                    # CPU, embedded SmolLM2 GGUF
    .venv/bin/python bench/decode.py --device cuda      # GPU (bf16)

Both sides run greedy, no EOS stop, the same prompt token ids. Engine numbers go through the real
engine core (scheduler, paged KV pool, sampler, detokenizer) in-process, without gRPC.
Prints one table; ratios are engine / transformers (higher is better for the engine).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.model_files import resolve_model_path  # noqa: E402
from services.engine.builder import build_engine  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.sampling import SamplingParams  # noqa: E402
from services.engine.sequence import Chunk, Done, Failed  # noqa: E402


def engine_run(engine, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill seconds = time to first token, decode seconds for the remaining tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.submit(f"bench-{t0}", prompt, params)
    first = None
    while True:
        ev = seq.events.get()
        if isinstance(ev, Chunk) and first is None:
            first = time.perf_counter()
        if isinstance(ev, Failed):
            raise RuntimeError(ev.message)
        if isinstance(ev, Done):
            end = time.perf_counter()
            assert ev.completion_tokens == new_tokens and ev.cached_tokens == 0, ev
            assert first is not None
            return first - t0, end - first


def hf_load(path: Path, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def hf_run(model, prompt: list[int], new_tokens: int, device: torch.device) -> tuple[float, float]:
    ids = torch.tensor([prompt], device=device)
    _sync(device)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
    _sync(device)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    _sync(device)
    t2 = time.perf_counter()
    prefill = t1 - t0
    return prefill, (t2 - t1) - prefill


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-lens", default="128,1024,4096")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    lens = [int(x) for x in a.prompt_lens.split(",")]
    cfg = EngineConfig(model=a.model, device=a.device, max_context=8192, kv_capacity=8192, prefill_chunk=2048)
    engine, info = build_engine(cfg)
    device = cfg.torch_device
    hf = hf_load(resolve_model_path(a.model), device, cfg.torch_dtype)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in lens:
        # a fresh prompt per repeat: the engine's prefix cache must not turn prefill into a lookup
        prompts = [torch.randint(100, info.vocab_size, (n,), generator=gen).tolist() for _ in range(a.repeats)]
        warm = torch.randint(100, info.vocab_size, (16,), generator=gen).tolist()  # shares no prefix
        engine_run(engine, warm, 4)
        hf_run(hf, warm, 4, device)
        e = [engine_run(engine, pr, a.new_tokens) for pr in prompts]
        h = [hf_run(hf, pr, a.new_tokens, device) for pr in prompts]
        ep, ed = statistics.median(x[0] for x in e), statistics.median(x[1] for x in e)
        hp, hd = statistics.median(x[0] for x in h), statistics.median(x[1] for x in h)
        d = a.new_tokens - 1
        rows.append((n, n / ep, n / hp, d / ed, d / max(hd, 1e-9)))
        engine.slots.check_integrity()
    engine.stop()
    print(
        f"\nmodel {info.model_id} ({info.architecture}), device {info.device}, dtype {info.dtype}, "
        f"threads {torch.get_num_threads()}, new tokens {a.new_tokens}, median of {a.repeats}"
    )
    print(f"{'prompt':>7} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | {'decode tok/s':>12} {'hf':>8} {'ratio':>6}")
    for n, ep, hp, ed, hd in rows:
        print(f"{n:>7} | {ep:>13.1f} {hp:>9.1f} {ep / hp:>6.2f} | {ed:>12.1f} {hd:>8.1f} {ed / hd:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
