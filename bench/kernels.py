"""Page-summary and page-scoring kernels: each available backend against the torch reference.

    python bench/kernels.py --device cuda            # GPU: triton, cupy and torch
    .venv/bin/python bench/kernels.py --device cpu --contexts 2048 --reps 3   # smoke test (torch only)

Shapes: Gemma 3 270M (18 layers, 1 KV head, 4 query heads, head_dim 256) and SmolLM2 (30 layers,
3 KV heads, 9 query heads, head_dim 64) at 2K/8K/32K tokens of context (32/128/512 pages of 64).
Every timing covers all layers of the model, as the engine runs it:

    update keys   summaries of every page of the context from the gathered keys (kv_pool.gather_keys:
                  index_select of the bf16 pool rows and a widening copy to fp32, then the update):
                  what a prefix reuse / restore summarises; the torch column is the reference path
    update rows   the same straight from the bf16 pool rows (PageSummaries.update_rows: no copy)
    chunk keys    a 512-token prefill chunk's 8 pages from the gathered keys (every prefill chunk)
    score 1       one decode query token against every page (every decode step of a ring sequence)
    score 64      a 64-token query (the prompt's last turn, at re-selection)

Times are CUDA-event medians in microseconds per model (all layers); `x` is torch time / backend
time (above 1: faster than the reference). `err` is the largest relative difference from the torch
reference over the outputs (scores: pages holding at least 1e-3 of the mass).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine.summaries import page_scores_reference, summary_update_reference  # noqa: E402

logger = logging.getLogger("bench.kernels")
PAGE = 64


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int


SHAPES = [Shape("gemma3-270m", 18, 1, 4, 256), Shape("smollm2", 30, 3, 9, 64)]


def _timer(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median microseconds of `fn` (after two warm-up calls)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


class Case:
    """One model shape at one context length: a bf16 pool per layer, summary tables, queries."""

    def __init__(self, shape: Shape, num_pages: int, device: torch.device) -> None:
        g = torch.Generator(device="cpu").manual_seed(num_pages)
        self.shape, self.num_pages, self.device = shape, num_pages, device
        rows = num_pages * PAGE
        self.pool = [
            torch.randn(rows, shape.num_kv_heads, shape.head_dim, generator=g).to(device, torch.bfloat16)
            for _ in range(shape.num_layers)
        ]
        slots = torch.randperm(num_pages, generator=g).to(device)  # pages live in scattered slots
        self.rows = (slots[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)
        self.page_ids = torch.arange(num_pages, device=device)
        self.valid = torch.ones(num_pages, PAGE, dtype=torch.bool, device=device)
        self.valid[-1, PAGE // 2 :] = False  # the last page is partial
        table = (shape.num_layers, num_pages, shape.num_kv_heads, shape.head_dim)
        self.tables = [torch.zeros(table, device=device) for _ in range(3)]
        self.q = {n: torch.randn(n, shape.num_heads, shape.head_dim, generator=g).to(device, torch.bfloat16)
                  for n in (1, 64)}  # fmt: skip
        self.scale = shape.head_dim**-0.5
        self.run_update(None, num_pages, False)

    def gather(self, layer: int, pages: int) -> torch.Tensor:
        """kv_pool.gather_keys: [pages, 64, Hkv, D] fp32 copies of the pool rows."""
        rows = self.rows[: pages * PAGE]
        keys = self.pool[layer].index_select(0, rows).float()
        return keys.view(pages, PAGE, *keys.shape[1:])

    def layer_tables(self, layer: int) -> list[torch.Tensor]:
        return [t[layer] for t in self.tables]

    def run_update(self, kernels: object | None, pages: int, from_rows: bool) -> None:
        ids, valid = self.page_ids[:pages], self.valid[:pages]
        for layer in range(self.shape.num_layers):
            if kernels is None:
                summary_update_reference(*self.layer_tables(layer), ids, self.gather(layer, pages), valid)
            elif from_rows:
                kernels.summary_update(  # type: ignore[attr-defined]
                    *self.layer_tables(layer), ids, self.pool[layer], valid, rows=self.rows[: pages * PAGE]
                )
            else:
                keys = self.gather(layer, pages)
                kernels.summary_update(*self.layer_tables(layer), ids, keys.view(-1, *keys.shape[2:]), valid)  # type: ignore[attr-defined]

    def run_scores(self, kernels: object | None, num_tokens: int) -> torch.Tensor:
        score = page_scores_reference if kernels is None else kernels.page_scores  # type: ignore[attr-defined]
        total = torch.zeros(self.num_pages, device=self.device)
        kmin, kmax = self.tables[0], self.tables[1]
        for layer in range(self.shape.num_layers):
            total += score(self.q[num_tokens], kmin[layer], kmax[layer], self.scale)
        return total


def _rel_err(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """Largest |got - want| / |want| where |want| >= floor (infinities must match exactly); nan if any got is."""
    if torch.isnan(got).any():
        return float("nan")
    inf = torch.isinf(want)
    if not torch.equal(got[inf], want[inf]):
        return float("inf")
    keep = (want.abs() >= floor) & ~inf
    return float(((got - want).abs()[keep] / want.abs()[keep]).max()) if keep.any() else 0.0


def _ops(case: Case) -> dict[str, tuple[Callable[[object | None], object], Callable[[object | None], float]]]:
    """op name -> (timed call for a kernel module or None = reference, its error against the reference)."""

    def update_err(kernels: object | None, from_rows: bool, pages: int) -> float:
        case.run_update(None, pages, False)
        want = [t[:, :pages].clone() for t in case.tables]
        for t in case.tables:
            t[:, :pages] = float("nan")  # a kernel that writes nothing shows as nan
        case.run_update(kernels, pages, from_rows)
        got = [t[:, :pages] for t in case.tables]
        return max(_rel_err(g, w, 1e-6) for g, w in zip(got, want, strict=True))

    def score_err(kernels: object | None, n: int) -> float:
        want = case.run_scores(None, n)
        return _rel_err(case.run_scores(kernels, n), want, 1e-3 * float(want.sum()) / case.num_pages)

    chunk, every = min(8, case.num_pages), case.num_pages
    return {
        "update keys": (lambda k: case.run_update(k, every, False), lambda k: update_err(k, False, every)),
        "update rows": (lambda k: case.run_update(k, every, True), lambda k: update_err(k, True, every)),
        "chunk keys": (lambda k: case.run_update(k, chunk, False), lambda k: update_err(k, False, chunk)),
        "score 1": (lambda k: case.run_scores(k, 1), lambda k: score_err(k, 1)),
        "score 64": (lambda k: case.run_scores(k, 64), lambda k: score_err(k, 64)),
    }  # fmt: skip


def _backends(device: torch.device, wanted: list[str]) -> dict[str, object]:
    """Kernel modules that can run here (triton, cupy), by name."""
    found: dict[str, object] = {}
    for name in wanted:
        if name == "torch":
            continue
        if device.type != "cuda":
            logger.warning("%s skipped: kernels are timed on CUDA only (the interpreter is for tests)", name)
            continue
        try:
            found[name] = importlib.import_module(f"services.engine.kernels.summaries_{name}")
        except ImportError as e:
            logger.warning("%s skipped: %s", name, e)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--contexts", default="2048,8192,32768", help="context lengths in tokens")
    p.add_argument("--backends", default="triton,cupy")
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(a.device)
    backends = _backends(device, a.backends.split(","))
    names = list(backends)
    header = "| model | context | op | torch us | " + " | ".join(f"{n} us | {n} x | {n} err" for n in names) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for shape in SHAPES:
        for ctx in (int(c) for c in a.contexts.split(",")):
            case = Case(shape, ctx // PAGE, device)
            for op, (run, err) in _ops(case).items():
                ref = _timer(device, lambda run=run: run(None), a.reps)
                cells = [f"{ref:.0f}"]
                for name in names:
                    t = _timer(device, lambda run=run, name=name: run(backends[name]), a.reps)
                    cells += [f"{t:.0f}", f"{ref / t:.1f}", f"{err(backends[name]):.1e}"]
                print(f"| {shape.name} | {ctx // 1024}K | {op} | " + " | ".join(cells) + " |", flush=True)
            del case
    return 0


if __name__ == "__main__":
    sys.exit(main())
